"""The one lock every pypdfium2 call in a process holds.

PDFium keeps global state and is not thread-safe: opening, rendering and closing
(closing by garbage collection included) must never overlap. Producer validation and
worker rendering can share a process (the demo, tests, an embedding application), so
both take this lock rather than one of their own.
"""

from __future__ import annotations

import threading

PDFIUM_LOCK = threading.Lock()
