"""The router's table for table decisions (`ROUTE_TABLE_PATH`): the replica ids its policy would rank for the asking
frontend, and how it ranks them, so that frontend's Lua can decide each request itself (infra/haproxy/README.md).

Only a policy whose every decision is a function of the replica set and the request's headers has a table
(`PolicyEntry.table`); the answer is a refusal whenever a route call would be refused as a whole (an injected fault,
no routable replica), so the frontend drops the table and its route calls get the router's own refusal.
"""

from __future__ import annotations

from collections.abc import Sequence

from base.contracts import REASON_INJECTED_FAULT, REASON_NO_REPLICA, REASON_NO_TABLE
from base.route_wire import RouteRefusal, RouteTable
from routers.core import ReplicaView


def table_answer(
    rule: tuple[str, int] | None, views: Sequence[ReplicaView], faulty: bool
) -> tuple[int, RouteTable | RouteRefusal]:
    """The status and body of a table request: `rule` is the policy's (kind, fallbacks) or None, `views` what the
    asking frontend may be offered."""
    if rule is None:
        return 404, RouteRefusal(reason=REASON_NO_TABLE)
    if faulty:
        return 500, RouteRefusal(reason=REASON_INJECTED_FAULT)
    ids = sorted(view.replica_id for view in views if view.routable)
    if not ids:
        return 503, RouteRefusal(reason=REASON_NO_REPLICA)
    kind, fallbacks = rule
    return 200, RouteTable(kind=kind, fallbacks=fallbacks, replica_ids=ids)
