"""Team API keys: the hashed key list a stack accepts, and where it comes from.

A key file (or environment variable) holds SHA-256 digests, never keys: one `sha256:<64 hex>` per line, optionally
followed by a label (whose key it is), `#` comments and blank lines ignored. An environment variable holds the same
entries separated by commas or newlines. The frontend hashes the `Authorization: Bearer <key>` token (HAProxy's
`sha2(256)`) and looks the digest up, so no key in plain text is stored, logged or forwarded anywhere.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
from pathlib import Path

from pydantic import BaseModel, model_validator

from base.spec_config import SPEC_SECTION_CONFIG

HASH_PREFIX = "sha256:"
_DIGEST = re.compile(r"^[0-9a-f]{64}$")
# Generated keys: a recognisable prefix and 256 random bits.
KEY_PREFIX = "sk-sluice-"


class ApiKeyError(ValueError):
    """A key list that cannot be used (the message says where and why)."""


class ApiKeySource(BaseModel):
    """Where a stack's key hashes come from: exactly one of a file (re-read while running: rotation needs no
    reload) or an environment variable (read when the frontend starts)."""

    model_config = SPEC_SECTION_CONFIG

    file: Path | None = None
    """A key file of hashes (`sluice api-key new`), re-read while running: rotation needs no reload."""
    env: str | None = None
    """An environment variable holding the key hashes, read when the frontend starts."""

    @model_validator(mode="after")
    def _exactly_one(self) -> ApiKeySource:
        if (self.file is None) == (self.env is None):
            raise ValueError("api_keys: give exactly one of `file` (a file of key hashes) or `env` (a variable name)")
        return self

    def describe(self) -> str:
        return f"key file {self.file}" if self.file is not None else f"environment variable {self.env}"

    def read(self) -> str:
        """The raw key list (raises ApiKeyError when it cannot be read)."""
        if self.file is not None:
            try:
                return self.file.read_text()
            except OSError as error:
                raise ApiKeyError(f"cannot read the {self.describe()}: {error}") from error
        assert self.env is not None
        value = os.environ.get(self.env)
        if value is None:
            raise ApiKeyError(f"the {self.describe()} is not set")
        return value.replace(",", "\n")

    def digests(self) -> frozenset[str]:
        return parse_key_hashes(self.read(), self.describe())


def parse_key_hashes(text: str, where: str = "key list") -> frozenset[str]:
    """The SHA-256 hex digests of a key list; raises ApiKeyError naming the line of any malformed entry."""
    digests = set()
    for number, line in enumerate(text.splitlines(), start=1):
        entry = line.split("#", 1)[0].strip()
        if not entry:
            continue
        token = entry.split()[0]
        if not token.startswith(HASH_PREFIX) or not _DIGEST.match(token[len(HASH_PREFIX) :]):
            shown = token if len(token) <= 16 else token[:12] + "..."
            raise ApiKeyError(
                f"{where}, line {number}: expected `{HASH_PREFIX}<64 lower-case hex digits>` (a key's hash, "
                f"made by `sluice api-key new` or `sluice api-key hash`), got {shown!r}"
            )
        digests.add(token[len(HASH_PREFIX) :])
    return frozenset(digests)


def key_digest(key: str) -> str:
    """What the frontend computes from `Authorization: Bearer <key>`."""
    return hashlib.sha256(key.encode()).hexdigest()


def key_hash_line(key: str, label: str = "") -> str:
    """The key file line that accepts `key`."""
    return f"{HASH_PREFIX}{key_digest(key)}" + (f"  {label}" if label else "")


def new_api_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def render_acl(digests: frozenset[str]) -> str:
    """HAProxy's pattern file of the accepted digests (what it loads at start; the runtime API replaces it)."""
    return "".join(f"{digest}\n" for digest in sorted(digests))
