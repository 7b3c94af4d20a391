"""Request bodies of the OpenAI and Anthropic endpoints (pydantic): lenient about fields
not used (``extra="allow"``), strict about those used; semantic checks live in
``prompt.py`` and the routers, so they answer in the API's own error shape."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


class OAIFunctionCall(_Lenient):
    name: str
    arguments: str | dict[str, Any] = "{}"


class OAIToolCall(_Lenient):
    id: str | None = None
    type: str = "function"
    function: OAIFunctionCall


class OAIMessage(_Lenient):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[OAIToolCall] | None = None
    tool_call_id: str | None = None


class OAIStreamOptions(_Lenient):
    include_usage: bool = False


class _OAISampling(_Lenient):
    """Fields the OpenAI chat and completions requests share."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: OAIStreamOptions | None = None
    n: int | None = None
    user: str | None = None
    # {"token id": bias in [-100, 100]}: checked in openai_params.py (a 400 naming it)
    logit_bias: Any = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # mlx_lm.server's and vLLM's extensions
    repetition_penalty: float | None = None
    repetition_context_size: int | None = None


class ChatCompletionRequest(_OAISampling):
    messages: list[OAIMessage]
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # {"type": "text" | "json_object" | "json_schema", "json_schema": {"name", "schema"}}
    response_format: dict[str, Any] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    # the session key of OpenAI's prompt caching (used when no session header is sent)
    prompt_cache_key: str | None = None
    reasoning_effort: str | None = None


class CompletionRequest(_OAISampling):
    prompt: str | list[str] | list[int]
    echo: bool = False
    # checked in openai_params.py
    logprobs: Any = None
    best_of: Any = None


class AnthropicMessage(_Lenient):
    role: str
    content: str | list[dict[str, Any]]


class AnthropicTool(_Lenient):
    name: str
    # None / "custom": a client tool; others are server tools a local model cannot run
    type: str | None = None
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=dict)


class MessagesRequest(_Lenient):
    model: str | None = None
    messages: list[AnthropicMessage]
    max_tokens: int
    system: str | list[dict[str, Any]] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    tools: list[AnthropicTool] | None = None
    tool_choice: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    # {"type": "enabled" | "adaptive" | "disabled", "budget_tokens"?}: the template's switch
    thinking: dict[str, Any] | None = None
    # accepted and ignored on purpose (see docs/api.md's Claude Code table)
    context_management: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    service_tier: str | None = None
    # {"previous_message_id": "msg_..." | null} (beta cache-diagnosis-2026-04-07)
    diagnostics: dict[str, Any] | None = None


class CountTokensRequest(_Lenient):
    model: str | None = None
    messages: list[AnthropicMessage]
    system: str | list[dict[str, Any]] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


class ResponsesRequest(_Lenient):
    model: str | None = None
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    repetition_context_size: int | None = None
    reasoning: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    include: list[str] | None = None
    prompt_cache_key: str | None = None
    metadata: dict[str, Any] | None = None
    stream: bool = False
    user: str | None = None
