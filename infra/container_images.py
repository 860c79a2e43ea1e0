"""Build sluice's node image (`infra/images/Dockerfile`) through the Docker SDK.

The build context is staged in a temporary folder (the work tree, pip's CA bundle and, for CPU images, its
`find-links` wheels); without a registry the base image is made first by `infra/images/build-base.sh`. Imported
only by what builds (the Docker SDK is in the `stack` extra). Details: infra/README.md (the node image).
"""

from __future__ import annotations

import os
import shutil
import ssl
import subprocess
import sys
import tempfile
from collections import deque
from collections.abc import Callable
from pathlib import Path

from base.runtime import REPO_ROOT

IMAGES_DIR = REPO_ROOT / "infra" / "images"
LOCAL_BASE_IMAGE = "sluice-base:bookworm"
CUDA_BASE_IMAGE = "nvidia/cuda:12.8.1-cudnn-runtime-ubuntu22.04"
ENGINES = ("cpu", "gpu")
# Lines of the build's own output shown with its error.
BUILD_LOG_TAIL_LINES = 40
DEFAULT_BASE = {"cpu": LOCAL_BASE_IMAGE, "gpu": CUDA_BASE_IMAGE}


def image_tag(engine: str) -> str:
    return f"sluice:{engine}"


def _pip_setting(name: str) -> str | None:
    """One of pip's configured values (`global.cert`, `global.find-links`), as this machine's pip sees it."""
    result = subprocess.run(
        [sys.executable, "-m", "pip", "config", "get", f"global.{name}"], capture_output=True, text=True, check=False
    )
    value = result.stdout.strip().strip("'\"")
    return value or None


def _ca_bundle() -> Path:
    """The CA bundle this machine's pip trusts: PIP_CERT, the SSL variables, pip's config, OpenSSL's default."""
    candidates = [os.environ.get(name) for name in ("PIP_CERT", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE")]
    candidates += [_pip_setting("cert"), ssl.get_default_verify_paths().openssl_cafile]
    for candidate in candidates:
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    raise RuntimeError("no CA bundle found for the image's pip: set PIP_CERT")


def _source_files() -> list[str]:
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=REPO_ROOT,
        capture_output=True,
        check=True,
    )
    return [name for name in listed.stdout.decode().split("\0") if name and (REPO_ROOT / name).is_file()]


def stage_context(dest: Path, engine: str) -> None:
    """The Dockerfile's context in `dest`: src/, build/ca-bundle.crt, build/wheels/."""
    for name in _source_files():
        target = dest / "src" / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO_ROOT / name, target)
    wheels = dest / "build" / "wheels"
    wheels.mkdir(parents=True)
    shutil.copy(_ca_bundle(), dest / "build" / "ca-bundle.crt")
    find_links = _pip_setting("find-links")
    if engine == "cpu" and find_links and Path(find_links).is_dir():
        for wheel in Path(find_links).glob("*.whl"):
            shutil.copy(wheel, wheels / wheel.name)


def ensure_base_image(base: str, say: Callable[[str], None]) -> None:
    """Make the local base image when it is the one asked for and missing (no registry to pull it from)."""
    import docker
    from docker.errors import ImageNotFound

    client = docker.from_env()
    try:
        client.images.get(base)
        return
    except ImageNotFound:
        if base != LOCAL_BASE_IMAGE:
            raise
    say(f"{base}: not here; building it with debootstrap (infra/images/build-base.sh)")
    subprocess.run([str(IMAGES_DIR / "build-base.sh"), base], check=True)


def build_image(
    engine: str, base: str | None = None, tag: str | None = None, say: Callable[[str], None] = print
) -> str:
    """Build the node image for `engine` FROM `base`; returns its tag. Raises RuntimeError with the build's error."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    base = base or DEFAULT_BASE[engine]
    tag = tag or image_tag(engine)
    ensure_base_image(base, say)
    import docker

    api = docker.APIClient()
    with tempfile.TemporaryDirectory(prefix="sluice-image-") as context:
        stage_context(Path(context), engine)
        say(f"{tag}: building FROM {base} (engine {engine})")
        stream = api.build(
            path=context,
            dockerfile="src/infra/images/Dockerfile",
            tag=tag,
            buildargs={"BASE_IMAGE": base, "ENGINE": engine},
            rm=True,
            forcerm=True,
            decode=True,
        )
        recent: deque[str] = deque(maxlen=BUILD_LOG_TAIL_LINES)
        for chunk in stream:
            if "error" in chunk:
                tail = "\n".join(recent)
                raise RuntimeError(f"building {tag} failed: {chunk['error'].strip()}\n{tail}")
            line = chunk.get("stream", "").rstrip()
            recent.extend(line.splitlines())
            if line.startswith("Step "):
                say(line)
    return tag


def image_size_bytes(tag: str) -> int:
    import docker

    return int(docker.from_env().images.get(tag).attrs["Size"])
