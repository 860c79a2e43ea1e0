"""`sluice bench paths`: the same streams over every path to the same replicas, side by side, in one run.

Paths (each to the same two tiny-model replicas of one stack, the embedded default with its legacy ingress
retained and every session on the direct path):
- `replica_port`: the replicas' own HTTP ports, spread round-robin — the limit every other path is compared to;
- `direct`: sluice's direct path (HAProxy -> router -> replica port);
- `legacy`: sluice's retained legacy ingress (its replica's port: a Python relay and a handle call per chunk);
- `serve_proxy`: Serve's default Python proxy in front of the LLM app.
Ray 2.60's own HAProxy direct streaming (`RAY_SERVE_ENABLE_HA_PROXY=1` with Ray Serve LLM's builder) needs a
cluster started with that flag and its own LLM deployment; it is not measured here yet.

Every figure is the median of `REPETITIONS` interleaved rounds (path A, B, C, D, then A again ...), with its min and
max, because these machines are shared and noisy: ratios to `replica_port` matter, not absolute times. Writes the
terminal table, `paths.json` and `paths.png` into the output folder.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from base.tiny_model import SERVED_MODEL_NAME
from loadtests.metrics import quantile
from loadtests.stream_probe import StreamResult, one_stream

PATHS = ("replica_port", "direct", "legacy", "serve_proxy")
CONCURRENCY = (1, 16, 64)
REPETITIONS = 3
MAX_TOKENS = 64
FIGURES = ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "headers_p50_ms")
TEAM_FILE = Path(__file__).resolve().parents[1] / "topologies" / "teams" / "local-cpu.yaml"


async def _round(urls: list[str], streams: int) -> dict[str, float]:
    """`streams` concurrent streams over `urls` (round-robin): the figures of one round."""
    limits = httpx.Limits(max_connections=streams)
    async with httpx.AsyncClient(timeout=300, limits=limits, headers={"accept-encoding": "identity"}) as client:
        started = time.perf_counter()
        results: list[StreamResult] = await asyncio.gather(
            *(one_stream(client, urls[i % len(urls)], SERVED_MODEL_NAME, MAX_TOKENS) for i in range(streams))
        )
        wall = time.perf_counter() - started
    ttfts = [r.ttft_s * 1000 for r in results]
    gaps = [g * 1000 for r in results for g in r.token_gaps_s] or [0.0]
    return {
        "tokens_per_s": sum(r.completion_tokens for r in results) / wall,
        "ttft_p50_ms": quantile(ttfts, 0.5),
        "ttft_p99_ms": quantile(ttfts, 0.99),
        "itl_p50_ms": quantile(gaps, 0.5),
        "itl_p99_ms": quantile(gaps, 0.99),
        "headers_p50_ms": quantile([r.headers_s * 1000 for r in results], 0.5),
    }


def summarize(rounds: dict[str, dict[int, list[dict[str, float]]]]) -> dict[str, Any]:
    """Median, min and max of every figure per path and concurrency, and the median's ratio to `replica_port`."""
    summary: dict[str, Any] = {}
    for path, by_streams in rounds.items():
        summary[path] = {}
        for streams, measured in by_streams.items():
            entry = {}
            for figure in FIGURES:
                values = [m[figure] for m in measured]
                limit = statistics.median(m[figure] for m in rounds["replica_port"][streams])
                median = statistics.median(values)
                entry[figure] = {
                    "median": median,
                    "min": min(values),
                    "max": max(values),
                    "ratio": median / limit if limit else None,
                }
            summary[path][str(streams)] = entry
    return summary


def table(summary: dict[str, Any]) -> str:
    lines = [f"{'path':<13}{'streams':>8}" + "".join(f"{f:>16}" for f in FIGURES)]
    for path, by_streams in summary.items():
        for streams, entry in by_streams.items():
            cells = "".join(
                f"{entry[f]['median']:>9.1f} x{entry[f]['ratio']:<5.2f}"
                if entry[f]["ratio"] is not None
                else f"{'-':>16}"
                for f in FIGURES
            )
            lines.append(f"{path:<13}{streams:>8}{cells}")
    return "\n".join(lines)


def chart(summary: dict[str, Any], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(summary)
    for index, (path, by_streams) in enumerate(summary.items()):
        xs = [i + index * width for i in range(len(by_streams))]
        axes[0].bar(xs, [e["tokens_per_s"]["ratio"] for e in by_streams.values()], width, label=path)
        axes[1].bar(xs, [e["ttft_p50_ms"]["median"] for e in by_streams.values()], width, label=path)
    for ax, title in zip(axes, ("output tokens/s, ratio to the replica port", "TTFT p50 (ms)"), strict=True):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(CONCURRENCY))], [f"{n} streams" for n in CONCURRENCY])
        ax.set_title(title)
    axes[0].legend(loc="lower left")
    fig.tight_layout()
    path = out / "paths.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _deploy_stack(folder: Path) -> tuple[Any, dict[str, list[str]]]:
    """The embedded default with its legacy ingress retained, on free ports; each path's base URLs."""
    from base.runtime import DEFAULT_SERVE_PROXY_PORT, LOOPBACK, free_port
    from builders.plan import build_plan
    from services.serve_internals import list_replica_endpoints
    from sluice.deploy import apply_plan, ensure_models
    from topologies.spec import parse_spec

    data = yaml.safe_load(TEAM_FILE.read_text())
    data["name"] = "bench-paths"
    data["frontend"].update(port=free_port(LOOPBACK), metrics_port=free_port(LOOPBACK))
    data["ingress"] = {"mode": "both", "canary_weight": 100}
    for model in data["models"]:
        model["max_ongoing_requests"] = 128
    spec = parse_spec(data)
    plan = build_plan(spec)
    ensure_models(spec)
    (folder / "stack.yaml").write_text(yaml.safe_dump(data))
    if not apply_plan(spec, plan):
        raise RuntimeError("the bench stack did not come up")
    model = plan.models[0]
    replicas = asyncio.run(list_replica_endpoints(model.llm_app))
    legacy = asyncio.run(list_replica_endpoints(model.legacy_app))
    urls = {
        "replica_port": [f"{e.url}/{model.llm_app}" for e in replicas],
        "direct": [plan.url],
        "legacy": [f"{e.url}/{model.legacy_app}" for e in legacy],
        "serve_proxy": [f"http://{LOOPBACK}:{DEFAULT_SERVE_PROXY_PORT}/{model.llm_app}"],
    }
    return plan, urls


def run_paths_bench(out: Path) -> dict[str, Any]:
    from sluice.cluster import start_local_cluster, stop_local_cluster

    out.mkdir(parents=True, exist_ok=True)
    start_local_cluster(log_to_driver=False)
    try:
        plan, urls = _deploy_stack(out)
        for path_urls in urls.values():  # warm every path once
            asyncio.run(_round(path_urls, 2))
        rounds: dict[str, dict[int, list[dict[str, float]]]] = {p: {n: [] for n in CONCURRENCY} for p in PATHS}
        for _ in range(REPETITIONS):
            for streams in CONCURRENCY:
                for path in PATHS:
                    rounds[path][streams].append(asyncio.run(_round(urls[path], streams)))
    finally:
        stop_local_cluster()
    summary = summarize(rounds)
    measured_at = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    payload = {"measured_at": measured_at, "max_tokens": MAX_TOKENS, "repetitions": REPETITIONS, "paths": summary}
    (out / "paths.json").write_text(json.dumps(payload, indent=2))
    chart(summary, out)
    print(
        f"paths to the same replicas, {MAX_TOKENS}-token streams, median of {REPETITIONS} interleaved rounds "
        f"(x ratio to replica_port), {measured_at}:"
    )
    print(table(summary))
    print(f"written: {out / 'paths.json'}, {out / 'paths.png'}")
    return payload
