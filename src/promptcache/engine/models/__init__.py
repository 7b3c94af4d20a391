"""Model preparation: loading + fingerprint (``loader``), GGUF conversion of the embedded
default model (``gguf``, ``gguf_tokenizer``) and tiny random-weight test models
(``tiny_models``). Nothing here generates; the engine imports ``loader`` only."""
