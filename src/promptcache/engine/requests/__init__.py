"""The request path: intake, admission, the engine thread's loop, prefill, decode, saves."""
