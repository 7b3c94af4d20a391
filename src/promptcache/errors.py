"""The project's exception types. A failing tier's ``TierError`` becomes a counted miss."""


class PromptCacheError(Exception):
    """Base class of promptcache's own exceptions."""


class InvariantError(PromptCacheError, RuntimeError):
    """An internal invariant was broken: a bug, never a user mistake."""


class TierError(PromptCacheError):
    """A cache tier failed (I/O error, corrupt data, unreachable service)."""


class CorruptBlockError(TierError):
    """A stored block failed its checksum or could not be decoded."""


class UnsupportedFormatError(CorruptBlockError):
    """A block of an older format: not damaged, not read; a counted miss (``old_format_blocks``)."""


class RequestError(PromptCacheError, ValueError):
    """A request is invalid (maps to HTTP 4xx)."""


class ContextLengthError(RequestError):
    """The prompt (plus max_tokens) does not fit the model's context."""


class TemplateRenderError(PromptCacheError, RuntimeError):
    """The chat template failed (syntax, time limit, recursion: ``cause``): HTTP 500."""

    def __init__(self, message: str, cause: str = "error") -> None:
        super().__init__(message)
        self.cause = cause


class CancelledError(PromptCacheError):
    """A request was cancelled (client disconnect)."""


class OverloadedError(PromptCacheError):
    """Admission limits and wait queue full (429 OpenAI, 529 Anthropic, with ``Retry-After``)."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineDeadError(PromptCacheError):
    """The engine thread has died; no request can be served (HTTP 503)."""
