"""`sluice api-key new | hash`: team API keys; the key file holds their hashes only."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from sluice.deploy.exit_codes import EXIT_USAGE


def _api_key_new(args: argparse.Namespace) -> int:
    from infra.api_keys import key_hash_line, new_api_key

    key = new_api_key()
    print(f"key (hand it to the caller; sluice stores only its hash): {key}")
    print(f"line for the key file: {key_hash_line(key, args.label)}")
    return 0


def _api_key_hash(args: argparse.Namespace) -> int:
    from infra.api_keys import key_hash_line

    key = sys.stdin.readline().strip()
    if not key:
        print("sluice api-key hash: give the key on standard input", file=sys.stderr)
        return EXIT_USAGE
    print(key_hash_line(key, args.label))
    return 0


def register(commands: Any) -> None:
    api_key = commands.add_parser("api-key", help="team API keys: the key file holds their hashes only")
    api_key_commands = api_key.add_subparsers(dest="api_key_command", required=True)
    new = api_key_commands.add_parser("new", help="a new random key and its key file line")
    new.add_argument("--label", default="", help="who the key is for (kept next to the hash)")
    new.set_defaults(func=_api_key_new)
    hash_key = api_key_commands.add_parser("hash", help="the key file line of a key read from standard input")
    hash_key.add_argument("--label", default="", help="who the key is for (kept next to the hash)")
    hash_key.set_defaults(func=_api_key_hash)
