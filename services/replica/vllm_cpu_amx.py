"""A vLLM general plugin: the process asks Linux for AMX before vLLM's CPU kernels run.

Linux grants AMX tile data to a process only on request (`arch_prctl(ARCH_REQ_XCOMP_PERM)`). oneDNN asks for it,
but vLLM's CPU attention kernel does not, and picks its AMX variant whenever the CPU reports AMX (bf16 models).
Measured on 2026-12-01 (a VM reporting AMX): the engine core died with SIGILL in `cpu_attention_with_kv_cache` at
its first request until the process had asked. vLLM loads general plugins (the `vllm.general_plugins` entry point
in pyproject.toml) in every engine-core and worker process, so each asks before its first forward pass.
"""

from __future__ import annotations

import torch


def request_amx_permission() -> None:
    if torch.cpu._is_amx_tile_supported():
        torch.cpu._init_amx()
