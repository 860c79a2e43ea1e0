"""The fixed-count closed-loop run (`loadtests/counted.py`) against the SSE test server with known timing (TTFT
50 ms, then a token every millisecond, 16 tokens): exactly the count per user, every row measured, the same seed
the same requests, the session header sent or left out as asked, open-loop workloads refused."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path

import pytest

from base.contracts import SESSION_HEADER_DEFAULT
from loadtests.counted import counted_rows
from loadtests.sse_timing import StreamRow
from tests.support.known_timing_server import MODEL, TOKENS, TTFT_MS

# What is measured here is the count and the rows, not the gaps: short ones keep the runs short.
KNOWN_TIMING_FLAGS = ("--gap-ms", "1")


def _run(url: str, tiny_model_dir: Path, workload: str, seed: int, header: str = SESSION_HEADER_DEFAULT):
    tokenizer = tiny_model_dir / "tokenizer.json"
    return asyncio.run(counted_rows(workload, url, MODEL, tokenizer, 3, 5, seed, header))


def _sessions(rows: list[StreamRow]) -> Counter[str]:
    return Counter(row.session for row in rows)


def test_every_user_sends_its_count_and_every_row_is_measured(server: str, tiny_model_dir: Path) -> None:
    rows = _run(server, tiny_model_dir, "multi_turn", seed=7)
    assert len(rows) == 15 and all(row.ok and row.workload == "multi_turn" for row in rows)
    assert [row.sent_at for row in rows] == sorted(row.sent_at for row in rows)
    # Conversations of 4 turns: each user's 5 requests are one whole conversation and the first turn of the next.
    assert sorted(_sessions(rows).values()) == [1, 1, 1, 4, 4, 4]
    # The server sends its first token 50 ms after the request arrived: no TTFT can be shorter.
    assert all(
        row.ttft_s >= TTFT_MS / 1000 and row.output_tokens == TOKENS and len(row.gaps_s) == TOKENS - 1 for row in rows
    )
    assert all(row.e2el_s >= row.ttft_s for row in rows)


def test_a_seed_sends_the_same_requests_and_another_seed_others(server: str, tiny_model_dir: Path) -> None:
    first, again = (_run(server, tiny_model_dir, "multi_turn", seed=11) for _ in range(2))
    other = _run(server, tiny_model_dir, "multi_turn", seed=12)
    assert _sessions(first) == _sessions(again)
    assert not set(_sessions(first)) & set(_sessions(other))


def test_the_session_header_is_sent_only_when_named(server: str, tiny_model_dir: Path, truth: Path) -> None:
    truth.write_text("")
    with_header = _run(server, tiny_model_dir, "multi_turn", seed=21)
    received = [json.loads(line)["session"] for line in truth.read_text().splitlines()]
    assert Counter(received) == _sessions(with_header)
    truth.write_text("")
    _run(server, tiny_model_dir, "multi_turn", seed=22, header="")
    assert [json.loads(line)["session"] for line in truth.read_text().splitlines()] == [""] * 15


def test_an_open_loop_workload_is_refused(server: str, tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="open-loop"):
        _run(server, tiny_model_dir, "bursts", seed=1)
