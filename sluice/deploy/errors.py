"""The errors a command reports as a line and an exit code (`exit_codes`), never a traceback: `sluice.cli.main.main`
maps them."""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import Iterator

# A target that does not list its models within this is taken as unreachable.
TARGET_PROBE_TIMEOUT_S = 10.0


class UsageError(ValueError):
    """A value the command cannot run with: exit `EXIT_USAGE` with this message."""


class Unreachable(Exception):
    """Something the command needs does not answer (a frontend, a Docker engine): exit `EXIT_UNREACHABLE`."""


def served_models(
    target: str, verify: ssl.SSLContext | bool = True, headers: dict[str, str] | None = None
) -> list[str]:
    """The ids of the models the target's OpenAI API lists; `Unreachable` when it cannot be reached or does not
    answer its model list. `verify`: what an https target's certificate is checked against; `headers`: what the
    request carries (a keyed stack's API key)."""
    import httpx

    try:
        response = httpx.get(f"{target}/v1/models", timeout=TARGET_PROBE_TIMEOUT_S, verify=verify, headers=headers)
    except httpx.HTTPError as error:
        problem = f"{type(error).__name__}: {error}"
    else:
        if response.status_code == 200:
            try:
                return [str(model["id"]) for model in response.json()["data"]]
            except (ValueError, KeyError, TypeError):
                problem = "GET /v1/models answered no OpenAI model list"
        else:
            problem = f"GET /v1/models answered {response.status_code}"
            if response.status_code == 401:
                problem += " (a keyed stack: give its key, --api-key)"
    raise Unreachable(f"the target {target} cannot be reached: {problem}")


def require_url(flag: str, url: str) -> str:
    """`url` without a trailing slash; UsageError when it is not an http(s) URL."""
    if not url.startswith(("http://", "https://")):
        raise UsageError(f"{flag} {url!r}: give a base URL, e.g. http://127.0.0.1:8000")
    return url.rstrip("/")


@contextlib.contextmanager
def docker_engine() -> Iterator[None]:
    """Turn a missing or stopped Docker engine into `Unreachable` (and a missing Docker client into `UsageError`)."""
    try:
        from docker.errors import DockerException
    except ImportError:
        raise UsageError("containers need the Docker client: install sluice's `stack` extra") from None

    try:
        yield
    except DockerException as error:
        raise Unreachable(
            f"no Docker engine answers ({error}); start dockerd (infra/images/docker-engine.sh)"
        ) from None
