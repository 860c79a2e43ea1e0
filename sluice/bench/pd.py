"""`sluice bench pd`: TTFT and inter-token latency of prefill/decode versus the plain topology, same prompts.

Both stacks run on one local Ray from their team files (`local-cpu.yaml` with one replica, `prefill-decode-cpu.yaml`),
each behind its own HAProxy. For each prompt length (token ids, so the length is exact) the requests alternate
between the stacks, one at a time, so both see the same machine load; each streams `max_tokens` greedy tokens.
TTFT is request sent to first token at the client; ITL is the gap between consecutive token events.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from base.quantiles import quantile
from base.runtime import free_port
from loadtests.stream_probe import StreamResult, one_stream
from topologies import TEAMS_DIR

TEAMS = TEAMS_DIR
PROMPT_LENGTHS = (32, 256, 768)
# Token ids well inside the tiny model's 2,048-token vocabulary.
_FIRST_TOKEN_ID = 100


def _stack(team_file: str, name: str, **model_overrides: Any) -> tuple[Any, Any]:
    import yaml

    from builders.plan import build_plan
    from builders.specs import parse_spec

    data = yaml.safe_load((TEAMS / team_file).read_text())
    data["name"] = name
    data["frontend"].update(port=free_port(), metrics_port=free_port())
    data["models"][0].update(model_overrides)
    spec = parse_spec(data, team_file)
    return spec, build_plan(spec)


def _summary(results: list[StreamResult]) -> str:
    ttft = [r.ttft_s * 1e3 for r in results]
    gaps = [g * 1e3 for r in results for g in r.token_gaps_s]
    return (
        f"TTFT p50 {quantile(ttft, 0.5):6.1f} p90 {quantile(ttft, 0.9):6.1f} ms | "
        f"ITL p50 {quantile(gaps, 0.5):5.2f} p99 {quantile(gaps, 0.99):5.2f} ms"
    )


async def _alternate(
    urls: dict[str, str], model: dict[str, str], prompt: list[int], samples: int, max_tokens: int
) -> dict[str, list[StreamResult]]:
    results: dict[str, list[StreamResult]] = {label: [] for label in urls}
    async with httpx.AsyncClient(timeout=120, headers={"accept-encoding": "identity"}) as client:
        for _ in range(samples):
            for label, url in urls.items():
                results[label].append(await one_stream(client, url, model[label], max_tokens, prompt))
    return results


def run_pd_bench(samples: int = 30, max_tokens: int = 64) -> None:
    from ray import serve

    from sluice.deploy.apply import apply_plan, ensure_models
    from sluice.deploy.local_cluster import start_local_cluster, stop_local_cluster

    plain_spec, plain = _stack("local-cpu.yaml", "bench-plain", replicas=1)
    pd_spec, pd = _stack("prefill-decode-cpu.yaml", "bench-pd")
    ensure_models(plain_spec)
    start_local_cluster(log_to_driver=False)
    try:
        for spec, plan in ((plain_spec, plain), (pd_spec, pd)):
            if not apply_plan(spec, plan):
                raise RuntimeError(f"{plan.stack} did not come up")
        urls = {"plain": plain.url, "prefill/decode": pd.url}
        model = {"plain": plain.models[0].name, "prefill/decode": pd.models[0].name}
        warmup = list(range(_FIRST_TOKEN_ID, _FIRST_TOKEN_ID + 16))
        asyncio.run(_alternate(urls, model, warmup, 3, 8))
        print(f"{samples} sequential streams per stack and prompt length, {max_tokens} tokens each, alternating")
        for length in PROMPT_LENGTHS:
            prompt = [_FIRST_TOKEN_ID + i % 1000 for i in range(length)]
            results = asyncio.run(_alternate(urls, model, prompt, samples, max_tokens))
            for label, streams in results.items():
                print(f"prompt {length:4d} tokens, {label:<15} {_summary(streams)}")
    finally:
        for plan in (pd, plain):
            for app in reversed(plan.apps):
                if app.name in serve.status().applications:
                    serve.delete(app.name)
        stop_local_cluster()
