"""What the frontend refuses before any route call, so that no client can hold or starve a replica.

The public API's paths alone (`PUBLIC_PATH_PREFIX`, `PUBLIC_PATHS`: 404 `unknown_path` for any other), header and
body timeouts, size limits, API keys and per-client limits, rendered as the public frontend's rules;
every refusal carries `x-serve-reason` (`base.contracts.PROTECTION_REASONS`) and an OpenAI-style JSON body. The
rules in the order HAProxy applies them: infra/haproxy/README.md (protection of the replicas).
"""

from __future__ import annotations

from pydantic import BaseModel, Field, model_validator

from base.contracts import (
    AUTHORIZATION_HEADER,
    MAX_BODY_BYTES_DEFAULT,
    MAX_HEADER_BYTES_DEFAULT,
    MAX_URL_BYTES_DEFAULT,
    MODEL_REASONS,
    PROTECTION_REASONS,
    PUBLIC_PATH_PREFIX,
    PUBLIC_PATHS,
    REASON_BODY_TOO_LARGE,
    REASON_CLIENT_LIMIT,
    REASON_HEADERS_TOO_LARGE,
    REASON_INVALID_API_KEY,
    REASON_TLS_REQUIRED,
    REASON_UNKNOWN_PATH,
    REASON_URL_TOO_LONG,
    REQUEST_TIMEOUT_S_DEFAULT,
    RETRY_AFTER_HEADER,
    SERVE_REASON_HEADER,
)
from base.spec_config import SPEC_SECTION_CONFIG
from infra.api_keys import ApiKeySource
from infra.haproxy.formatting import counter_table_lines, haproxy_time, openai_error_body

CLIENT_TABLE = "sluice_clients"
# Refusals by reason, for `sluice_frontend_refusals_total` (a stick table: shared by HAProxy's threads).
REFUSAL_TABLE = "sluice_refusals"
# The rules' refusals (a body that is not whole in time gets HAProxy's own 408, after which no rule runs), and
# a multi-model frontend's refusals of a request whose model it cannot tell (`infra.haproxy.models`).
COUNTED_REASONS = (
    REASON_UNKNOWN_PATH,
    *(reason for status, reason in PROTECTION_REASONS.items() if status != 408),
    *MODEL_REASONS,
)
VAR_CLIENT = "txn.sluice_client"
# Entries of clients that stopped sending are dropped after this long (at least one rate window).
CLIENT_IDLE_EXPIRE_S = 60
# A client over its concurrency limit may retry as soon as one of its requests ends: say one second.
CONCURRENCY_RETRY_AFTER_S = 1


class ClientLimits(BaseModel):
    """Per-client limits at the frontend (None: no limit)."""

    model_config = SPEC_SECTION_CONFIG

    max_concurrent_requests: int | None = Field(None, ge=1)
    """Requests one client may have in flight at once (429 past it; none unless set)."""
    max_requests_per_window: int | None = Field(None, ge=1)
    """Requests one client may send per `window_s` (429 with Retry-After past it; none unless set)."""
    window_s: int = Field(10, ge=1, le=3600)
    """The rate window of `max_requests_per_window`, in seconds."""
    table_size: int = Field(100_000, ge=100)
    """Clients tracked at once; the least recently seen are evicted beyond it."""

    @property
    def enabled(self) -> bool:
        return self.max_concurrent_requests is not None or self.max_requests_per_window is not None


class FrontendProtection(BaseModel):
    """A stack's frontend limits; the defaults fit chat requests with room to spare."""

    model_config = SPEC_SECTION_CONFIG

    request_timeout_s: float = Field(REQUEST_TIMEOUT_S_DEFAULT, gt=0, le=600)
    """How long a client may take to send its headers and body (408 past it)."""
    max_body_bytes: int = Field(MAX_BODY_BYTES_DEFAULT, ge=1024, le=256 * 1024 * 1024)
    """The largest request body (413 past it)."""
    max_header_bytes: int = Field(MAX_HEADER_BYTES_DEFAULT, ge=1024, le=1024 * 1024)
    """The largest request headers (431 past it)."""
    max_url_bytes: int = Field(MAX_URL_BYTES_DEFAULT, ge=256, le=1024 * 1024)
    """The longest request URL (414 past it)."""
    client_limits: ClientLimits = ClientLimits()
    """Per-client limits on concurrency and rate (off unless set)."""
    api_keys: ApiKeySource | None = None
    """Where the team's API key hashes come from (`file` or `env`; off unless set)."""

    @model_validator(mode="after")
    def _window_fits_the_table(self) -> FrontendProtection:
        if self.client_limits.window_s > CLIENT_IDLE_EXPIRE_S and self.client_limits.max_requests_per_window:
            raise ValueError(f"client_limits.window_s may be at most {CLIENT_IDLE_EXPIRE_S} s")
        return self

    def request_bytes(self) -> int:
        """What one request may hold at most: request line, headers and body."""
        return self.max_url_bytes + self.max_header_bytes + self.max_body_bytes


def _refusal(status: int, reason: str, message: str, condition: str, *extra_headers: str) -> list[str]:
    """Count the refusal by its reason, then answer it (a stream tracks sc2 once: one refusal per request)."""
    headers = "".join(f" hdr {header}" for header in extra_headers)
    body = openai_error_body(f"sluice refused the request: {message}", status)
    return [
        f"    http-request track-sc2 str({reason}) table {REFUSAL_TABLE} if {condition}",
        f"    http-request return status {status} content-type application/json"
        f" hdr {SERVE_REASON_HEADER} {reason}{headers} string '{body}' if {condition}",
    ]


def protection_lines(protection: FrontendProtection, keys_acl: str, plain_port: int | None = None) -> list[str]:
    """The public frontend's rules before the route action; `keys_acl`: the key digests' pattern file;
    `plain_port`: the plain-HTTP port of a frontend with TLS, where a request carrying a key is refused."""
    limits = protection.client_limits
    outside_the_api = " ".join([f"!{{ path_beg {PUBLIC_PATH_PREFIX} }}", *(f"!{{ path {p} }}" for p in PUBLIC_PATHS)])
    lines = [
        "    # Protection of the replicas (infra/haproxy/protection.py): refused here, never routed.",
        *_refusal(404, REASON_UNKNOWN_PATH, f"no such path: the API is under {PUBLIC_PATH_PREFIX}", outside_the_api),
        *(
            _refusal(
                403,
                REASON_TLS_REQUIRED,
                "an API key is not accepted over plain HTTP: use https",
                f"{{ dst_port {plain_port} }} {{ req.hdr({AUTHORIZATION_HEADER}) -m found }}",
            )
            if plain_port is not None
            else []
        ),
        *_refusal(
            414,
            REASON_URL_TOO_LONG,
            f"the request line is over {protection.max_url_bytes} bytes",
            f"{{ url,length gt {protection.max_url_bytes} }}",
        ),
        *_refusal(
            431,
            REASON_HEADERS_TOO_LARGE,
            f"the headers are over {protection.max_header_bytes} bytes",
            f"{{ req.hdrs,length gt {protection.max_header_bytes} }}",
        ),
        *_refusal(
            413,
            REASON_BODY_TOO_LARGE,
            f"the body is over {protection.max_body_bytes} bytes",
            f"{{ req.hdr_val(content-length) gt {protection.max_body_bytes} }}",
        ),
    ]
    if protection.api_keys is not None:
        lines += [
            f"    http-request set-var({VAR_CLIENT}) http_auth_bearer,sha2(256),hex,lower",
            *_refusal(
                401,
                REASON_INVALID_API_KEY,
                "a valid API key is required (Authorization: Bearer <key>)",
                f"!{{ var({VAR_CLIENT}) -m str -f {keys_acl} }}",
                'www-authenticate "Bearer"',
            ),
        ]
    elif limits.enabled:
        lines.append(f"    http-request set-var({VAR_CLIENT}) src")
    if limits.enabled:
        lines.append(f"    http-request track-sc1 var({VAR_CLIENT}) table {CLIENT_TABLE}")
    if limits.max_concurrent_requests is not None:
        lines += _refusal(
            429,
            REASON_CLIENT_LIMIT,
            f"over {limits.max_concurrent_requests} requests in flight for this client",
            f"{{ sc1_conn_cur gt {limits.max_concurrent_requests} }}",
            f"{RETRY_AFTER_HEADER} {CONCURRENCY_RETRY_AFTER_S}",
        )
    if limits.max_requests_per_window is not None:
        lines += _refusal(
            429,
            REASON_CLIENT_LIMIT,
            f"over {limits.max_requests_per_window} requests per {limits.window_s} s for this client",
            f"{{ sc1_http_req_rate gt {limits.max_requests_per_window} }}",
            f"{RETRY_AFTER_HEADER} {limits.window_s}",
        )
    lines += [
        f"    http-request wait-for-body time {haproxy_time(protection.request_timeout_s)}",
        *_refusal(
            413,
            REASON_BODY_TOO_LARGE,
            f"the body is over {protection.max_body_bytes} bytes",
            f"{{ req.body_len gt {protection.max_body_bytes} }}",
        ),
    ]
    if protection.api_keys is not None:
        lines.append(f"    http-request del-header {AUTHORIZATION_HEADER}")
    return lines


def protection_tables(protection: FrontendProtection) -> list[str]:
    """The stick tables: refusals by reason, and per-client counters when a limit is set."""
    lines = counter_table_lines(
        REFUSAL_TABLE, "Requests refused by the protection rules, by reason.", len(COUNTED_REASONS)
    )
    limits = protection.client_limits
    if limits.enabled:
        lines += [
            f"backend {CLIENT_TABLE}",
            "    # Per-client counters: requests in flight (conn_cur of an http-request tracker), request rate.",
            f"    stick-table type string len 64 size {limits.table_size} expire {CLIENT_IDLE_EXPIRE_S}s"
            f" store conn_cur,http_req_rate({limits.window_s}s)",
            "",
        ]
    return lines
