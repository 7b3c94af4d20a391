"""Model preparation: loading and fingerprint, the VLM wrapper, GGUF conversion (no generation)."""
