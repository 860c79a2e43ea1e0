"""The Locust user of a sluice campaign (run by `loadtests.campaign`, never imported with Ray: docs/design.md §5).

The campaign's settings are Locust options of this file (`--sluice-*`, each defaulting to its `SLUICE_LOAD_*`
variable): a master sends them to its workers, on this machine or on others. Each user streams line by line as bytes
arrive, stamps every line with `time.perf_counter()` before parsing, and keeps its process's rows. A lone process
writes them to the rows folder when the test stops; a worker sends them to its master (a Locust message), which
moves their times onto its own clock (through each side's wall clock) and writes them there. A master ends the run
itself after the duration: it tells its workers to stop their users (a message of ours: Locust's own stop keeps a
worker idle for the stop timeout), waits for every worker's rows, then quits (Locust's `--run-time` would quit before
a worker has sent them). Closed and open loop, and why: loadtests/README.md.
"""

from __future__ import annotations

import csv
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gevent
import requests
from locust import HttpUser, events, task
from locust.runners import MasterRunner, WorkerRunner

from base import sse
from loadtests.dataset import read_dataset
from loadtests.lengths import Lengths
from loadtests.sse_timing import CSV_FIELDS, StreamOutput, StreamRow, record_stream
from loadtests.workloads import PromptMaker, Request, Workload


def _optional_rate(text: str) -> float | None:
    """An open loop's rate, or none (empty): the workload's own loop."""
    return float(text) if text else None


# Each setting: how its text is read and its default (the `SLUICE_LOAD_<NAME>` variable overrides the default).
# `headers` (a JSON object: an API key among them) comes only from the environment the campaign sets, never the
# command line, where any process on the machine could read it.
OPTIONS: dict[str, tuple[Callable[[str], Any], str]] = {
    "workload": (str, "short_long"),
    "model": (str, "sluice-tiny"),
    "tokenizer": (str, ""),
    "rows_dir": (str, "."),
    "rate": (_optional_rate, ""),
    "burstiness": (float, "1"),
    "duration_s": (float, "60"),
    "session_header": (str, "x-session-id"),
    "seed": (int, "0"),
    # `Lengths` as JSON: a master sends its workers the options' values as they are (msgpack: no pydantic models).
    "lengths": (str, "{}"),
    "dataset": (str, ""),
    "headers": (json.loads, "{}"),
}
ROWS_MESSAGE = "sluice_rows"
STOP_MESSAGE = "sluice_stop"
# How long a master waits, after the duration, for the rows of every worker that ran: a worker first lets its users
# finish their requests (Locust's stop timeout, `campaign.STOP_TIMEOUT_S`).
ROWS_WAIT_S = 60.0


def _default(name: str) -> Any:
    kind, default = OPTIONS[name]
    return kind(os.environ.get(f"SLUICE_LOAD_{name.upper()}", default))


# The campaign's settings: the defaults until the test starts, then the options this process (or its master) got.
SETTINGS: dict[str, Any] = {name: _default(name) for name in OPTIONS}
ROWS: list[StreamRow] = []
WORKER = f"{os.uname().nodename}-{os.getpid()}"
_workload: Workload | None = None
_schedule: list[float] = []
_started_at = 0.0
_rows_from: set[str] = set()


@events.init_command_line_parser.add_listener
def _options(parser) -> None:
    for name, (kind, _) in OPTIONS.items():
        flag = f"--sluice-{name.replace('_', '-')}"
        parser.add_argument(flag, type=kind, default=_default(name), include_in_web_ui=False)


@events.init.add_listener
def _on_init(environment, **_kwargs) -> None:
    if isinstance(environment.runner, MasterRunner):
        environment.runner.register_message(ROWS_MESSAGE, _received_rows)
    elif isinstance(environment.runner, WorkerRunner):
        environment.runner.register_message(STOP_MESSAGE, lambda environment, **_: environment.runner.stop())


def _settings(environment) -> dict[str, Any]:
    options = environment.parsed_options
    return {name: getattr(options, f"sluice_{name}") for name in OPTIONS}


def workload() -> Workload:
    global _workload
    if _workload is None:
        prompts = PromptMaker(Path(SETTINGS["tokenizer"]), seed=SETTINGS["seed"] + os.getpid())
        dataset = read_dataset(Path(SETTINGS["dataset"]), prompts.count) if SETTINGS["dataset"] else ()
        _workload = Workload(
            SETTINGS["workload"],
            SETTINGS["model"],
            prompts,
            rate=SETTINGS["rate"],
            burstiness=SETTINGS["burstiness"],
            duration_s=SETTINGS["duration_s"],
            seed=SETTINGS["seed"] + os.getpid(),
            prefix_seed=SETTINGS["seed"],  # the system prompts every process of the campaign shares
            lengths=Lengths.model_validate_json(SETTINGS["lengths"]),
            dataset=dataset,
        )
    return _workload


@events.test_start.add_listener
def _plan(environment, **_kwargs) -> None:
    """Take the settings (a worker has its master's by now) and plan the run."""
    global _started_at
    SETTINGS.update(_settings(environment))
    if isinstance(environment.runner, MasterRunner):
        gevent.spawn(_end_run, environment.runner)
        return
    _started_at = time.perf_counter()
    if workload().loop == "open":
        _schedule[:] = [_started_at + at for at in workload().arrivals()]


@events.test_stop.add_listener
def _hand_over_rows(environment, **_kwargs) -> None:
    if isinstance(environment.runner, MasterRunner):
        return
    rows = [row.csv_row() for row in ROWS]
    if isinstance(environment.runner, WorkerRunner):
        clock = time.time() - time.perf_counter()
        environment.runner.send_message(ROWS_MESSAGE, {"worker": WORKER, "clock": clock, "rows": rows})
    else:
        _write_rows(WORKER, rows)


def _received_rows(environment, msg, **_kwargs) -> None:
    """A worker's rows, moved onto this process's perf_counter clock (both sides' wall clocks agree across machines
    kept in time; on one machine the shift is the read's own microseconds)."""
    shift = msg.data["clock"] - (time.time() - time.perf_counter())
    rows = msg.data["rows"]
    for row in rows:
        row["sent_at"] = float(row["sent_at"]) + shift
        row["planned_at"] = float(row["planned_at"]) + shift
    _write_rows(msg.data["worker"], rows)
    _rows_from.add(msg.node_id)


def _write_rows(worker: str, rows: list[dict[str, Any]]) -> None:
    with (Path(SETTINGS["rows_dir"]) / f"rows-{worker}.csv").open("w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=CSV_FIELDS)
        writer.writeheader()
        writer.writerows(rows)


def _end_run(runner: MasterRunner) -> None:
    """After the duration: the workers stop their users and send their rows; once every worker's are in, quit."""
    gevent.sleep(SETTINGS["duration_s"])
    ran = set(runner.clients)
    runner.send_message(STOP_MESSAGE)
    deadline = time.monotonic() + ROWS_WAIT_S
    while not ran <= _rows_from and time.monotonic() < deadline:
        gevent.sleep(0.1)
    runner.quit()


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
        headers = {**SETTINGS["headers"], "accept-encoding": "identity"}
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
                lines = ((time.perf_counter(), line) for line in sse.iter_lines(response.iter_content(chunk_size=None)))
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
