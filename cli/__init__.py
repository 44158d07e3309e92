"""The `vlmq` command's root, above the producer and the worker.

Composing both sides here keeps the packages apart: vlmq.shared (the wire protocol) imports
neither, and the worker imports nothing of the producer's, so each can be read, installed and
changed on its own. Only this package, and the demo that runs both, may reach into both.
"""
