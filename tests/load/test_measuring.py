"""The campaign's measuring code against an SSE test server with known timing (TTFT 50 ms, a token every 20 ms):
Locust in processes of its own, as `sluice load` runs it."""

from __future__ import annotations

import csv
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from base.runtime import free_port
from loadtests.campaign import LOCUST_CSV_PREFIX, LOCUST_HTML, Campaign, run
from sluice.deploy.exit_codes import EXIT_INCOMPLETE
from tests.support.known_timing_server import GAP_MS, TTFT_MS, start

ROOT = Path(__file__).resolve().parents[2]


def campaign(url: str, out: Path, tiny_model_dir: Path, **settings) -> Campaign:
    return Campaign(target=url, out=out, tokenizer=tiny_model_dir / "tokenizer.json", **settings)


def test_ttft_and_itl_are_measured_within_2_ms(server: str, truth: Path, tmp_path: Path, tiny_model_dir: Path) -> None:
    """The truth is when the server wrote each event (the machine's monotonic clock, which the client's
    perf_counter reads too): TTFT from the client's send, ITL between the server's writes."""
    truth.write_text("")
    summary, breached = run(campaign(server, tmp_path, tiny_model_dir, workload="short_long", users=2, duration_s=4))
    assert summary.ok >= 10 and not breached
    with (tmp_path / "rows.csv").open() as handle:
        sent_at = {row["session"]: float(row["sent_at"]) for row in csv.DictReader(handle)}
    streams = [json.loads(line) for line in truth.read_text().splitlines()]
    assert {s["session"] for s in streams} == set(sent_at) and len(streams) == summary.requests
    true_ttft_ms = 1000 * statistics.median(s["sent_at"][0] - sent_at[s["session"]] for s in streams)
    true_itl_ms = 1000 * statistics.median(
        b - a for s in streams for a, b in zip(s["sent_at"], s["sent_at"][1:], strict=False)
    )
    assert abs(true_itl_ms - GAP_MS) < 5  # the server kept (about) its timing
    assert abs(summary.ttft.p50_ms - true_ttft_ms) <= 2, (summary.ttft, true_ttft_ms)
    assert abs(summary.itl.p50_ms - true_itl_ms) <= 2, (summary.itl, true_itl_ms)
    assert summary.chunks_per_token == 1.0
    # Locust's own notion (the time to the headers) is not TTFT: the headers come at once.
    assert summary.time_to_headers.p50_ms < TTFT_MS / 2
    assert set(summary.per_replica) == {"known-1"} and summary.per_path == {"direct": summary.ok}


def test_merged_chunks_are_detected(tmp_path: Path, tiny_model_dir: Path) -> None:
    process, url = start("--merge", "2")
    try:
        summary, _ = run(campaign(url, tmp_path, tiny_model_dir, workload="short_long", users=1, duration_s=3))
    finally:
        process.terminate()
        process.wait(timeout=10)
    assert summary.ok >= 3
    assert summary.chunks_per_token == 0.5


def test_a_starved_open_loop_generator_reports_schedule_lag(server: str, tmp_path: Path, tiny_model_dir: Path) -> None:
    # One sender for 40 planned requests a second of ~0.35 s each: the schedule cannot be kept.
    starved = campaign(server, tmp_path, tiny_model_dir, workload="bursts", users=1, rate=40, duration_s=4)
    summary, _ = run(starved)
    assert summary.schedule_lag is not None and summary.schedule_lag.p99_ms > 500
    assert summary.lag_windows_flagged
    # Enough senders keep it.
    kept, _ = run(starved.model_copy(update={"users": 64, "rate": 10, "out": tmp_path / "kept"}))
    assert kept.schedule_lag is not None and kept.schedule_lag.p50_ms < 20


def test_two_workers_run_under_a_master_and_their_rows_are_merged(
    server: str, tmp_path: Path, tiny_model_dir: Path
) -> None:
    summary, _ = run(
        campaign(server, tmp_path, tiny_model_dir, workload="short_long", users=4, workers=2, duration_s=3)
    )
    rows = (tmp_path / "rows.csv").read_text().splitlines()
    workers = {line.split(",")[-1] for line in rows[1:]}
    assert len(workers) == 2 and len(list((tmp_path / "rows").glob("rows-*.csv"))) == 2
    assert summary.requests == len(rows) - 1 >= 8


def test_a_breached_gate_fails_the_command_and_names_it(server: str, tmp_path: Path, tiny_model_dir: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "sluice.cli.main",
            "load",
            "short_long",
            "--target",
            server,
            "--duration",
            "3",
            "--users",
            "1",
            "--out",
            str(tmp_path),
            "--tokenizer",
            str(tiny_model_dir / "tokenizer.json"),
            "--gate",
            "ttft_p99_ms=10",
            "--gate",
            "error_ratio=0.5",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
    )
    assert result.returncode == 1
    assert "gate breached: ttft_p99_ms" in result.stderr and "error_ratio" not in result.stderr
    assert (tmp_path / "summary.json").exists() and (tmp_path / "report.html").exists()
    # Locust's own statistics and report beside sluice's, counting the campaign's requests.
    with (tmp_path / f"{LOCUST_CSV_PREFIX}_stats.csv").open() as handle:
        aggregated = [row for row in csv.DictReader(handle) if row["Name"] == "Aggregated"]
    assert aggregated and int(aggregated[0]["Request Count"]) > 0
    assert (tmp_path / LOCUST_HTML).stat().st_size > 0
    # sluice's report: the settings, the summary, and each gate's verdict.
    page = (tmp_path / "report.html").read_text()
    assert "<h2>Settings</h2>" in page and "<td>short_long</td>" in page and "<h2>Summary</h2>" in page
    assert "<td>ttft_p99_ms</td>" in page and "<td>BREACHED</td>" in page and "<td>error_ratio</td>" in page
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert {(g["name"], g["held"]) for g in saved["gates"]} == {("ttft_p99_ms", False), ("error_ratio", True)}


def _sluice(*args: str) -> list[str]:
    return [sys.executable, "-m", "sluice.cli.main", *args]


def test_a_master_runs_the_campaign_on_workers_started_apart_and_gets_their_rows(
    server: str, tmp_path: Path, tiny_model_dir: Path
) -> None:
    """`sluice load --master` and two `sluice load-worker` processes, as on other machines (here on loopback): the
    workers get the campaign's settings from the master, send it their rows, and every command ends by itself."""
    port = str(free_port("127.0.0.1"))
    began = time.perf_counter()
    master = subprocess.Popen(
        _sluice(
            *("load", "short_long", "--target", server, "--duration", "3", "--users", "4", "--out", str(tmp_path)),
            *("--tokenizer", str(tiny_model_dir / "tokenizer.json"), "--master", "--expect-workers", "2"),
            *("--master-port", port),
        ),
        cwd=ROOT,
    )
    workers = [
        subprocess.Popen(_sluice("load-worker", "--master-port", port, "--timeout", "120"), cwd=ROOT) for _ in range(2)
    ]
    try:
        assert master.wait(timeout=180) == 0
        assert [worker.wait(timeout=60) for worker in workers] == [0, 0]
    finally:
        for process in (master, *workers):
            if process.poll() is None:
                process.kill()
    ended = time.perf_counter()
    with (tmp_path / "rows.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert len({row["worker"] for row in rows}) == 2 and len(rows) >= 8
    # The rows are on the master's clock: every send between the command's start and its end.
    assert all(began < float(row["sent_at"]) < ended for row in rows)
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["completed"] == len(rows) and saved["campaign"]["master"]["expect_workers"] == 2
    assert (tmp_path / f"{LOCUST_CSV_PREFIX}_stats.csv").exists()


def test_a_worker_without_a_master_stops_at_its_timeout() -> None:
    result = subprocess.run(
        _sluice("load-worker", "--master-port", str(free_port("127.0.0.1")), "--timeout", "3"),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert result.returncode == EXIT_INCOMPLETE and "no campaign ended within 3 s" in result.stderr


def test_a_keyed_target_is_loaded_with_its_key_and_the_key_is_kept_out_of_the_files(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    process, url = start("--api-key", "sk-load")
    tokenizer = str(tiny_model_dir / "tokenizer.json")
    load = _sluice("load", "short_long", "--target", url, "--users", "1", "--tokenizer", tokenizer)
    try:
        refused = subprocess.run([*load, "--duration", "2"], capture_output=True, text=True, timeout=60, cwd=ROOT)
        keyed = [*load, "--duration", "3", "--out", str(tmp_path), "--api-key", "sk-load", "--header", "x-team=alpha"]
        result = subprocess.run(keyed, capture_output=True, text=True, timeout=180, cwd=ROOT)
    finally:
        process.terminate()
        process.wait(timeout=10)
    assert refused.returncode == 3 and "answered 401 (a keyed stack: give its key, --api-key)" in refused.stderr
    assert result.returncode == 0, result.stderr
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["completed"] >= 3 and saved["failed"] == 0, "every request carried the key"
    assert saved["campaign"]["headers"] == {"authorization": "(set)", "x-team": "(set)"}
    written = "".join(path.read_text(errors="replace") for path in tmp_path.rglob("*") if path.is_file())
    assert "sk-load" not in written, "the key is in no file the campaign wrote"


def test_check_carries_the_key_to_a_keyed_target() -> None:
    process, url = start("--api-key", "sk-check")
    check = _sluice("check", "--target", url, "--json")
    try:
        refused = subprocess.run(check, capture_output=True, text=True, timeout=120, cwd=ROOT)
        keyed = subprocess.run([*check, "--api-key", "sk-check"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    finally:
        process.terminate()
        process.wait(timeout=10)
    assert refused.returncode == 3 and "--api-key" in refused.stderr
    # Past the model list, the checklist ran: its stream carried the key (this server is no model: other items fail).
    items = {item["item"]: item for item in json.loads(keyed.stdout)["items"]}
    assert items["direct streaming"]["ok"] is True, items["direct streaming"]


def test_a_rate_sweep_of_a_dataset_against_a_keyed_target_writes_one_report_with_each_step(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """The issue's acceptance command, shortened: `mixed` (a closed loop of its own) opened at each rate, prompts and
    output lengths from a JSONL file, the key on every request; then two steps compared."""
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": f"question {i}", "output_len": 4}) + "\n" for i in range(5)))
    truth = tmp_path / "asked.jsonl"
    process, url = start("--api-key", "sk-sweep", "--tokens", "4", "--record", str(truth))
    out = tmp_path / "sweep"
    load = _sluice("load", "mixed", "--target", url, "--api-key", "sk-sweep", "--dataset", str(dataset))
    load += ["--rate", "4,40", "--duration", "3", "--users", "8", "--out", str(out)]
    load += ["--tokenizer", str(tiny_model_dir / "tokenizer.json")]
    try:
        result = subprocess.run(load, capture_output=True, text=True, timeout=240, cwd=ROOT)
    finally:
        process.terminate()
        process.wait(timeout=10)
    assert result.returncode == 0, result.stderr
    sweep = json.loads((out / "summary.json").read_text())
    assert sweep["rates"] == [4.0, 40.0] and [step["folder"] for step in sweep["steps"]] == ["rate-4", "rate-40"]
    for step in sweep["steps"]:
        saved = json.loads((out / step["folder"] / "summary.json").read_text())
        assert saved["failed"] == 0 and saved["completed"] == step["completed"] >= 3, "every request carried the key"
        assert saved["request_rate"] == step["rate"] and saved["campaign"]["dataset"] == str(dataset)
        with (out / step["folder"] / "rows.csv").open() as handle:
            rows = list(csv.DictReader(handle))
        assert {int(row["output_tokens"]) for row in rows} == {4} and all(row["planned_at"] for row in rows)
    assert sweep["steps"][1]["completed"] > sweep["steps"][0]["completed"], (
        "the faster step sent more (Poisson means 12 and 120: apart by far more than chance)"
    )
    asked = [json.loads(line) for line in truth.read_text().splitlines()]
    assert {(a["prompt"], a["max_tokens"]) for a in asked} == {(f"question {i}", 4) for i in range(5)}
    page = (out / "report.html").read_text()
    assert page.count("<tr><td>4</td>") == 1 and page.count("<tr><td>40</td>") == 1, "a row per step"
    assert (
        'src="sweep.png"' in page and 'src="rate-4/latency_cdf.png"' in page and 'src="rate-40/latency_cdf.png"' in page
    )
    compared = subprocess.run(
        _sluice("load", "compare", str(out / "rate-4"), str(out / "rate-40")), capture_output=True, text=True, cwd=ROOT
    )
    assert compared.returncode == 0 and any(
        line.startswith("request_throughput") for line in compared.stdout.splitlines()
    )
