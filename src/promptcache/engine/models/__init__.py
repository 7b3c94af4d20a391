"""Model preparation: loading and fingerprint (``loader``), the VLM wrapper (``vlm``), GGUF
conversion of the default model. Nothing here generates.
"""
