"""HAProxy's side of table decisions: the variable the route action sets when it ranked a request from its app's
router table (`route_tables.lua.tmpl`), and the stick table that counts those decisions by table kind for
`sluice_frontend_table_decisions_total`. Why and how: infra/haproxy/README.md.
"""

from __future__ import annotations

from base.contracts import TABLE_KINDS
from infra.haproxy.formatting import counter_table_lines

# Set by the route action to the table's kind when it decided the request from a table (no route call).
VAR_TABLE_KIND = "txn.sluice_table_kind"
TABLE_DECISION_TABLE = "sluice_table_decisions"


def count_lines() -> list[str]:
    """After the route action. sc2 also counts refusals and agent failures, which a table decision never is."""
    return [
        f"    http-request track-sc2 var({VAR_TABLE_KIND}) table {TABLE_DECISION_TABLE}"
        f" if {{ var({VAR_TABLE_KIND}) -m found }}",
    ]


def decision_table_lines() -> list[str]:
    comment = "Requests ranked from a router's table (no route call), by the table's kind."
    return counter_table_lines(TABLE_DECISION_TABLE, comment, len(TABLE_KINDS), key_bytes=16)
