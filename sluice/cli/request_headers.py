"""`--api-key` and `--header` of the commands that send requests to a stack (`sluice load`, `sluice check`): a keyed
stack (`frontend.protection.api_keys`) answers 401 without its key, and a gateway in front may want headers of its
own. The key goes as `Authorization: Bearer KEY`, as OpenAI's clients send it; `--header NAME=VALUE` as vLLM's
`bench serve` takes it.
"""

from __future__ import annotations

import argparse
from typing import Any

from base.contracts import AUTHORIZATION_HEADER
from sluice.deploy.errors import UsageError


def add_header_options(parser: Any) -> None:
    parser.add_argument("--api-key", help="the stack's API key, sent as Authorization: Bearer KEY")
    parser.add_argument(
        "--header", action="append", default=[], metavar="NAME=VALUE", help="a header on every request (repeatable)"
    )


def request_headers(args: argparse.Namespace) -> dict[str, str]:
    """The headers every request carries; UsageError for a header without a name or `=`."""
    headers: dict[str, str] = {}
    for pair in args.header:
        name, equals, value = pair.partition("=")
        if not equals or not name.strip():
            raise UsageError(f"--header {pair!r}: give NAME=VALUE, e.g. x-team=alpha")
        headers[name.strip()] = value
    if args.api_key is not None:
        if any(name.lower() == AUTHORIZATION_HEADER for name in headers):
            raise UsageError("--api-key and --header authorization=... both set the Authorization header: give one")
        headers[AUTHORIZATION_HEADER] = f"Bearer {args.api_key}"
    return headers
