"""`vlmq dashboard`: a read-only web page over queues, workers and jobs' results.

Needs the `dashboard` extra (Flask, waitress, markdown-it-py); nothing here imports the
worker, so it runs from a producer-only install.
"""
