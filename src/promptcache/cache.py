"""PromptCache: the one policy module (being built; see docs/INTERFACES.md)."""
