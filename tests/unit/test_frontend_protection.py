"""The frontend's protection rules as rendered, the key list format and sources, and the key file watcher against
an in-memory runtime API."""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Iterable
from pathlib import Path

import pytest
from pydantic import ValidationError

from base import contracts
from infra.api_keys import (
    ApiKeyError,
    ApiKeySource,
    key_digest,
    key_hash_line,
    new_api_key,
    parse_key_hashes,
    render_acl,
)
from infra.haproxy.apps import AppRoute
from infra.haproxy.config import HAProxySettings
from infra.haproxy.protection import ClientLimits, FrontendProtection, protection_lines
from services.frontend.api_key_watcher import ApiKeyWatcher
from sluice.cli.local import serve_spec
from sluice.cli.main import build_parser, main

KEYS_ACL = "/w/api_keys.acl"


def _rules(protection: FrontendProtection, plain_port: int | None = None) -> list[str]:
    lines = protection_lines(protection, KEYS_ACL, plain_port)
    return [line.strip() for line in lines if not line.strip().startswith("#")]


def _index(rules: list[str], fragment: str) -> int:
    return next(i for i, rule in enumerate(rules) if fragment in rule)


def test_refusals_come_before_the_body_wait_and_the_key_never_goes_on(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("")
    protection = FrontendProtection(
        api_keys=ApiKeySource(file=keys),
        client_limits=ClientLimits(max_concurrent_requests=4, max_requests_per_window=100, window_s=20),
    )
    rules = _rules(protection)
    order = [
        _index(rules, "status 414"),
        _index(rules, "status 431"),
        _index(rules, "req.hdr_val(content-length) gt"),
        _index(rules, "status 401"),
        _index(rules, "track-sc1"),
        _index(rules, "sc1_conn_cur gt 4"),
        _index(rules, "sc1_http_req_rate gt 100"),
        _index(rules, "wait-for-body time 10s"),
        _index(rules, "req.body_len gt"),
        _index(rules, f"del-header {contracts.AUTHORIZATION_HEADER}"),
    ]
    assert order == sorted(order)
    assert "retry-after 1 " in rules[_index(rules, "return status 429")]
    assert "retry-after 20 " in rules[_index(rules, "sc1_http_req_rate gt 100 }") + 1]
    assert f"-f {KEYS_ACL}" in rules[_index(rules, "status 401")]
    # Every refusal is counted by its reason, under the same condition, just before it is answered.
    for i, rule in enumerate(rules):
        if rule.startswith("http-request return"):
            reason = re.search(rf"hdr {contracts.SERVE_REASON_HEADER} (\w+) ", rule)[1]
            condition = rule[rule.rindex(" if ") :]
            assert rules[i - 1] == f"http-request track-sc2 str({reason}) table sluice_refusals{condition}"
    # The client key is the bearer token's digest, as `key_digest` computes it.
    assert "http_auth_bearer,sha2(256),hex,lower" in rules[_index(rules, "set-var(txn.sluice_client)")]


def test_every_refusal_is_openai_json_with_its_reason() -> None:
    protection = FrontendProtection(
        api_keys=ApiKeySource(env="TEAM_KEYS"), client_limits=ClientLimits(max_concurrent_requests=1)
    )
    # A TLS frontend with a plain port kept: its refusal of keys in clear too.
    refusals = [rule for rule in _rules(protection, plain_port=8080) if rule.startswith("http-request return")]
    statuses = set()
    reasons = {**contracts.PROTECTION_REASONS, 404: contracts.REASON_UNKNOWN_PATH}
    for rule in refusals:
        status = int(re.search(r"status (\d+)", rule)[1])
        statuses.add(status)
        assert f"hdr {contracts.SERVE_REASON_HEADER} {reasons[status]} " in rule
        error = json.loads(re.search(r"string '([^']*)'", rule)[1])["error"]
        assert error["code"] == status and error["type"] and error["message"]
    assert statuses == set(reasons) - {408}  # 408 is HAProxy's own (http-error)


def test_only_the_public_api_is_routed_any_other_path_is_404_first() -> None:
    rules = [rule for rule in _rules(FrontendProtection()) if rule.startswith("http-request return")]
    assert f"hdr {contracts.SERVE_REASON_HEADER} {contracts.REASON_UNKNOWN_PATH} " in rules[0]
    assert rules[0].endswith(f"!{{ path_beg {contracts.PUBLIC_PATH_PREFIX} }} !{{ path /health }}")


def test_without_keys_clients_are_source_addresses_and_without_limits_nothing_is_tracked() -> None:
    by_address = _rules(FrontendProtection(client_limits=ClientLimits(max_requests_per_window=5)))
    assert "http-request set-var(txn.sluice_client) src" in by_address
    assert not any("401" in rule or contracts.AUTHORIZATION_HEADER in rule for rule in by_address)
    plain = _rules(FrontendProtection())
    assert not any("track-sc1" in rule or "sluice_client" in rule for rule in plain)
    assert any(rule.startswith("wait-for-body") or "wait-for-body" in rule for rule in plain)


def test_the_request_buffer_holds_the_largest_request_allowed(tmp_path: Path) -> None:
    protection = FrontendProtection(max_body_bytes=1_000_000, max_header_bytes=20_000, max_url_bytes=4_000)
    settings = HAProxySettings(workdir=tmp_path, apps=[AppRoute(name="llm")], protection=protection)
    assert settings.tune_bufsize - settings.tune_maxrewrite > 1_024_000
    with pytest.raises(ValidationError, match="window_s"):
        FrontendProtection(client_limits=ClientLimits(max_requests_per_window=5, window_s=120))


def test_key_lists_hold_hashes_with_labels_and_comments() -> None:
    text = f"# team a\n{key_hash_line('k1', 'alice')}\n\n{key_hash_line('k2')}  # bob\n"
    assert parse_key_hashes(text) == {key_digest("k1"), key_digest("k2")}
    assert key_digest("k1") == hashlib.sha256(b"k1").hexdigest()
    assert render_acl(parse_key_hashes(text)) == "".join(f"{d}\n" for d in sorted([key_digest("k1"), key_digest("k2")]))
    assert parse_key_hashes("") == frozenset()


@pytest.mark.parametrize(
    "line",
    ["sk-sluice-plaintext-key", "sha256:" + "A" * 64, "sha256:" + "a" * 63, "md5:" + "a" * 32, key_digest("k")],
)
def test_anything_but_a_hash_is_refused_with_its_line(line: str) -> None:
    with pytest.raises(ApiKeyError, match=r"keys\.txt, line 2: expected `sha256:") as refused:
        parse_key_hashes(f"{key_hash_line('ok')}\n{line}\n", "keys.txt")
    assert "plaintext-key" not in str(refused.value)  # a key pasted by mistake is not echoed whole


def test_key_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValidationError, match="exactly one"):
        ApiKeySource()
    with pytest.raises(ValidationError, match="exactly one"):
        ApiKeySource(file=tmp_path / "k", env="K")
    monkeypatch.setenv("TEAM_KEYS", f"{key_hash_line('a')},{key_hash_line('b', 'bob')}")
    assert ApiKeySource(env="TEAM_KEYS").digests() == {key_digest("a"), key_digest("b")}
    with pytest.raises(ApiKeyError, match="environment variable NOPE is not set"):
        ApiKeySource(env="NOPE").digests()
    with pytest.raises(ApiKeyError, match="cannot read the key file"):
        ApiKeySource(file=tmp_path / "missing").digests()
    first, second = new_api_key(), new_api_key()
    assert first != second and first.startswith("sk-sluice-") and len(first) > 40


def test_the_cli_prints_a_key_and_its_line(capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    assert main(["api-key", "new", "--label", "team-a"]) == 0
    out = capsys.readouterr().out
    key = re.search(r"caller; sluice stores only its hash\): (\S+)", out)[1]
    assert f"line for the key file: {key_hash_line(key, 'team-a')}" in out
    monkeypatch.setattr("sys.stdin", _Stdin(key + "\n"))
    assert main(["api-key", "hash"]) == 0
    assert capsys.readouterr().out.strip() == key_hash_line(key)


class _Stdin:
    def __init__(self, text: str) -> None:
        self.text = text

    def readline(self) -> str:
        return self.text


class FakeRuntime:
    def __init__(self, patterns: Iterable[str]) -> None:
        self.patterns = list(patterns)
        self.replaced: list[list[str]] = []

    def show_acl(self, acl_file: Path) -> list[str]:
        return list(self.patterns)

    def replace_acl(self, acl_file: Path, patterns: Iterable[str]) -> None:
        self.patterns = list(patterns)
        self.replaced.append(self.patterns)


def test_the_watcher_applies_changes_and_keeps_the_last_good_list(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text(key_hash_line("a") + "\n")
    settings = HAProxySettings(
        workdir=tmp_path / "w",
        apps=[AppRoute(name="llm")],
        protection=FrontendProtection(api_keys=ApiKeySource(file=keys)),
    )
    settings.workdir.mkdir()
    runtime = FakeRuntime([key_digest("a")])
    watcher = ApiKeyWatcher(runtime, settings, settings.protection.api_keys)  # type: ignore[arg-type]
    assert watcher.applied == {key_digest("a")} and not watcher.sync_once()
    keys.write_text(key_hash_line("b") + "\n" + key_hash_line("c") + "\n")
    assert watcher.sync_once()
    assert runtime.replaced == [sorted([key_digest("b"), key_digest("c")])]
    assert settings.keys_acl_path.read_text() == render_acl(frozenset({key_digest("b"), key_digest("c")}))
    with caplog.at_level(logging.ERROR):
        keys.write_text("sk-oops-a-plain-key\n")
        assert not watcher.sync_once() and not watcher.sync_once()
    assert len([r for r in caplog.records if "keeping the 2 accepted API keys" in r.getMessage()]) == 1
    assert "sk-oops-a-plain-key" not in caplog.text
    assert watcher.applied == {key_digest("b"), key_digest("c")}
    keys.write_text("# every key revoked\n")
    assert watcher.sync_once() and runtime.patterns == [] and watcher.applied == frozenset()


def test_serve_flags_apply_over_the_embedded_spec() -> None:
    argv = ["serve", "--api-key-file", "keys.txt", "--max-client-concurrency", "3", "--port", "9100"]
    spec = serve_spec(build_parser().parse_args([*argv, "--replicas", "3", "--policy", "power_of_two"]))
    protection = spec.frontend.protection
    assert protection.api_keys == ApiKeySource(file=Path("keys.txt").resolve())
    assert protection.client_limits.max_concurrent_requests == 3
    assert (spec.frontend.port, spec.models[0].replicas, spec.routing.policy) == (9100, 3, "power_of_two")
    plain = serve_spec(build_parser().parse_args(["serve"]))
    assert (plain.team, plain.name, plain.models[0].replicas, plain.frontend.port) == ("platform", "local-cpu", 2, 8000)
    assert plain.frontend.protection.api_keys is None and not plain.frontend.protection.client_limits.enabled
