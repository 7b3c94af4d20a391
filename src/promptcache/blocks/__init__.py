"""Pure-Python block bookkeeping: block pool, free queue, prefix index. No MLX, no I/O."""
