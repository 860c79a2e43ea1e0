"""A running platform HAProxy changed through its runtime API, never by a reload (no connection is cut).

- A model attaches to a slot backend rendered ahead (`infra.haproxy.platform_cfg`): its server gets the team
  frontend's address and the model's capacity as maxconn, is made ready, and only then does the model enter the
  maps (so no request reaches a slot that is not set). It detaches in the other order: out of the models map first
  (new requests get 404 `model_not_found`), then its server goes to maintenance, where the streams in flight on it
  finish.
- The keys and the access pairs are replaced whole: a new version of the map is filled, then
  committed at once (`prepare map` / `commit map`), so no request sees half a list.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from infra.haproxy.models import MODEL_NAME_PATTERN
from infra.haproxy.platform_settings import (
    ACCESS_MAP,
    ACCESS_SEPARATOR,
    KEYS_MAP,
    MODELS_MAP,
    SLOT_SERVER,
    SLOTS_MAP,
    PlatformHAProxySettings,
    slot_backend,
)
from infra.haproxy.runtime_api import RuntimeAPI, RuntimeAPIError

# `del map` / `set map` on a key the map does not hold.
_MISSING_KEY = re.compile(r"not found", re.IGNORECASE)


class PlatformRuntime:
    """The platform's own changes, through the runtime API of its HAProxy (`api`, e.g. `HAProxyProcess.runtime`)."""

    def __init__(self, api: RuntimeAPI, settings: PlatformHAProxySettings) -> None:
        self.api = api
        self.settings = settings

    def attach_model(self, slot: int, model: str, host: str, port: int, capacity: int) -> None:
        """Route `model` to the team frontend at host:port, `capacity` requests at a time (more queue)."""
        self._check_slot(slot)
        if not MODEL_NAME_PATTERN.match(model):
            raise ValueError(f"not a model name that can be served: {model!r}")
        if capacity < 1:
            raise ValueError(f"a model's capacity is at least 1 request (0 would be unlimited), not {capacity}")
        held = self.api.show_map(self._map(SLOTS_MAP)).get(str(slot))
        if held not in (None, model):
            raise ValueError(f"slot {slot} holds {held!r}: detach it first")
        backend = slot_backend(slot)
        self.api.set_server_addr(backend, SLOT_SERVER, host, port)
        self.api.checked(f"set maxconn server {backend}/{SLOT_SERVER} {int(capacity)}")
        self.api.set_server_state(backend, SLOT_SERVER, "ready")
        self._put(SLOTS_MAP, str(slot), model)
        self._put(MODELS_MAP, model, str(slot))

    def detach_model(self, slot: int, model: str) -> None:
        """New requests for `model` get 404 at once; those in flight on its slot finish."""
        self._check_slot(slot)
        self._delete(MODELS_MAP, model)
        self._delete(SLOTS_MAP, str(slot))
        self.api.set_server_state(slot_backend(slot), SLOT_SERVER, "maint")

    def set_keys(self, keys: Mapping[str, str]) -> None:
        """The accepted keys: SHA-256 hex digest -> tenant."""
        self._replace(KEYS_MAP, keys)

    def set_access(self, access: set[tuple[str, str]]) -> None:
        """The (tenant, model) pairs allowed."""
        self._replace(ACCESS_MAP, {f"{tenant}{ACCESS_SEPARATOR}{model}": "1" for tenant, model in access})

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.settings.model_slots:
            raise ValueError(f"slot {slot} is not one of 0..{self.settings.model_slots - 1}")

    def _map(self, name: str) -> str:
        return str(self.settings.map_path(name))

    def _put(self, name: str, key: str, value: str) -> None:
        """Set a key, adding it when the map does not hold it yet."""
        try:
            self.api.set_map(self._map(name), key, value)
        except RuntimeAPIError as error:
            if not _MISSING_KEY.search(error.reply):
                raise
            self.api.checked(f"add map {self._map(name)} {key} {value}")

    def _delete(self, name: str, key: str) -> None:
        reply = self.api.command(f"del map {self._map(name)} {key}")
        if reply.strip() and not _MISSING_KEY.search(reply):
            raise RuntimeAPIError(f"del map {self._map(name)} {key}", reply)

    def _replace(self, name: str, entries: Mapping[str, str]) -> None:
        path = self._map(name)
        command = f"prepare map {path}"
        reply = self.api.command(command)
        match = re.search(r"New version created: (\d+)", reply)
        if match is None:
            raise RuntimeAPIError(command, reply)
        version = match.group(1)
        for key, value in entries.items():
            if any(c.isspace() for c in key + value) or not key or not value:
                raise ValueError(f"a map entry has no space and no empty part: {key!r} {value!r}")
            self.api.checked(f"add map @{version} {path} {key} {value}")
        self.api.checked(f"commit map @{version} {path}")
