"""Hand-built PDFs for hostile-input tests: every object written out, nothing downloaded."""

from __future__ import annotations

import zlib


def build_pdf(objects: list[bytes], *, trailer_extra: bytes = b"") -> bytes:
    """A PDF with a correct xref; objects are numbered from 1, the first is the catalog."""
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for i, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % i + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    for off in offsets:
        out += b"%010d 00000 n \n" % off
    out += (b"trailer\n<< /Size %d /Root 1 0 R %s>>\nstartxref\n%d\n%%%%EOF\n"
            % (len(objects) + 1, trailer_extra, xref))
    return bytes(out)


def _stream(content: bytes, *, compress: bool = True) -> bytes:
    if compress:
        data = zlib.compress(content, 9)
        return b"<< /Length %d /Filter /FlateDecode >>\nstream\n" % len(data) + data + \
            b"\nendstream"
    return b"<< /Length %d >>\nstream\n" % len(content) + content + b"\nendstream"


def one_page_pdf(content: bytes, *, media_box: bytes = b"[0 0 612 792]",
                 compress: bool = True) -> bytes:
    return build_pdf([
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox " + media_box + b" /Contents 4 0 R >>",
        _stream(content, compress=compress),
    ])


def drawing_bomb_pdf(ops: int) -> bytes:
    """One page of `ops` filled rectangles: tens of KB on disk, gigabytes to render."""
    return one_page_pdf(b"0 0 1 1 re f\n" * ops)


def zero_page_pdf() -> bytes:
    return build_pdf([b"<< /Type /Catalog /Pages 2 0 R >>",
                      b"<< /Type /Pages /Kids [] /Count 0 >>"])


def encrypted_pdf() -> bytes:
    """Standard security handler whose user password is not empty: PDFium wants a password."""
    pdf = build_pdf([
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] >>",
        b"<< /Filter /Standard /V 1 /R 2 /Length 40 /P -4 /O <" + b"11" * 32 + b"> /U <"
        + b"22" * 32 + b"> >>",
    ], trailer_extra=b"/Encrypt 4 0 R /ID [<00112233445566778899aabbccddeeff>"
                     b"<00112233445566778899aabbccddeeff>] ")
    return pdf
