"""Deployment versions for Serve: a digest of what would change a replica, so a redeploy that only changes the
replica count scales in place instead of rolling every replica. `services.serve_internals.with_rollout_version`
pins a deployment to it.
"""

from __future__ import annotations

import hashlib
import json
from importlib.metadata import version
from typing import Any


def config_version(payload: Any) -> str:
    """A short stable digest of a JSON-able config, tied to the installed sluice release."""
    canonical = json.dumps([version("sluice"), payload], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]
