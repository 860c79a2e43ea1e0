"""A vLLM general plugin: the process asks Linux for AMX before vLLM's CPU kernels run.

vLLM's CPU attention kernel uses AMX on CPUs that report it without asking Linux for it, and died with SIGILL at
its first request on a VM that grants AMX only on request (measured 2026-12-01). vLLM loads general plugins in every
engine-core and worker process. Details: services/replica/README.md (AMX on CPU).
"""

from __future__ import annotations

import torch


def request_amx_permission() -> None:
    if torch.cpu._is_amx_tile_supported():
        torch.cpu._init_amx()
