"""Which team stacks are attached to which platform, and where their frontends listen: records in Ray's GCS
key-value store (`sluice/platform/<platform>/<stack>`).

An attached stack's frontend replica writes its record once its HAProxy listens (and again when a model's capacity
changes: its live replicas times their `max_ongoing_requests`); the platform's frontend reads every record of its
platform each `services.platform` sync and fills its model slots from them. A frontend replica that stops deletes
the record only while it is still its own (a redeploy's new frontend has written its port by then); `sluice down`
deletes it too, so a record never outlives its stack for long.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

KEY_PREFIX = "sluice/platform/"


class AttachedModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    # Requests its replicas take at once (live replicas x max_ongoing_requests): the platform's queue bound.
    capacity: int


class AttachedStack(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    platform: str
    stack: str
    team: str
    host: str
    port: int
    models: list[AttachedModel]


def _key(platform: str, stack: str) -> str:
    return f"{KEY_PREFIX}{platform}/{stack}"


def _kv():  # type: ignore[no-untyped-def]
    from ray.experimental import internal_kv

    return internal_kv if internal_kv._internal_kv_initialized() else None


def publish(record: AttachedStack) -> None:
    kv = _kv()
    if kv is not None:
        kv._internal_kv_put(_key(record.platform, record.stack), record.model_dump_json(), overwrite=True)


def attached(platform: str) -> list[AttachedStack]:
    """Every stack attached to `platform`, by stack name."""
    kv = _kv()
    if kv is None:
        return []
    records = []
    for key in sorted(kv._internal_kv_list(f"{KEY_PREFIX}{platform}/")):
        raw = kv._internal_kv_get(key)
        if raw is not None:
            records.append(AttachedStack.model_validate_json(raw))
    return records


def withdraw(platform: str, stack: str, port: int | None = None) -> None:
    """Delete a stack's record (`port`: only while the record is still that frontend's)."""
    kv = _kv()
    if kv is None:
        return
    key = _key(platform, stack)
    if port is not None:
        raw = kv._internal_kv_get(key)
        if raw is None or AttachedStack.model_validate_json(raw).port != port:
            return
    kv._internal_kv_del(key)
