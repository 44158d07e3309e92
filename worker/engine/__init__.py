"""The continuous batch on the MLX thread: rows, sizing, order, constraints, model families."""
