"""The reply path: the shared request runner, the reply pump and SSE framing, reasoning / harmony channels and tool calls parsed from the output."""
