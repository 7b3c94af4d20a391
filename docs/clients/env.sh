# OpenAI SDKs, OpenCode, aider, chat UIs
export OPENAI_BASE_URL=http://127.0.0.1:8080/v1 OPENAI_API_KEY=unused
# Claude Code and the Anthropic SDKs
export ANTHROPIC_BASE_URL=http://127.0.0.1:8080 ANTHROPIC_API_KEY=unused ANTHROPIC_MODEL=default ANTHROPIC_SMALL_FAST_MODEL=default
# Codex (its config.toml names this variable)
export PROMPTCACHE_API_KEY=unused
