"""One streamed request as a load campaign records it: every SSE line stamped with `time.perf_counter()` as it
arrives, before it is parsed, then turned into a row (`StreamRow`: send times, time to headers, TTFT, every
inter-token gap, E2EL, tokens, status, reason, path, replica). What each field means: loadtests/README.md.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields

from base.contracts import REPLICA_HEADER, SERVE_PATH_HEADER, SERVE_REASON_HEADER

DONE = "[DONE]"


@dataclass
class StreamRow:
    """One request's measures (seconds; times are `perf_counter` readings of the process that sent it)."""

    workload: str
    session: str
    planned_at: float  # when the schedule wanted it sent (= sent_at for closed-loop users)
    sent_at: float
    status: int = 0
    headers_s: float | None = None
    ttft_s: float | None = None
    e2el_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)
    chunks: int = 0  # text-carrying events
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    # multi_turn: the leading tokens of this prompt that the session's previous turn computed (its prompt and its
    # answer, as the engine ran them): the most any prefix cache can hit.
    reusable_tokens: int = 0
    reason: str = ""
    path: str = ""
    replica: str = ""
    error: str = ""
    worker: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error

    @property
    def schedule_lag_s(self) -> float:
        return self.sent_at - self.planned_at

    def csv_row(self) -> dict[str, object]:
        row = asdict(self)
        row["gaps_s"] = " ".join(f"{gap:.6f}" for gap in self.gaps_s)
        return row

    @classmethod
    def from_csv(cls, row: dict[str, str]) -> StreamRow:
        values: dict[str, object] = {}
        for spec in fields(cls):
            raw = row.get(spec.name, "")
            if spec.name == "gaps_s":
                values[spec.name] = [float(v) for v in raw.split()]
            elif spec.type in ("float", "float | None"):
                values[spec.name] = float(raw) if raw not in ("", "None") else None
            elif spec.type == "int":
                values[spec.name] = int(raw or 0)
            else:
                values[spec.name] = raw
        return cls(**values)  # type: ignore[arg-type]


CSV_FIELDS = [spec.name for spec in fields(StreamRow)]


@dataclass
class StreamOutput:
    """What a stream generated: its text and, when the request asked for them (vLLM's `return_token_ids`), the
    prompt's and the answer's token ids as the engine ran them."""

    text: str = ""
    prompt_token_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)


def _event_text(event: dict[str, object]) -> str:
    """The generated text an OpenAI stream event carries (chat delta content or tool-call arguments, or
    completion text)."""
    text = []
    for choice in event.get("choices") or []:  # type: ignore[union-attr]
        delta = choice.get("delta") or {}
        text.append(choice.get("text") or delta.get("content") or delta.get("reasoning_content") or "")
        for call in delta.get("tool_calls") or []:
            text.append((call.get("function") or {}).get("arguments") or "")
    return "".join(text)


def record_stream(
    row: StreamRow, status: int, headers: dict[str, str], headers_at: float, lines: Iterable[tuple[float, str]]
) -> StreamOutput:
    """Fill `row` from the response: its status and headers (received at `headers_at`) and its body lines, each
    with the `perf_counter()` reading taken when it arrived. Returns what it generated."""
    row.status = status
    row.headers_s = headers_at - row.sent_at
    row.reason = headers.get(SERVE_REASON_HEADER, "")
    row.path = headers.get(SERVE_PATH_HEADER, "")
    row.replica = headers.get(REPLICA_HEADER, "")
    last_text_at: float | None = None
    ended_at = headers_at
    output = StreamOutput()
    generated = []
    for at, line in lines:
        ended_at = at
        if not line.startswith("data: "):
            continue
        payload = line[len("data: ") :]
        if payload == DONE:
            continue
        try:
            event = json.loads(payload)
        except ValueError:
            row.error = "unparseable event"
            continue
        usage = event.get("usage") or {}
        if usage:
            row.output_tokens = int(usage.get("completion_tokens") or 0)
            row.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            row.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        output.prompt_token_ids.extend(event.get("prompt_token_ids") or [])
        for choice in event.get("choices") or []:
            output.token_ids.extend(choice.get("token_ids") or [])
        text = _event_text(event)
        if not text:
            continue
        generated.append(text)
        row.chunks += 1
        if last_text_at is None:
            row.ttft_s = at - row.sent_at
        else:
            row.gaps_s.append(at - last_text_at)
        last_text_at = at
    row.e2el_s = ended_at - row.sent_at
    output.text = "".join(generated)
    return output
