"""`sluice bench tls`: what TLS at the frontend costs. One stack (the embedded default) with `frontend.tls` and a kept
plain port, so both schemes reach the same HAProxy, routers and replicas; for 1 and 16 concurrent streams, rounds
that alternate plain and TLS (the first of each discarded: connections and caches warm), the median per scheme of
TTFT p50 and aggregate tokens/s, and TLS as a ratio of plain. Each stream opens its own connection (the probe's
client keeps none across rounds), so its TTFT includes the TLS handshake."""

from __future__ import annotations

import asyncio
import json
import ssl
import statistics
from pathlib import Path
from typing import Any

import yaml

from base.runtime import cache_dir, free_port
from infra.tls_certs import throwaway_certificate
from loadtests.stream_probe import probe
from routers.round_robin import NAME as ROUND_ROBIN
from sluice.bench.stack_variants import deploy_variant
from topologies import EMBEDDED_SPEC

STREAMS = (1, 16)
ROUNDS = 4  # the first one warms up and is left out
MAX_TOKENS = 64


def _measure(url: str, model: str, streams: int, verify: ssl.SSLContext | bool) -> tuple[float, float]:
    report = asyncio.run(probe([url], model, streams, MAX_TOKENS, verify=verify))
    return report.ttft_p50_ms, report.aggregate_tokens_per_s


def run_tls_bench(out: Path) -> dict[str, Any]:
    """On the connected Ray cluster: the figures, printed and written to `out/tls.json`."""
    files = throwaway_certificate(cache_dir() / "bench-tls")
    data = yaml.safe_load(EMBEDDED_SPEC.read_text())
    plain_port = free_port()
    data["name"] = "bench-tls"
    data["frontend"].update(port=free_port(), metrics_port=free_port())
    data["frontend"]["tls"] = {"cert_file": str(files.cert), "key_file": str(files.key), "plain_port": plain_port}
    plan = deploy_variant(data, ROUND_ROBIN, 2)
    model = plan.models[0].name
    trust = ssl.create_default_context(cafile=files.ca)
    schemes = {"plain": (f"http://127.0.0.1:{plain_port}", True), "tls": (plan.url, trust)}
    figures: dict[str, Any] = {}
    try:
        for streams in STREAMS:
            runs: dict[str, list[tuple[float, float]]] = {scheme: [] for scheme in schemes}
            for _ in range(ROUNDS):
                for scheme, (url, verify) in schemes.items():
                    runs[scheme].append(_measure(url, model, streams, verify))
            row = {
                scheme: {
                    "ttft_p50_ms": statistics.median(ttft for ttft, _ in measured[1:]),
                    "tokens_per_s": statistics.median(rate for _, rate in measured[1:]),
                }
                for scheme, measured in runs.items()
            }
            row["tls_over_plain"] = {
                key: row["tls"][key] / row["plain"][key] for key in ("ttft_p50_ms", "tokens_per_s")
            }
            figures[f"{streams} streams"] = row
    finally:
        from sluice.deploy.apply import delete_plan

        delete_plan(plan)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tls.json").write_text(json.dumps(figures, indent=2))
    header = ("plain TTFT p50", 16), ("TLS TTFT p50", 14), ("ratio", 7), ("plain tok/s", 13), ("TLS tok/s", 11)
    print(" " * 12 + "".join(f"{name:>{width}}" for name, width in header) + f"{'ratio':>7}")
    for label, row in figures.items():
        plain, tls, ratio = row["plain"], row["tls"], row["tls_over_plain"]
        print(
            f"{label:<12}{plain['ttft_p50_ms']:>13.1f} ms{tls['ttft_p50_ms']:>11.1f} ms{ratio['ttft_p50_ms']:>7.2f}"
            f"{plain['tokens_per_s']:>13.0f}{tls['tokens_per_s']:>11.0f}{ratio['tokens_per_s']:>7.2f}"
        )
    return figures
