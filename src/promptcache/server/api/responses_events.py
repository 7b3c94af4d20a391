"""The Responses API's output items of one reply and the streaming events announcing them."""

from __future__ import annotations

import uuid
from typing import Any

from ...engine.api import GenerationResult, TokenEvent
from ..replies.reasoning import Piece
from ..replies.reply import Finished, LogprobDecoder, sse_event
from ..replies.toolcalls import ToolCall
from .responses_items import OfferedTools


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def responses_usage(result: GenerationResult, reasoning_tokens: int) -> dict[str, Any]:
    u = result.usage
    return {"input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens,
                                                              u.completion_tokens)},
            "total_tokens": u.prompt_tokens + u.completion_tokens}


class ReplyItems:
    """Output items of one reply and (streaming) their events; ``sequence_number``: every event."""

    def __init__(self, offered: OfferedTools, decoder: LogprobDecoder | None) -> None:
        self.offered = offered
        self.decoder = decoder
        self.output: list[dict[str, Any]] = []
        self.seq = 0
        self.kind: str | None = None  # the open item: "reasoning" | "message" | None
        self.text = ""
        self.pending: list[TokenEvent] = []  # logprobs of the open message's text
        self.logprobs: list[dict[str, Any]] = []

    def event(self, etype: str, **data: Any) -> str:
        payload = {"type": etype, "sequence_number": self.seq, **data}
        self.seq += 1
        return sse_event(etype, payload)

    def _item_id(self) -> str:
        return str(self.output[-1]["id"])

    def _open(self, kind: str) -> list[str]:
        out = self._close()
        self.kind, self.text = kind, ""
        if kind == "reasoning":
            item: dict[str, Any] = {"type": "reasoning", "id": new_id("rs"), "summary": [],
                                    "content": [], "encrypted_content": None,
                                    "status": "in_progress"}
            part: dict[str, Any] = {"type": "reasoning_text", "text": ""}
        else:
            item = {"type": "message", "id": new_id("msg"), "status": "in_progress",
                    "role": "assistant", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.output.append(item)
        index = len(self.output) - 1
        out.append(self.event("response.output_item.added", output_index=index,
                              item=dict(item)))
        out.append(self.event("response.content_part.added", item_id=item["id"],
                              output_index=index, content_index=0, part=part))
        return out

    async def _flush_logprobs(self) -> list[dict[str, Any]]:
        if self.decoder is None or not self.pending:
            return []
        entries = await self.decoder.entries(self.pending)
        self.pending.clear()
        self.logprobs += entries
        return entries

    def _close(self) -> list[str]:
        if self.kind is None:
            return []
        item, index = self.output[-1], len(self.output) - 1
        out = []
        if self.kind == "reasoning":
            part: dict[str, Any] = {"type": "reasoning_text", "text": self.text}
            out.append(self.event("response.reasoning_text.done", item_id=item["id"],
                                  output_index=index, content_index=0, text=self.text))
        else:
            part = {"type": "output_text", "text": self.text, "annotations": [],
                    "logprobs": self.logprobs}
            out.append(self.event("response.output_text.done", item_id=item["id"],
                                  output_index=index, content_index=0, text=self.text,
                                  logprobs=self.logprobs))
        out.append(self.event("response.content_part.done", item_id=item["id"],
                              output_index=index, content_index=0, part=part))
        item["content"] = [part]
        item["status"] = "completed"
        if self.kind == "reasoning":
            item.pop("status")
        out.append(self.event("response.output_item.done", output_index=index,
                              item=dict(item)))
        self.kind = None
        return out

    async def piece(self, p: Piece) -> list[str]:
        kind = "reasoning" if p.kind == "reasoning" else "message"
        if kind == "reasoning":
            self.pending.clear()  # logprobs cover the message text
        out = self._open(kind) if self.kind != kind else []
        self.text += p.text
        index = len(self.output) - 1
        if kind == "reasoning":
            out.append(self.event("response.reasoning_text.delta", item_id=self._item_id(),
                                  output_index=index, content_index=0, delta=p.text))
        else:
            entries = await self._flush_logprobs()
            out.append(self.event("response.output_text.delta", item_id=self._item_id(),
                                  output_index=index, content_index=0, delta=p.text,
                                  logprobs=entries))
        return out

    def call(self, call: ToolCall) -> list[str]:
        out = self._close()
        namespace = self.offered.namespaced.get(call.name)
        item: dict[str, Any] = {"type": "function_call", "id": new_id("fc"),
                                "call_id": f"call_{uuid.uuid4().hex[:24]}",
                                "name": namespace[1] if namespace else call.name,
                                "arguments": "", "status": "in_progress"}
        if namespace:
            item["namespace"] = namespace[0]
        self.output.append(item)
        index = len(self.output) - 1
        out.append(self.event("response.output_item.added", output_index=index,
                              item=dict(item)))
        args = call.arguments_json
        out.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                              output_index=index, delta=args))
        out.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                              output_index=index, name=item["name"], arguments=args))
        item["arguments"], item["status"] = args, "completed"
        out.append(self.event("response.output_item.done", output_index=index,
                              item=dict(item)))
        return out

    async def finish(self, fin: Finished) -> list[str]:
        """Close the open item; calls follow; an empty reply still has a message."""
        out: list[str] = []
        if self.pending and self.kind == "message":
            self.logprobs += await self._flush_logprobs()
        if not self.output and not fin.tool_calls:
            out += self._open("message")
        out += self._close()
        for call in fin.tool_calls:
            out += self.call(call)
        return out
