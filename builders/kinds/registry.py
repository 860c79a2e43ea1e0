"""Every topology kind by name (`TopologyKind`), as routers/registry.py lists every policy.

Spec validation (`builders.specs`), the plan, the KubeRay render and status ask this module; nothing outside
`builders/kinds/` tests a kind's type. Adding a kind is one module (NAME, its stack model, KIND) plus one line in
`BUILT_IN` (builders/README.md#adding-a-topology-kind).
"""

from __future__ import annotations

from base.named_registry import NamedRegistry
from builders.kinds import data_parallel, openai, prefill_decode
from builders.kinds.kind import TopologyKind
from topologies.spec import StackBase

BUILT_IN: tuple[TopologyKind, ...] = (openai.KIND, data_parallel.KIND, prefill_decode.KIND)


class KindRegistryError(ValueError):
    """A kind registered twice, or an unknown one."""


# `KINDS.register(kind)` makes a kind known by its name (a name already taken is refused); `unregister` forgets one
# (tests that registered one); `items()` lists them in registration order.
KINDS: NamedRegistry[TopologyKind] = NamedRegistry("topology kind", KindRegistryError, BUILT_IN)


def kind_of(spec: StackBase) -> TopologyKind:
    """The kind of a validated spec."""
    return KINDS.named(spec.kind)  # type: ignore[attr-defined]
