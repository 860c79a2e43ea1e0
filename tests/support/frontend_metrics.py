"""What a sluice frontend counts, read from its metrics port: sluice's counters and HAProxy's own."""

from __future__ import annotations

import re

import httpx

from base.runtime import LOOPBACK
from infra.haproxy.config import FRONTEND, PROMETHEUS_PATH, SLUICE_METRICS_PATH


def frontend_counts(prometheus_port: int, counter: str, label: str = "reason") -> dict[str, int]:
    """One of sluice's frontend counters (`sluice_frontend_*_total`) by its one label's value."""
    text = httpx.get(f"http://{LOOPBACK}:{prometheus_port}{SLUICE_METRICS_PATH}", timeout=5).text
    return {m[1]: int(m[2]) for m in re.finditer(rf'^{counter}\{{{label}="(\w+)"\}} (\d+)$', text, re.M)}


def table_decisions(prometheus_port: int) -> dict[str, int]:
    """The requests HAProxy ranked from a router's table, by the table's kind."""
    return frontend_counts(prometheus_port, "sluice_frontend_table_decisions_total", "kind")


def refusal_counts(prometheus_port: int) -> dict[str, int]:
    return frontend_counts(prometheus_port, "sluice_frontend_refusals_total")


def request_errors(prometheus_port: int) -> int:
    """HAProxy's count of the public frontend's request errors (a request timeout among them)."""
    text = httpx.get(f"http://{LOOPBACK}:{prometheus_port}{PROMETHEUS_PATH}", timeout=5).text
    pattern = rf'^haproxy_frontend_request_errors_total\{{proxy="{FRONTEND}"\}} (\d+)$'
    return int(re.search(pattern, text, re.M)[1])
