"""The API surfaces: OpenAI chat / completions / Responses, Anthropic Messages, their request bodies, errors in each dialect, API keys and the body limit."""
