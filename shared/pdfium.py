"""The one lock every pypdfium2 call in a process holds.

PDFium keeps global state and is not thread-safe: opening, rendering and closing
(closing by garbage collection included) must never overlap. Producer validation and
worker rendering can share a process (the demo, tests, an embedding application), so
both take this lock rather than one of their own.
"""

from __future__ import annotations

import threading

PDFIUM_LOCK = threading.Lock()


# PDFium's FPDF_GetLastError codes (fpdfview.h), as pypdfium2's PdfiumError.err_code.
_OPEN_PROBLEMS = {
    0: "is a PDF with no pages",
    4: "is an encrypted (password-protected) PDF: remove the password before enqueueing it",
    5: "is a PDF encrypted with a security handler PDFium does not support",
    6: "is a PDF whose page tree is broken (no page can be loaded)",
}


def open_problem(exc: Exception) -> str:
    """What a failed PdfDocument() means, in words (PDFium's own say "Success" for no pages).

    Phrased to follow the file's name: "report.pdf is an encrypted ... PDF".
    """
    code = getattr(exc, "err_code", None)
    if isinstance(code, int) and code in _OPEN_PROBLEMS:
        return _OPEN_PROBLEMS[code]
    if "password" in str(exc).lower():
        return _OPEN_PROBLEMS[4]
    return f"is a corrupt or truncated PDF ({exc})"
