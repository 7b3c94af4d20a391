"""Admin endpoints for cache packs (``packs.py``): ``POST /v1/cache/export`` and ``POST
/v1/cache/import`` (streamed to a temp file within ``--max-import-bytes``, verified whole
before anything is imported), in the caller's tenant scope, in a worker thread."""

from __future__ import annotations

import logging
import tempfile
from typing import IO, Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response

from ... import packfile
from ..api.errors import APIError, json_object
from ..prompts.prepared import ChatPrompt
from ..prompts.preparer import preparer_of
from ..replies.runner import state_of

log = logging.getLogger(__name__)
router = APIRouter()

WRITE_BYTES = 1024 * 1024  # the upload is written to its file in pieces of about this



def _require_cache(request: Request) -> None:
    if state_of(request).engine.cache is None:
        raise APIError(409, "the prompt cache is disabled on this server", code="cache_disabled")


@router.post("/v1/cache/export")
async def export_pack(request: Request) -> Response:
    st = state_of(request)
    _require_cache(request)
    body = await json_object(request)
    tenant = request.state.pc_scope.tenant
    tokens: list[int] | None = None
    session = body.get("session_id")
    selection: dict[str, Any]
    if "messages" in body:
        msgs, tools = body["messages"], body.get("tools")
        if not isinstance(msgs, list) or not msgs:
            raise APIError(400, "messages must be a non-empty list", param="messages")
        prepared = await preparer_of(request).prepare(ChatPrompt(msgs, tools))
        tokens = list(prepared.tokens)
        selection = {"conversation_tokens": len(tokens), "messages": len(msgs)}
    elif "tokens" in body:
        raw = body["tokens"]
        if not isinstance(raw, list) or not raw or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in raw):
            raise APIError(400, "tokens must be a non-empty list of token ids", param="tokens")
        tokens = raw
        selection = {"conversation_tokens": len(tokens)}
    elif isinstance(session, str) and session:
        selection = {"session_id": session}
    elif body.get("all") is True:
        selection = {"tenant": tenant}
    else:
        raise APIError(400, "name what to export: messages, tokens, session_id or all=true")

    def build() -> tuple[bytes, dict[str, Any]]:
        return st.engine.cache_port.export_pack(
            tenant, selection, tokens=tokens,
            session_id=session if isinstance(session, str) else None)

    try:
        data, summary = await run_in_threadpool(build)
    except packfile.PackError as e:
        raise APIError(409, str(e), code="export_failed") from e
    log.info("exported a pack of %d blocks (%d tokens, %d bytes) for tenant %s: %s",
             summary["blocks"], summary["tokens"], len(data), tenant, selection)
    return Response(data, media_type="application/x-tar", headers={
        "Content-Disposition": 'attachment; filename="promptcache.pcpack"',
        "X-Promptcache-Blocks": str(summary["blocks"]),
        "X-Promptcache-Tokens": str(summary["tokens"])})


@router.post("/v1/cache/import")
async def import_pack(request: Request) -> dict[str, Any]:
    st = state_of(request)
    _require_cache(request)
    limit = st.config.max_import_bytes
    length = request.headers.get("content-length")
    refused = st.metrics.import_refused  # (reason, bytes): counted in /metrics
    if length is not None and length.isdigit() and int(length) > limit:
        refused("too_large", int(length))
        raise _too_large(limit)
    fixed = st.auth.key_tenant(request)
    scope_tenant = request.state.pc_scope.tenant
    with tempfile.TemporaryFile(dir=st.config.import_dir, prefix=".import-") as f:
        seen = [0]
        try:
            await _receive(request, f, limit, seen)
        except APIError as e:
            refused("too_large" if e.status == 413 else "invalid_pack", seen[0])
            raise

        def verify() -> packfile.Pack:
            return packfile.read_pack(f)

        try:
            pack = await run_in_threadpool(verify)
        except packfile.PackError as e:
            log.warning("pack import refused: %s", e)
            refused("invalid_pack", seen[0])
            raise APIError(400, str(e), code="invalid_pack") from e
    tenant = pack.namespace.tenant
    if fixed is not None and tenant != fixed:
        raise APIError(403, f"this API key may only import packs of its own tenant; the pack "
                            f"belongs to {tenant!r}", code="tenant_mismatch")
    if fixed is None and request.headers.get("x-tenant-id") and tenant != scope_tenant:
        raise APIError(400, f"the pack belongs to tenant {tenant!r}, not {scope_tenant!r}",
                       code="tenant_mismatch")
    try:
        report = await run_in_threadpool(st.engine.cache_port.import_pack, pack)
    except packfile.PackError as e:
        log.warning("pack import refused: %s", e)
        raise APIError(400, str(e), code="invalid_pack") from e
    log.info("imported a pack: %d blocks (%d new, %d tokens) into tenant %s",
             report.blocks, report.added, report.tokens, tenant)
    return {**report.to_dict(), "tenant": tenant}


def _too_large(limit: int) -> APIError:
    log.warning("pack import refused: larger than --max-import-bytes %d", limit)
    return APIError(413, f"the pack is larger than the server's limit of {limit} bytes "
                         "(--max-import-bytes)", code="request_too_large")


async def _receive(request: Request, f: IO[bytes], limit: int, seen: list[int]) -> None:
    """The body into ``f``, written off the event loop: 413 past ``limit``, 400 once it
    does not start like a pack. ``seen[0]``: bytes received."""
    start = packfile.PackStart()
    piece = bytearray()
    async for chunk in request.stream():
        seen[0] += len(chunk)
        if seen[0] > limit:
            raise _too_large(limit)
        try:
            start.feed(chunk)
        except packfile.PackError as e:
            log.warning("pack import refused: %s", e)
            raise APIError(400, str(e), code="invalid_pack") from e
        piece += chunk
        if len(piece) >= WRITE_BYTES:
            await run_in_threadpool(f.write, bytes(piece))
            piece.clear()
    if piece:
        await run_in_threadpool(f.write, bytes(piece))
