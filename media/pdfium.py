"""The one lock every pypdfium2 call in a process holds.

PDFium keeps global state and is not thread-safe: opening, rendering and closing
(closing by garbage collection included) must never overlap. Producer validation and
worker rendering can share a process (the demo, tests, an embedding application), so
both take this lock rather than one of their own.
"""

from __future__ import annotations

import re
import threading

PDFIUM_LOCK = threading.Lock()


# PDFium's FPDF_GetLastError codes (fpdfview.h), as pypdfium2's PdfiumError.err_code.
_OPEN_PROBLEMS = {
    0: "is a PDF with no pages",
    4: "is an encrypted (password-protected) PDF: remove the password before enqueueing it",
    5: "is a PDF encrypted with a security handler PDFium does not support",
    6: "is a PDF whose page tree is broken (no page can be loaded)",
}


_NO_PAGES_RE = re.compile(rb"/Type\s*/Pages\b[^>]*?/Count\s+0\b|/Count\s+0\b[^>]*?/Type\s*/Pages\b")


def open_problem(exc: Exception, data: bytes | None = None) -> str:
    """What a failed PdfDocument() means, in words (PDFium's own say "Success" for no pages).

    PDFium's error code is process-wide and not reset by a later failure that sets none
    (a PDF with no pages), so after an encrypted PDF the next zero-page PDF would read
    "encrypted": the file's own bytes are checked first. Phrased to follow the file's
    name: "report.pdf is an encrypted ... PDF".
    """
    if data is not None:
        if b"/Encrypt" in data:
            return _OPEN_PROBLEMS[4]
        if _NO_PAGES_RE.search(data):
            return _OPEN_PROBLEMS[0]
    code = getattr(exc, "err_code", None)
    if code == 0:
        return _OPEN_PROBLEMS[0]
    if isinstance(code, int) and code in (5, 6):
        return _OPEN_PROBLEMS[code]
    return f"is a corrupt or truncated PDF ({exc})"
