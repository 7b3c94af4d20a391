# OpenAI SDKs, OpenCode, aider, chat UIs
export OPENAI_BASE_URL=http://127.0.0.1:8080/v1 OPENAI_API_KEY=unused
# Claude Code and the Anthropic SDKs (the last: Claude Code waits out a first prefill
# longer than 5 minutes on a small machine instead of dropping and retrying it)
export ANTHROPIC_BASE_URL=http://127.0.0.1:8080 ANTHROPIC_API_KEY=unused ANTHROPIC_MODEL=default ANTHROPIC_SMALL_FAST_MODEL=default CLAUDE_STREAM_IDLE_TIMEOUT_MS=1800000
# Codex (its config.toml names this variable)
export PROMPTCACHE_API_KEY=unused
