"""The Locust user of a sluice campaign (run by `loadtests.campaign`, never imported with Ray: docs/design.md §5).

Settings come from the environment the campaign runner sets (`SLUICE_LOAD_*`). Each user streams line by line as
bytes arrive, stamps every line with `time.perf_counter()` before parsing, and writes its process's rows when the
test stops. Closed and open loop, and why: loadtests/README.md.
"""

from __future__ import annotations

import csv
import os
import time
from pathlib import Path

import gevent
import requests
from locust import HttpUser, events, task
from locust.runners import MasterRunner

from loadtests.sse_timing import CSV_FIELDS, StreamOutput, StreamRow, record_stream
from loadtests.workloads import PromptMaker, Request, Workload

SETTINGS = {
    "workload": os.environ.get("SLUICE_LOAD_WORKLOAD", "short_long"),
    "model": os.environ.get("SLUICE_LOAD_MODEL", "sluice-tiny"),
    "tokenizer": os.environ.get("SLUICE_LOAD_TOKENIZER", ""),
    "rows_dir": os.environ.get("SLUICE_LOAD_ROWS_DIR", "."),
    "rate": float(os.environ.get("SLUICE_LOAD_RATE", "4")),
    "burstiness": float(os.environ.get("SLUICE_LOAD_BURSTINESS", "1")),
    "duration_s": float(os.environ.get("SLUICE_LOAD_DURATION_S", "60")),
    "session_header": os.environ.get("SLUICE_LOAD_SESSION_HEADER", "x-session-id"),
    "seed": int(os.environ.get("SLUICE_LOAD_SEED", "0")),
}
ROWS: list[StreamRow] = []
WORKER = f"{os.uname().nodename}-{os.getpid()}"
_workload: Workload | None = None
_schedule: list[float] = []
_started_at = 0.0


def workload() -> Workload:
    global _workload
    if _workload is None:
        prompts = PromptMaker(Path(SETTINGS["tokenizer"]), seed=SETTINGS["seed"] + os.getpid())
        _workload = Workload(
            SETTINGS["workload"],
            SETTINGS["model"],
            prompts,
            rate=SETTINGS["rate"],
            burstiness=SETTINGS["burstiness"],
            duration_s=SETTINGS["duration_s"],
            seed=SETTINGS["seed"] + os.getpid(),
            prefix_seed=SETTINGS["seed"],  # the system prompts every process of the campaign shares
        )
    return _workload


@events.test_start.add_listener
def _plan(environment, **_kwargs) -> None:
    global _started_at
    if isinstance(environment.runner, MasterRunner):
        return
    _started_at = time.perf_counter()
    if workload().loop == "open":
        _schedule[:] = [_started_at + at for at in workload().arrivals()]


@events.test_stop.add_listener
def _write_rows(environment, **_kwargs) -> None:
    if isinstance(environment.runner, MasterRunner):
        return
    path = Path(SETTINGS["rows_dir"]) / f"rows-{WORKER}.csv"
    with path.open("w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for row in ROWS:
            writer.writerow(row.csv_row())


class StreamingUser(HttpUser):
    """One simulated client: a conversation (multi-turn) or a sequence of single requests."""

    def on_start(self) -> None:
        self.http = requests.Session()
        self.conversation = workload().new_conversation()

    @task
    def send(self) -> None:
        planned = None
        if workload().loop == "open":
            if not _schedule:
                gevent.sleep(0.2)
                return
            planned = _schedule.pop(0)
            gevent.sleep(max(0.0, planned - time.perf_counter()))
        if self.conversation.turns_left <= 0:
            self.conversation = workload().new_conversation()
        request = workload().next_request(self.conversation)
        row, output = self.stream(request, planned)
        if workload().name == "multi_turn":
            row.reusable_tokens = self.conversation.answered(output)

    def stream(self, request: Request, planned: float | None) -> tuple[StreamRow, StreamOutput]:
        headers = {"accept-encoding": "identity"}
        if SETTINGS["session_header"] and request.send_session:  # empty, or not sent: header-less traffic
            headers[SETTINGS["session_header"]] = request.session
        # The request is built before the clock starts: TTFT counts the wire and the server, not JSON encoding.
        url = f"{self.host}{request.path}"
        prepared = self.http.prepare_request(requests.Request("POST", url, json=request.body, headers=headers))
        sent = time.perf_counter()
        row = StreamRow(
            SETTINGS["workload"], request.session, planned if planned is not None else sent, sent, worker=WORKER
        )
        output = StreamOutput()
        try:
            with self.http.send(prepared, stream=True, timeout=600) as response:
                headers_at = time.perf_counter()
                lines = (
                    (time.perf_counter(), line) for line in response.iter_lines(chunk_size=None, decode_unicode=True)
                )
                output = record_stream(row, response.status_code, dict(response.headers), headers_at, lines)
        except requests.RequestException as error:  # a refused connection or a cut stream is a row too
            row.error = type(error).__name__
        ROWS.append(row)
        # Locust's own table counts each request with its TTFT (its default would be the time to the headers).
        events.request.fire(
            request_type="TTFT",
            name=request.path,
            response_time=(row.ttft_s or 0.0) * 1000,
            response_length=row.output_tokens,
            exception=None if row.ok else RuntimeError(f"{row.status} {row.reason or row.error}"),
            context={},
        )
        return row, output
