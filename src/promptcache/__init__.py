"""promptcache: a multi-tier prompt cache and the MLX inference server that uses it."""

__version__ = "0.1.0"
