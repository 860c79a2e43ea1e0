"""One streamed request as a load campaign records it: every SSE line stamped with `time.perf_counter()` as it
arrives, before it is parsed, then turned into a row (`StreamRow`: send times, time to headers, TTFT, every
inter-token gap, E2EL, tokens, status, reason, path, replica). What each field means: loadtests/README.md.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from base.contracts import REPLICA_HEADER, SERVE_PATH_HEADER, SERVE_REASON_HEADER
from base.sse import DATA_PREFIX, DONE


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


def write_rows(path: Path, rows: Iterable[StreamRow]) -> None:
    """`rows` as a CSV file of `CSV_FIELDS` (what `StreamRow.from_csv` reads back)."""
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_FIELDS)
        writer.writeheader()
        writer.writerows(row.csv_row() for row in rows)


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
    for choice in _dicts(event.get("choices")):
        delta = _dict(choice.get("delta"))
        text.append(_text(choice.get("text")) or _text(delta.get("content")) or _text(delta.get("reasoning_content")))
        for call in _dicts(delta.get("tool_calls")):
            text.append(_text(_dict(call.get("function")).get("arguments")))
    return "".join(text)


# A stream's events come from a server under test: any field may be missing or of another type.
def _dict(value: object) -> dict[str, object]:
    return value if isinstance(value, dict) else {}


def _dicts(value: object) -> list[dict[str, object]]:
    return [item for item in value if isinstance(item, dict)] if isinstance(value, list) else []


def _text(value: object) -> str:
    return value if isinstance(value, str) else ""


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _ints(value: object) -> list[int]:
    return [item for item in value if isinstance(item, int)] if isinstance(value, list) else []


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
        if not line.startswith(DATA_PREFIX):
            continue
        payload = line[len(DATA_PREFIX) :]
        if payload == DONE:
            continue
        try:
            event = json.loads(payload)
        except (ValueError, RecursionError):
            event = None
        if not isinstance(event, dict):
            row.error = "unparseable event"
            continue
        usage = _dict(event.get("usage"))
        if usage:
            row.output_tokens = _count(usage.get("completion_tokens"))
            row.prompt_tokens = _count(usage.get("prompt_tokens"))
            row.cached_tokens = _count(_dict(usage.get("prompt_tokens_details")).get("cached_tokens"))
        output.prompt_token_ids.extend(_ints(event.get("prompt_token_ids")))
        for choice in _dicts(event.get("choices")):
            output.token_ids.extend(_ints(choice.get("token_ids")))
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
