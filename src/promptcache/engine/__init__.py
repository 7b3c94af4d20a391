"""Everything that touches mlx / mlx-lm lives under this package."""
