"""The project's exception types.

Bad input raises ``ValueError`` (or a subclass of it); a broken invariant raises
``InvariantError``. A failing cache tier raises ``TierError`` internally, which the
cache policy turns into a counted miss: it never reaches a request.
"""


class PromptCacheError(Exception):
    """Base class of promptcache's own exceptions."""


class InvariantError(PromptCacheError, RuntimeError):
    """An internal invariant was broken: a bug, never a user mistake."""


class TierError(PromptCacheError):
    """A cache tier failed (I/O error, corrupt data, unreachable service)."""


class CorruptBlockError(TierError):
    """A stored block failed its checksum or could not be decoded."""


class UnsupportedFormatError(CorruptBlockError):
    """A stored block of another block format (an older cache's): not damaged, but not
    read by this version; the cache counts it as a miss (``old_format_blocks``)."""


class RequestError(PromptCacheError, ValueError):
    """A request is invalid (maps to HTTP 4xx)."""


class ContextLengthError(RequestError):
    """The prompt (plus max_tokens) does not fit the model's context."""


class TemplateRenderError(PromptCacheError, RuntimeError):
    """The chat template itself failed (a syntax error, a render past its time limit, a
    runaway recursion): the server's fault, not the request's (HTTP 500). ``cause``:
    ``timeout``, ``recursion`` or ``syntax`` (counted in ``/metrics``)."""

    def __init__(self, message: str, cause: str = "error") -> None:
        super().__init__(message)
        self.cause = cause


class CancelledError(PromptCacheError):
    """A request was cancelled (client disconnect)."""


class OverloadedError(PromptCacheError):
    """The engine is at its admission limits and its wait queue is full (HTTP 429 for
    OpenAI, 529 ``overloaded_error`` for Anthropic, both with ``Retry-After``)."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineDeadError(PromptCacheError):
    """The engine thread has died; no request can be served (HTTP 503)."""
