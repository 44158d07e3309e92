"""The producer's defaults that `vlmq ... --help` shows, in a module that imports nothing.

The commands' help is generated from these same values, and reading them must not import
the client (Pillow, PDFium, RQ): a listing command starts in well under 0.15 s only if its
module's imports stay this cheap. Their users import them from here.
"""

from __future__ import annotations

# Items per job when a set is cut into a batch (producer/job_sets.py says why 500).
JOB_ITEMS = 500
# A producer's Redis budget: its uploaded inputs whose jobs have not ended (producer/upload.py).
DEFAULT_MAX_PENDING_MB = 1024
