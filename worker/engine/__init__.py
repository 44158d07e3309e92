"""The continuous batch on the MLX thread: rows, sizing, constraints, `vlmq model check`."""
