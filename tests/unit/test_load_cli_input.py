"""`sluice load` given bad input: a clear message and a usage exit (2), or the unreachable exit (3) for a target that
does not answer, before any load is sent and with no traceback."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from sluice.cli.main import main
from sluice.deploy.exit_codes import EXIT_UNREACHABLE, EXIT_USAGE


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--gate", "ttft_p99_ms"], "--gate 'ttft_p99_ms': give NAME=LIMIT"),
        (["--gate", "ttft_p99_ms=fast"], "give NAME=LIMIT"),
        (["--gate", "ttft_p999_ms=500"], "unknown gate 'ttft_p999_ms'"),
        (["--duration", "90000"], "duration_s: Input should be less than or equal to 86400"),
        (["--users", "0"], "users: Input should be greater than or equal to 1"),
        (["--spec", "/nonexistent/stack.yaml"], "--spec /nonexistent/stack.yaml"),
        (["--master", "--workers", "2"], "local workers (--workers) and a master for remote ones (--master) exclude"),
        (["--master", "--expect-workers", "0"], "master.expect_workers: Input should be greater than or equal to 1"),
        (["--master", "--master-port", "70000"], "master.port: Input should be less than or equal to 65535"),
    ],
    ids=[
        "gate-without-value",
        "gate-not-a-number",
        "unknown-gate",
        "duration-past-a-day",
        "no-users",
        "no-spec",
        "master-and-local-workers",
        "master-expecting-no-worker",
        "master-port-out-of-range",
    ],
)
def test_a_bad_value_is_a_usage_error_before_any_load(
    arguments: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = f"http://127.0.0.1:{_closed_port()}"
    code = main(["load", "mixed", "--target", target, "--out", str(tmp_path / "out"), *arguments])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and message in err, err
    assert "Traceback" not in err and not (tmp_path / "out").exists()


def test_an_unknown_workload_and_a_missing_target_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["load", "mixd", "--target", "http://127.0.0.1:9"]) == EXIT_USAGE
    assert "unknown workload 'mixd'" in capsys.readouterr().err
    assert main(["load", "mixed"]) == EXIT_USAGE
    assert "--target is required" in capsys.readouterr().err


def test_an_unreachable_target_exits_3_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = f"http://127.0.0.1:{_closed_port()}"
    code = main(["load", "mixed", "--target", target, "--duration", "5", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == EXIT_UNREACHABLE and f"the target {target} cannot be reached" in err, err
    assert "Traceback" not in err and not (tmp_path / "out").exists()


@contextmanager
def _models_answering(body: bytes) -> Iterator[str]:
    """A loopback server whose every GET answers 200 with `body`: a target that is up but lists no model."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(
    ("body", "message"), [(b"not json", "answered no OpenAI model list"), (b'{"data": []}', "serves no model")]
)
def test_a_target_listing_no_model_exits_3_saying_so(
    body: bytes, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with _models_answering(body) as target:
        code = main(["load", "mixed", "--target", target, "--duration", "5", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == EXIT_UNREACHABLE and message in err, err
    assert "Traceback" not in err and not (tmp_path / "out").exists()


def test_vllm_bench_serve_flag_names_give_the_same_campaign() -> None:
    from sluice.cli.load import _campaign
    from sluice.cli.main import build_parser

    ours = ["load", "bursts", "--target", "http://127.0.0.1:8000", "--rate", "12", "--slo-ttft-ms", "200"]
    ours += ["--slo-tpot-ms", "50"]
    vllms = ["load", "bursts", "--base-url", "http://127.0.0.1:8000", "--request-rate", "12"]
    vllms += ["--goodput", "ttft:200", "tpot:50"]
    first, second = (_campaign(build_parser().parse_args(argv)) for argv in (ours, vllms))
    assert first == second and second.rate == 12.0
    assert (second.slo.ttft_ms, second.slo.tpot_ms, second.slo.e2el_ms) == (200.0, 50.0, None)


@pytest.mark.parametrize(
    ("goodput", "message"),
    [
        (["--goodput", "ttfb:200"], "the name is one of ttft, tpot, e2el"),
        (["--goodput", "ttft:fast"], "give NAME:MS"),
        (["--goodput", "ttft:200", "--slo-ttft-ms", "300"], "ttft is also set by --slo-ttft-ms"),
    ],
)
def test_a_bad_goodput_is_a_usage_error(goodput: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["load", "mixed", "--target", f"http://127.0.0.1:{_closed_port()}", *goodput]) == EXIT_USAGE
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("duration", ["90000", "0", "two-hours"])
@pytest.mark.parametrize("bench", ["soak", "overload"])
def test_a_stack_bench_refuses_a_duration_no_campaign_runs_before_starting_anything(
    bench: str, duration: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The soak once deployed its stack and then failed with a traceback on a 2-hour duration (campaigns ran an
    hour at most)."""
    with pytest.raises(SystemExit) as exited:
        main(["bench", bench, "--duration", duration])
    err = capsys.readouterr().err
    assert exited.value.code == EXIT_USAGE and "argument --duration" in err and "Traceback" not in err, err
