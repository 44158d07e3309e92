"""The model itself: mlx-vlm calls, families, BLAS set-up, load defaults, tiny model, reader."""
