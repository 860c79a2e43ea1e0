"""An example per command, shown at the end of its `--help` (a test parses each one with the real parser)."""

from __future__ import annotations

TEAM = "topologies/teams/local-cpu.yaml"
URL = "http://127.0.0.1:8000"

EXAMPLES: dict[str, tuple[str, ...]] = {
    "model": ("sluice model build",),
    "model build": ("sluice model build", "sluice model build --moe"),
    "serve": (
        "sluice serve",
        "sluice serve topologies/teams/kv-aware-cpu.yaml --replicas 3",
        "sluice serve --tls-self-signed",
    ),
    "validate": (f"sluice validate {TEAM}", "sluice validate topologies/teams/gpu-chat-8b.yaml --no-engine"),
    "schema": ("sluice schema > topology.schema.json",),
    "deploy": (
        f"sluice deploy {TEAM}",
        f"sluice deploy {TEAM} --address 10.0.0.5:6379 --timeout 900",
        "sluice deploy topologies/platforms/local-cpu.yaml",
    ),
    "status": ("sluice status", "sluice status platform-local-cpu --json", "sluice status local-platform"),
    "down": ("sluice down platform-local-cpu",),
    "canary": (f"sluice canary {TEAM} --weight 10", f"sluice canary {TEAM} --weight 30 --watch 600"),
    "rollback": (f"sluice rollback {TEAM}",),
    "check": (
        f"sluice check {TEAM}",
        f"sluice check --target {URL} --json",
        "sluice check --target https://127.0.0.1:8000 --ca-file .cache/tls/ca.pem",
    ),
    "render": (
        f"sluice render {TEAM}",
        f"sluice render {TEAM} --kuberay --image registry.local/sluice:0.1",
        "sluice render topologies/platforms/local-cpu.yaml --kuberay --attach topologies/platforms/alpha-chat.yaml "
        "--attach topologies/platforms/beta-chat.yaml",
    ),
    "image": ("sluice image build",),
    "image build": ("sluice image build", "sluice image build --engine gpu --tag sluice:gpu"),
    "node": ("sluice node head", "sluice node worker --head 10.0.0.5"),
    "stack": (f"sluice stack up {TEAM} --nodes 2",),
    "stack up": (f"sluice stack up {TEAM} --nodes 2",),
    "stack status": (f"sluice stack status {TEAM} --json",),
    "stack down": (f"sluice stack down {TEAM}",),
    "api-key": ("sluice api-key new --label team-a >> keys.txt",),
    "api-key new": ("sluice api-key new --label team-a",),
    "api-key hash": ("sluice api-key hash --label team-a < key.txt",),
    "load": (
        f"sluice load mixed --target {URL} --duration 60 --users 16",
        f"sluice load bursts --base-url {URL} --request-rate 8 --goodput ttft:200 tpot:50",
        f"sluice load mixed --target {URL} --gate ttft_p99_ms=500 --gate error_ratio=0.01",
        f"sluice load mixed --target {URL} --master --master-bind-host 10.0.0.5 --expect-workers 4",
        f"sluice load routing --spec {TEAM} --duration 15",
    ),
    "load-worker": ("sluice load-worker --master-host 10.0.0.5",),
    "replay": (f"sluice replay recorded.jsonl --target {URL} --compare http://127.0.0.1:8001",),
    "completion": ('eval "$(sluice completion bash)"', "sluice completion zsh > ~/.zfunc/_sluice"),
    "bench": ("sluice bench paths",),
    "bench replica": ("sluice bench replica --replicas 2",),
    "bench direct": ("sluice bench direct",),
    "bench pd": ("sluice bench pd --samples 20",),
    "bench paths": ("sluice bench paths --out .cache/bench",),
    "bench routers": ("sluice bench routers --no-actor",),
    "bench policies": (
        "sluice bench policies --replicas 64",
        "sluice bench policies --replicas 8 --workloads multi_turn --policies kv_aware,consistent_hash --no-shadow",
    ),
    "bench soak": ("sluice bench soak --duration 1800",),
    "bench overload": ("sluice bench overload --duration 60",),
    "bench tls": ("sluice bench tls",),
}


def epilog(command: str) -> str | None:
    """The examples block of a command's `--help` (None: it has none)."""
    lines = EXAMPLES.get(command)
    return "examples:\n" + "\n".join(f"  {line}" for line in lines) if lines else None
