"""The HTTP server: OpenAI- and Anthropic-compatible endpoints over an Engine."""

from .app import create_app

__all__ = ["create_app"]
