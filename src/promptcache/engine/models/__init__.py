"""Model preparation: loading + fingerprint (``loader``), the vision-language wrapper
(``vlm``) and GGUF conversion of the embedded default model (``gguf``,
``gguf_tokenizer``). Nothing here generates; the engine imports ``loader`` only. The
tiny random-weight test models live with the tests (``tests/models/``)."""
