"""API keys and request scoping (tenant, session, agent): no key, ``--api-key`` (Bearer or
``x-api-key``, else 401) or ``--api-keys-file`` (a key fixes the tenant; another in the
header is a 403); the session from the first ``SESSION_HEADERS`` header, else a body
field (``prompt_cache_key``). docs/api.md."""

from __future__ import annotations

import dataclasses
import hmac
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

from fastapi import Request

from ...meta import DEFAULT_TENANT, validate_tenant
from .errors import APIError

log = logging.getLogger(__name__)

_SESSION_RE = re.compile(r"^[\x21-\x7e]{1,256}$")
# client session headers, in order of precedence (the explicit one first)
SESSION_HEADERS = ("x-session-id", "x-claude-code-session-id", "session-id",
                   "x-session-affinity")
AGENT_HEADER = "x-claude-code-agent-id"
PARENT_AGENT_HEADER = "x-claude-code-parent-agent-id"


def validate_session_id(session_id: str) -> str:
    if not _SESSION_RE.match(session_id):
        raise ValueError(
            "session id must be 1-256 printable ASCII characters without spaces, "
            f"got {session_id[:80]!r}"
        )
    return session_id


def load_api_keys(path: Path) -> dict[str, str]:
    """Read ``{"key": "tenant"}``; bad files raise ValueError (at startup)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read API keys file {path}: {e}") from e
    if not isinstance(data, dict) or not data:
        raise ValueError(f"API keys file {path} must hold a non-empty JSON object key -> tenant")
    keys: dict[str, str] = {}
    for key, tenant in data.items():
        if not isinstance(key, str) or not key or not isinstance(tenant, str):
            raise ValueError(f"API keys file {path}: entries must map key strings to tenants")
        keys[key] = validate_tenant(tenant)
    return keys


def _valid_session(value: str | None) -> bool:
    return value is not None and bool(_SESSION_RE.match(value))


@dataclass(frozen=True)
class Scope:
    tenant: str = DEFAULT_TENANT
    session_id: str | None = None
    # a header name or a body field such as "prompt_cache_key" (None: no session)
    session_source: str | None = None
    agent_id: str | None = None
    parent_agent_id: str | None = None

    def with_session(self, value: str | None, source: str) -> Scope:
        """The session from a body field when no header named one (invalid: ignored)."""
        if self.session_id is not None or value is None:
            return self
        if not _valid_session(value):
            log.info("ignoring an invalid %s as the session id: %r", source, value[:80])
            return self
        return dataclasses.replace(self, session_id=value, session_source=source)

    def describe(self) -> str:
        """For the request log line: ``session=<id> (<source>) agent=<id>``."""
        out = f"session={self.session_id} ({self.session_source})" if self.session_id \
            else "session=-"
        if self.agent_id:
            out += f" agent={self.agent_id}"
            if self.parent_agent_id:
                out += f" parent={self.parent_agent_id}"
        return out


class Authenticator:
    def __init__(self, api_key: str | None = None, keys: dict[str, str] | None = None) -> None:
        if api_key is not None and not api_key:
            raise ValueError("api key must not be empty")
        self.api_key = api_key
        self.keys = dict(keys or {})

    @property
    def enabled(self) -> bool:
        return self.api_key is not None or bool(self.keys)

    @staticmethod
    def _presented_key(request: Request) -> str | None:
        auth = request.headers.get("authorization")
        if auth:
            scheme, _, value = auth.partition(" ")
            if scheme.lower() == "bearer" and value.strip():
                return value.strip()
        key = request.headers.get("x-api-key")
        return key.strip() if key else None

    def key_tenant(self, request: Request) -> str | None:
        """The tenant fixed by the key (None: not fixed). Raises 401 when auth fails."""
        if not self.enabled:
            return None
        presented = self._presented_key(request)
        if presented is None:
            raise APIError(401, "missing API key: send 'Authorization: Bearer <key>' or "
                                "'x-api-key: <key>'", code="invalid_api_key")
        if self.api_key is not None and hmac.compare_digest(presented, self.api_key):
            return None
        for key, tenant in self.keys.items():
            if hmac.compare_digest(presented, key):
                return tenant
        raise APIError(401, "invalid API key", code="invalid_api_key")

    def query_tenant(self, request: Request, tenant: str | None, action: str) -> str | None:
        """The tenant an admin request acts on (None: every tenant): ``?tenant=`` (400 when
        invalid), or the key's own tenant, which may not name another (403)."""
        if tenant is not None:
            try:
                validate_tenant(tenant)
            except ValueError as e:
                raise APIError(400, f"invalid tenant: {e}", param="tenant") from e
        fixed = self.key_tenant(request)
        if fixed is None:
            return tenant
        if tenant is not None and tenant != fixed:
            raise APIError(403, f"this API key may only {action}", code="tenant_mismatch")
        return fixed

    def deletion_tenant(self, request: Request, tenant: str | None) -> str | None:
        """The tenant a deletion by session acts in (None: every tenant): a tenant-bound
        key's own (another: 403), else ``?tenant=``, else ``X-Tenant-Id``. 400 if invalid."""
        fixed = self.key_tenant(request)
        header = request.headers.get("x-tenant-id")
        for what, value in (("tenant", tenant), ("X-Tenant-Id", header)):
            if value is not None:
                try:
                    validate_tenant(value)
                except ValueError as e:
                    raise APIError(400, f"invalid {what}: {e}", code="invalid_tenant") from e
        if fixed is not None:
            if (tenant is not None and tenant != fixed) or (header is not None and header != fixed):
                raise APIError(403, "this API key may only delete its own tenant's sessions",
                               code="tenant_mismatch")
            return fixed
        return tenant if tenant is not None else header

    def scope(self, request: Request) -> Scope:
        fixed = self.key_tenant(request)
        header = request.headers.get("x-tenant-id")
        if header is not None:
            try:
                validate_tenant(header)
            except ValueError as e:
                raise APIError(400, f"invalid X-Tenant-Id: {e}", code="invalid_tenant") from e
        if fixed is not None and header is not None and header != fixed:
            raise APIError(403, "X-Tenant-Id does not match the tenant of this API key",
                           code="tenant_mismatch")
        tenant = fixed or header or DEFAULT_TENANT
        explicit = request.headers.get("x-session-id")
        if explicit is not None:
            try:
                validate_session_id(explicit)
            except ValueError as e:
                raise APIError(400, f"invalid X-Session-Id: {e}", code="invalid_session") from e
        session, source = None, None
        for name in SESSION_HEADERS:
            value = request.headers.get(name)
            if value is None:
                continue
            if _valid_session(value):
                session, source = value, name
                break
            log.info("ignoring an invalid %s header: %r", name, value[:80])
        agent = request.headers.get(AGENT_HEADER)
        parent = request.headers.get(PARENT_AGENT_HEADER)
        return Scope(tenant=tenant, session_id=session, session_source=source,
                     agent_id=agent if _valid_session(agent) else None,
                     parent_agent_id=parent if _valid_session(parent) else None)
