"""Replay recorded OpenAI requests against a path, or against two paths side by side (`sluice replay`).

A recording is JSONL, one request per line (`at_s`, `method`, `path`, `headers`, `body`), sent at its recorded
offset; with two targets every request goes to both and the status, the chunk schema and the text are compared.
Format and comparison: loadtests/README.md (replay).
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from base import sse

MAX_IN_FLIGHT_DEFAULT = 32
REQUEST_TIMEOUT_S = 120.0


class RecordedRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    at_s: float = Field(0.0, ge=0)
    method: str = "POST"
    path: str = Field(pattern=r"^/")
    headers: dict[str, str] = Field(default_factory=dict)
    body: dict[str, Any] | None = None


class Answer(BaseModel):
    """What a path answered to one request."""

    status: int
    # [keys of the response's JSON objects (each SSE chunk, or the whole body), keys of their choices], sorted.
    schema_keys: list[list[str]]
    text: str
    error: str | None = None


class RecordingError(ValueError):
    """A recording line that is not a request; the message names the line."""


def load_recording(path: Path) -> list[RecordedRequest]:
    requests = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            requests.append(RecordedRequest.model_validate_json(line))
        except ValidationError as error:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'line'}: {e['msg']}" for e in error.errors())
            raise RecordingError(f"{path}:{number}: {problems}") from None
    return requests


def _schema(objects: list[dict[str, Any]]) -> list[list[str]]:
    """[every top-level key the chunks carry, every key their choices carry]: which fields a client can rely on,
    whatever number of chunks the tokens came in."""
    choices = [c for o in objects for c in o.get("choices") or [] if isinstance(c, dict)]
    return [sorted({k for o in objects for k in o}), sorted({k for c in choices for k in c})]


def _text(objects: list[dict[str, Any]]) -> str:
    parts = []
    for o in objects:
        for choice in o.get("choices") or []:
            message = choice.get("delta") or choice.get("message") or {}
            parts.append(message.get("content") or choice.get("text") or "")
    return "".join(parts)


async def send(client: httpx.AsyncClient, base_url: str, request: RecordedRequest) -> Answer:
    """One recorded request to `base_url`; a transport failure is an answer with status 0 and the error."""
    body = json.dumps(request.body).encode() if request.body is not None else b""
    headers = {"content-type": "application/json", "accept-encoding": "identity", **request.headers}
    try:
        async with client.stream(request.method, base_url + request.path, content=body, headers=headers) as response:
            if response.headers.get("content-type", "").startswith("text/event-stream"):
                payloads = sse.data_payloads([line async for line in sse.aiter_lines(response.aiter_bytes())])
                objects = [json.loads(p) for p in payloads if p != sse.DONE]
            else:
                parsed = json.loads(await response.aread() or b"null")
                objects = [parsed] if isinstance(parsed, dict) else []
    except (httpx.HTTPError, ValueError) as error:
        return Answer(status=0, schema_keys=[], text="", error=f"{type(error).__name__}: {error}")
    return Answer(status=response.status_code, schema_keys=_schema(objects), text=_text(objects))


def differences(first: Answer, second: Answer) -> list[str]:
    """How two paths' answers to one request differ (empty: they agree)."""
    found = []
    if first.error or second.error:
        found.append(f"error: {first.error or '-'} | {second.error or '-'}")
    if first.status != second.status:
        found.append(f"status {first.status} != {second.status}")
    if first.schema_keys != second.schema_keys:
        found.append(f"chunk schema {first.schema_keys} != {second.schema_keys}")
    if first.text != second.text:
        found.append(f"text {first.text[:60]!r} != {second.text[:60]!r}")
    return found


async def replay(
    recording: list[RecordedRequest],
    targets: list[str],
    speed: float = 1.0,
    max_in_flight: int = MAX_IN_FLIGHT_DEFAULT,
    transport: httpx.AsyncBaseTransport | None = None,
) -> list[list[Answer]]:
    """Each request's answers, one per target, in recording order."""
    limit = asyncio.Semaphore(max_in_flight)
    start = time.monotonic()
    limits = httpx.Limits(max_connections=max_in_flight * len(targets))
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits, transport=transport) as client:

        async def one(request: RecordedRequest) -> list[Answer]:
            await asyncio.sleep(max(0.0, start + request.at_s / speed - time.monotonic()))
            async with limit:
                return list(await asyncio.gather(*(send(client, target, request) for target in targets)))

        return list(await asyncio.gather(*(one(request) for request in recording)))


def report(answers: list[list[Answer]], recording: list[RecordedRequest]) -> tuple[dict[str, Any], bool]:
    """A summary (and whether the replay is clean: every request answered, both paths agreeing when compared)."""
    compared = len(answers[0]) == 2 if answers else False
    failed = [i for i, per_target in enumerate(answers) if any(a.error for a in per_target)]
    summary: dict[str, Any] = {
        "requests": len(answers),
        "statuses": sorted({a.status for per_target in answers for a in per_target}),
        "unanswered": len(failed),
    }
    clean = not failed
    if compared:
        diffs = {i: differences(*per_target) for i, per_target in enumerate(answers)}
        differing = {i: d for i, d in diffs.items() if d}
        summary["identical"] = len(answers) - len(differing)
        summary["differences"] = [
            {"request": i + 1, "path": recording[i].path, "differences": d} for i, d in sorted(differing.items())
        ]
        clean = clean and not differing
    return summary, clean
