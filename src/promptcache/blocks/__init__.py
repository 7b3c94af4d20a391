"""Pure-Python block bookkeeping: pool, free queue, request tokens. No MLX, no I/O."""
