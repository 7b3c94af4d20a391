"""The Engine's chat-template surface (render, encode) and its synchronous ``generate``."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import RequestError
from ..meta import DEFAULT_TENANT
from .api import GenerationRequest, GenerationResult, SamplingParams
from .formats.templates import ChatTemplate

if TYPE_CHECKING:
    from .requests.handles import RequestHandle

_SAMPLING_FIELDS = frozenset(SamplingParams.__dataclass_fields__)


class Prompting:
    """Prompts from chats or text through the chat template (thread-safe) and ``generate``."""

    def __init__(self, templates: ChatTemplate,
                 submit: Callable[[GenerationRequest], RequestHandle]) -> None:
        self._templates = templates
        self._submit = submit

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], tools: Any = None,
        add_generation_prompt: bool = True, *, continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Prompt token ids of a chat (see ``templates.ChatTemplate.render``); thread-safe."""
        return self._templates.render(messages, tools, add_generation_prompt,
                                      continue_final_message=continue_final_message,
                                      template_kwargs=template_kwargs)

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a plain-text prompt (``/v1/completions``), length-checked; thread-safe."""
        return self._templates.encode(text)

    def render_chat_with_offsets(
        self, messages: Sequence[Mapping[str, Any]], tools: Any = None,
        add_generation_prompt: bool = True, *, continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> tuple[list[int], tuple[int, ...]]:
        """``(tokens, message_starts)`` in one render + tokenization; thread-safe."""
        return self._templates.render_with_offsets(
            messages, tools, add_generation_prompt,
            continue_final_message=continue_final_message, template_kwargs=template_kwargs)

    def generate(
        self,
        prompt: Sequence[int] | Sequence[Mapping[str, Any]],
        *,
        tenant: str = DEFAULT_TENANT,
        session_id: str | None = None,
        use_cache: bool = True,
        tools: Any = None,
        **sampling: Any,
    ) -> GenerationResult:
        """Synchronous helper: token ids or chat messages in, the final result out."""
        unknown = set(sampling) - _SAMPLING_FIELDS
        if unknown:
            raise RequestError(f"unknown sampling parameters: {sorted(unknown)}")
        for key in ("stop", "stop_token_ids"):
            if key in sampling and isinstance(sampling[key], (list, tuple)):
                sampling[key] = tuple(sampling[key])
            elif key in sampling and isinstance(sampling[key], str) and key == "stop":
                sampling[key] = (sampling[key],)
        starts: tuple[int, ...] = ()
        items = list(prompt)
        if items and isinstance(items[0], Mapping):
            tokens, starts = self.render_chat_with_offsets(items, tools)  # type: ignore[arg-type]
        else:
            tokens = items  # type: ignore[assignment]
        req = GenerationRequest(
            prompt_tokens=tuple(tokens), sampling=SamplingParams(**sampling), tenant=tenant,
            session_id=session_id, use_cache=use_cache, message_starts=starts,
        )
        return self._submit(req).result()
