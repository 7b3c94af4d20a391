"""OpenAI Responses API: input items and tools -> template messages (the items and tool types
accepted are in docs/api.md; others are a 400 or, for server-side tools, left out), and
``ResponseStore``: responses kept for ``previous_response_id`` and ``GET
/v1/responses/{id}``, bounded, in memory, per tenant (one tenant never sees another's)."""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ...lru import BoundedLRU
from ..prompts.images import ImageCollector
from ..prompts.prompt import check_tool_parameters, function_arguments, image_part
from .errors import APIError

NAMESPACE_SEP = "__"
_ROLES = {"user": "user", "assistant": "assistant", "system": "system",
          "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
_MEDIA_PARTS = ("input_image", "input_file", "input_audio", "image_url", "file")


def _bad(message: str, param: str = "input") -> APIError:
    return APIError(400, message, code="invalid_request", param=param)


def _parts_text(content: Any, where: str, images: ImageCollector | None = None) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where}.content must be a string or a list of content parts")
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, Mapping):
            raise _bad(f"{where}.content[{i}] must be an object")
        ptype = part.get("type")
        if ptype in _TEXT_PARTS:
            text = part.get("refusal") if ptype == "refusal" else part.get("text")
            if not isinstance(text, str):
                raise _bad(f"{where}.content[{i}].text must be a string")
            texts.append(text)
        elif ptype in ("input_image", "image_url") and images is not None:
            try:
                texts.append(image_part(dict(part), f"{where}.content[{i}]", images, "input"))
            except ValueError as e:
                raise _bad(str(e)) from None
        elif ptype in _MEDIA_PARTS:
            raise _bad(f"{where}.content[{i}]: content type {ptype!r} is not supported "
                       "(text-only model)")
        else:
            raise _bad(f"{where}.content[{i}]: unknown content part type {ptype!r}")
    return "".join(texts)


@dataclass
class Conversation:
    """Template messages of a Responses conversation and the call ids it holds."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    call_ids: set[str] = field(default_factory=set)
    # the images of the conversation so far (a vision-language model), else None
    images: ImageCollector | None = None

    def copy(self) -> Conversation:
        return Conversation([dict(m) for m in self.messages], set(self.call_ids),
                            self.images.copy() if self.images is not None else None)

    def _assistant(self) -> dict[str, Any]:
        """The assistant turn a call joins: the last message if it is one."""
        if self.messages and self.messages[-1]["role"] == "assistant":
            return self.messages[-1]
        msg: dict[str, Any] = {"role": "assistant", "content": ""}
        self.messages.append(msg)
        return msg

    def add_call(self, call_id: str, name: str, arguments: dict[str, Any]) -> None:
        msg = self._assistant()
        msg.setdefault("tool_calls", []).append(
            {"id": call_id, "type": "function",
             "function": {"name": name, "arguments": arguments}})
        self.call_ids.add(call_id)

    def add_item(self, item: Mapping[str, Any], where: str,
                 store: TenantResponses | None = None) -> None:
        itype = item.get("type", "message" if "role" in item else None)
        if itype == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise _bad(f"{where}.role: unknown role {role!r} "
                           f"(expected one of {', '.join(_ROLES)})")
            self.messages.append({"role": _ROLES[role],
                                  "content": _parts_text(item.get("content", ""), where,
                                                         self.images)})
        elif itype in ("function_call", "custom_tool_call"):
            call_id, name = item.get("call_id"), item.get("name")
            if not isinstance(call_id, str) or not call_id or not isinstance(name, str):
                raise _bad(f"{where}: {itype} needs string 'call_id' and 'name'")
            namespace = item.get("namespace")
            if isinstance(namespace, str) and namespace:
                name = f"{namespace}{NAMESPACE_SEP}{name}"
            if itype == "function_call":
                raw = item.get("arguments", "{}")
                if not isinstance(raw, str):
                    raise _bad(f"{where}.arguments must be a JSON string")
                args = function_arguments(raw, where)
            else:
                text = item.get("input", "")
                if not isinstance(text, str):
                    raise _bad(f"{where}.input must be a string")
                args = {"input": text}
            self.add_call(call_id, name, args)
        elif itype in ("function_call_output", "custom_tool_call_output"):
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or call_id not in self.call_ids:
                raise _bad(f"{where}: no tool call found for function call output with "
                           f"call_id {call_id!r}")
            output = item.get("output", "")
            text = output if isinstance(output, str) else _parts_text(output, where)
            self.messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif itype == "reasoning":
            return  # not replayed into the prompt
        elif itype == "item_reference":
            ref = store.item(str(item.get("id"))) if store is not None else None
            if ref is None:
                raise _bad(f"{where}: item {item.get('id')!r} not found")
            self.add_item(ref, where, None)
        else:
            raise _bad(f"{where}.type: unknown item type {itype!r}")

    def add_input(self, items: str | list[dict[str, Any]] | None,
                  store: TenantResponses | None) -> None:
        if items is None:
            return
        if isinstance(items, str):
            self.messages.append({"role": "user", "content": items})
            return
        for i, item in enumerate(items):
            if not isinstance(item, Mapping):
                raise _bad(f"input[{i}] must be an object")
            self.add_item(item, f"input[{i}]", store)

    def add_output(self, output: list[dict[str, Any]]) -> None:
        """The output items of a response, as the next turn will see them."""
        for item in output:
            if item.get("type") == "message":
                text = "".join(p.get("text", "") for p in item.get("content", []))
                self.messages.append({"role": "assistant", "content": text})
            elif item.get("type") == "function_call":
                name = item["name"]
                if item.get("namespace"):
                    name = f"{item['namespace']}{NAMESPACE_SEP}{name}"
                self.add_call(item["call_id"], name, json.loads(item["arguments"] or "{}"))


@dataclass(frozen=True)
class OfferedTools:
    tools: list[dict[str, Any]] | None  # in the OpenAI chat function format
    # qualified name -> (namespace, name) for functions of namespace tools
    namespaced: dict[str, tuple[str, str]]


def _function(tool: Mapping[str, Any], where: str, name: str | None = None) -> dict[str, Any]:
    fname = tool.get("name")
    if not isinstance(fname, str) or not fname:
        raise _bad(f"{where}.name must be a non-empty string", "tools")
    params = tool.get("parameters") or {"type": "object", "properties": {}}
    if not isinstance(params, Mapping):
        raise _bad(f"{where}.parameters must be an object", "tools")
    try:
        check_tool_parameters(dict(params), f"{where}.parameters")
    except ValueError as e:
        raise _bad(str(e), "tools") from e
    return {"type": "function", "function": {"name": name or fname,
                                             "description": tool.get("description") or "",
                                             "parameters": dict(params)}}


def responses_tools(tools: list[dict[str, Any]] | None) -> OfferedTools:
    out: list[dict[str, Any]] = []
    namespaced: dict[str, tuple[str, str]] = {}
    for i, tool in enumerate(tools or ()):
        where = f"tools[{i}]"
        if not isinstance(tool, Mapping):
            raise _bad(f"{where} must be an object", "tools")
        kind = tool.get("type")
        if kind == "function":
            out.append(_function(tool, where))
        elif kind == "namespace":
            ns = tool.get("name")
            inner = tool.get("tools")
            if not isinstance(ns, str) or not ns or not isinstance(inner, list):
                raise _bad(f"{where}: a namespace tool needs a 'name' and a list of 'tools'",
                           "tools")
            for j, fn in enumerate(inner):
                if isinstance(fn, Mapping) and fn.get("type", "function") == "function":
                    qualified = f"{ns}{NAMESPACE_SEP}{fn.get('name')}"
                    out.append(_function(fn, f"{where}.tools[{j}]", qualified))
                    namespaced[qualified] = (ns, str(fn.get("name")))
        elif not isinstance(kind, str):
            raise _bad(f"{where}.type must be a string", "tools")
        # any other type: a server-side tool the model cannot run, left out
    return OfferedTools(out or None, namespaced)


@dataclass
class StoredResponse:
    response: dict[str, Any]  # the response object (GET /v1/responses/{id})
    conversation: Conversation  # without the instructions (not carried over)


class ResponseStore:
    """Bounded LRU of stored responses (thread-safe), reached only through
    ``scoped(tenant)``: only the creating tenant sees, uses or deletes one."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: BoundedLRU[tuple[str, str], StoredResponse] = BoundedLRU(max(0, capacity))
        self._lock = threading.Lock()

    def scoped(self, tenant: str) -> TenantResponses:
        return TenantResponses(self, tenant)

    def put(self, tenant: str, rid: str, stored: StoredResponse) -> None:
        if self.capacity <= 0:
            return
        with self._lock:
            self._items.put((tenant, rid), stored)

    def get(self, tenant: str, rid: str) -> StoredResponse | None:
        with self._lock:
            return self._items.get((tenant, rid))

    def delete(self, tenant: str, rid: str) -> bool:
        with self._lock:
            return self._items.pop((tenant, rid)) is not None

    def item(self, tenant: str, item_id: str) -> dict[str, Any] | None:
        """An output item of one of the tenant's stored responses, by its id."""
        with self._lock:
            for (owner, _), stored in reversed(self._items.items()):
                if owner != tenant:
                    continue
                for item in stored.response.get("output", []):
                    if item.get("id") == item_id:
                        return dict(item)
        return None

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)


class TenantResponses:
    """One tenant's view of the ``ResponseStore`` (what a request may reach)."""

    def __init__(self, store: ResponseStore, tenant: str) -> None:
        self.store = store
        self.tenant = tenant

    def put(self, rid: str, stored: StoredResponse) -> None:
        self.store.put(self.tenant, rid, stored)

    def get(self, rid: str) -> StoredResponse | None:
        return self.store.get(self.tenant, rid)

    def delete(self, rid: str) -> bool:
        return self.store.delete(self.tenant, rid)

    def item(self, item_id: str) -> dict[str, Any] | None:
        return self.store.item(self.tenant, item_id)
