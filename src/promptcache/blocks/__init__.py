"""Pure-Python block bookkeeping: block pool, free queue, prefix index, request tokens.
No MLX, no tier, no I/O (matching a request against the pool and the lower tiers is
``cache.matcher``)."""
