"""`--api-key` and `--header` of `sluice load` and `sluice check`: the key as a bearer token, headers as NAME=VALUE,
every malformed one refused before any request is sent."""

from __future__ import annotations

import argparse

import pytest

from sluice.cli.request_headers import add_header_options, request_headers
from sluice.deploy.errors import UsageError


def _parsed(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_header_options(parser)
    return parser.parse_args(argv)


def test_the_key_is_a_bearer_token_beside_the_named_headers() -> None:
    headers = request_headers(_parsed("--api-key", "sk-1", "--header", "x-team=alpha", "--header", "x-a=b=c"))
    assert headers == {"x-team": "alpha", "x-a": "b=c", "authorization": "Bearer sk-1"}
    assert request_headers(_parsed()) == {}


@pytest.mark.parametrize(
    ("argv", "complaint"),
    [
        (("--header", "x-team"), "give NAME=VALUE"),
        (("--header", "=alpha"), "give NAME=VALUE"),
        (("--api-key", "k", "--header", "Authorization=Bearer j"), "both set the Authorization header"),
    ],
)
def test_a_malformed_header_is_refused_naming_it(argv: tuple[str, ...], complaint: str) -> None:
    with pytest.raises(UsageError, match=complaint):
        request_headers(_parsed(*argv))
