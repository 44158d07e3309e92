"""The long-running servers: the dashboard, the OpenAI-compatible API, the scheduler loop
and the fleet's metrics exporter. Each stands on the producer library, which never imports
them back.
"""
