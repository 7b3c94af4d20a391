"""Text formats: chat templates, tool-call and reasoning formats, constrained decoding."""
