"""The vlmq worker: one process, one loaded model, many jobs in one continuous batcher.

Importing this package must not import MLX: the CLI (shared with producers) imports
`vlmq.cli.worker`, and MLX is only needed once a worker or the tiny-model builder runs.
"""
