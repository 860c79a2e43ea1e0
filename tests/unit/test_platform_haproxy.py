"""A platform's rendered HAProxy config, Lua and maps: what they hold, that HAProxy accepts them (`haproxy -c`), and
what `write_platform_files` refuses. Their behaviour in a real HAProxy: tests/integration/standin_plane/
test_platform_admission.py."""

from __future__ import annotations

import re
import stat
from pathlib import Path

import pytest
from pydantic import ValidationError

from base.contracts import (
    PRIORITY_CLASSES,
    PRIORITY_HEADER,
    REASON_MODEL_UNAVAILABLE,
    REASON_QUEUE_TIMEOUT,
    REASON_QUOTA_EXCEEDED,
    REASON_TENANT_LIMIT,
)
from infra.api_keys import ApiKeySource
from infra.haproxy.platform_cfg import render_platform_config, write_platform_files
from infra.haproxy.platform_lua import LUA_TEMPLATE, render_platform_lua
from infra.haproxy.platform_settings import (
    ACCESS_MAP,
    KEYS_MAP,
    MODELS_MAP,
    SLOT_SERVER,
    SLOTS_MAP,
    VAR_TENANT,
    PlatformHAProxySettings,
    TenantRoute,
    slot_backend,
)
from infra.haproxy.process import check_config
from infra.haproxy.protection import FrontendProtection

DIGEST = "ab" * 32


def _settings(workdir: Path, slots: int = 3) -> PlatformHAProxySettings:
    return PlatformHAProxySettings(
        workdir=workdir,
        platform="unit",
        tenants=[
            TenantRoute(name="alpha", priority_class=0, weight=2.0, max_concurrent_requests=7),
            TenantRoute(name="beta", priority_class=1, weight=1.0, requests_per_minute=90),
        ],
        model_slots=slots,
        queue_timeout_s=2.5,
    )


def _backend(config: str, name: str) -> str:
    return config.split(f"backend {name}\n", 1)[1].split("\n\n", 1)[0]


def test_the_written_files_pass_haproxy_check_and_the_config_and_lua_are_private(tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    write_platform_files(settings, {DIGEST: "alpha"}, {("alpha", "org/chat")}, {"org/chat": 2})
    assert "Configuration file is valid" in check_config(settings)
    for path in (settings.config_path, settings.lua_path):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert settings.map_path(KEYS_MAP).read_text() == f"{DIGEST} alpha\n"
    assert settings.map_path(ACCESS_MAP).read_text() == "alpha|org/chat 1\n"
    assert settings.map_path(MODELS_MAP).read_text() == "org/chat 2\n"
    assert settings.map_path(SLOTS_MAP).read_text() == "2 org/chat\n"


def test_every_slot_is_a_disabled_server_queueing_for_the_queue_timeout(tmp_path: Path) -> None:
    config = render_platform_config(_settings(tmp_path, slots=4))
    for slot in range(4):
        backend = _backend(config, slot_backend(slot))
        assert "timeout queue 2500ms" in backend
        assert re.search(rf"server {SLOT_SERVER} \S+ disabled maxconn 1 check", backend)
        assert REASON_MODEL_UNAVAILABLE in backend and "{ nbsrv eq 0 }" in backend
        assert "set-priority-class" in backend and "set-priority-offset" in backend
    assert f"backend {slot_backend(4)}" not in config


def test_each_tenants_limits_are_its_own(tmp_path: Path) -> None:
    config = render_platform_config(_settings(tmp_path))
    limit = [line for line in config.splitlines() if REASON_TENANT_LIMIT in line and "return" in line]
    rate = [line for line in config.splitlines() if "sc0_http_req_rate" in line and "return" in line]
    assert len(limit) == 1 and "-m str alpha" in limit[0] and "sc0_conn_cur gt 7" in limit[0]
    assert len(rate) == 1 and "-m str beta" in rate[0] and "gt 90" in rate[0] and REASON_QUOTA_EXCEEDED in rate[0]


def test_the_buffer_holds_a_whole_request_and_the_lua_state_is_shared(tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    config = render_platform_config(settings)
    assert f"tune.bufsize {settings.tune_bufsize}" in config
    assert f"lua-load {settings.lua_path}" in config and "lua-load-per-thread" not in config
    assert "wait-for-body" in config and "json_query('$.model')" in config
    assert "set-status 429" in config and REASON_QUEUE_TIMEOUT in render_platform_lua(settings)


def test_the_lua_knows_each_tenants_ceiling_and_weight_and_the_classes(tmp_path: Path) -> None:
    lua = render_platform_lua(_settings(tmp_path))
    assert '["alpha"] = {ceiling = 0, weight = 2.0, counted = false}' in lua
    assert '["beta"] = {ceiling = 1, weight = 1.0, counted = false}' in lua
    assert "{" + ", ".join(f'"{name}"' for name in PRIORITY_CLASSES) + "}" in lua


def test_the_lua_template_holds_no_literal_class_reason_or_header() -> None:
    template = LUA_TEMPLATE.template
    for literal in (*PRIORITY_CLASSES, REASON_QUEUE_TIMEOUT, REASON_MODEL_UNAVAILABLE, PRIORITY_HEADER, VAR_TENANT):
        assert literal not in template, literal


@pytest.mark.parametrize(
    ("keys", "access", "models", "problem"),
    [
        ({DIGEST: "gamma"}, set(), {}, "gamma"),
        ({}, {("alpha", "has space")}, {}, "has space"),
        ({}, set(), {"a": 0, "b": 0}, "slot of its own"),
        ({}, set(), {"a": 3}, "slot of its own"),
    ],
)
def test_files_that_could_not_be_served_are_refused(
    tmp_path: Path, keys: dict[str, str], access: set[tuple[str, str]], models: dict[str, int], problem: str
) -> None:
    with pytest.raises(ValueError, match=problem):
        write_platform_files(_settings(tmp_path), keys, access, models)


def test_a_platform_takes_no_key_list_of_its_own(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="tenants"):
        PlatformHAProxySettings(
            workdir=tmp_path,
            platform="unit",
            tenants=[TenantRoute(name="alpha", priority_class=0, weight=1.0)],
            model_slots=1,
            queue_timeout_s=1,
            protection=FrontendProtection(api_keys=ApiKeySource(env="KEYS")),
        )
