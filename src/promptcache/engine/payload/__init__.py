"""The payload stack: cache objects <-> block payloads, layouts, quantization, restore, live states."""
