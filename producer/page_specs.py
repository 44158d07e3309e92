"""Page specs ("1-3,7", or a list of ints) turned into the pages of a document that become
items: checked against the page count before anything is expanded, so a typo is an error
message, never 300 million items.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from vlmq.shared.errors import InputError

_RANGE_PART = re.compile(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?")

PageSpec = str | Sequence[int] | None


class PagesWithoutPdf(InputError):
    """A page range was given but no input has pages (a PDF or a TIFF): it would select
    nothing, silently."""

    def __init__(self, option: str = "pages") -> None:
        self.option = option
        super().__init__(option, "applies to PDFs and multi-page TIFFs, and none of the "
                                 "inputs is one")

    def __str__(self) -> str:
        return f"{self.option} {self.problem}"


def parse_pages(spec: PageSpec, page_count: int, source: str) -> list[int]:
    """'1-3,7' -> [1, 2, 3, 7]: 1-based, in the order given, duplicates dropped.

    None means every page. A list of ints is checked the same way as a string. Each range
    is checked against page_count before it is expanded, so '1-300000000' is an error
    message, not a list of 300 million ints.
    """
    if spec is None:
        return list(range(1, page_count + 1))
    pages: list[int] = []
    if isinstance(spec, str):
        if not spec.strip():
            raise InputError(source, "empty page range")
        for part in spec.split(","):
            m = _RANGE_PART.fullmatch(part)
            if not m:
                raise InputError(source, f"bad page range {part.strip()!r} in {spec!r} "
                                         "(use e.g. 1-3,7)")
            lo = int(m.group(1))
            hi = int(m.group(2)) if m.group(2) is not None else lo
            if lo < 1 or hi < 1:
                raise InputError(source, f"pages are numbered from 1, got {part.strip()!r}")
            if hi < lo:
                raise InputError(source, f"bad page range {part.strip()!r}: "
                                         f"{hi} comes before {lo}")
            _check_in_range(hi, page_count, source)
            pages.extend(range(lo, hi + 1))
    else:
        for value in spec:
            if isinstance(value, bool) or not isinstance(value, int):
                raise InputError(source, f"page numbers must be integers, got {value!r}")
            if value < 1:
                raise InputError(source, f"pages are numbered from 1, got {value}")
            _check_in_range(value, page_count, source)
            pages.append(value)
        if not pages:
            raise InputError(source, "empty page list")
    return list(dict.fromkeys(pages))


def _check_in_range(page: int, page_count: int, source: str) -> None:
    if page > page_count:
        raise InputError(source, f"page {page} is out of range: {source} has "
                                 f"{page_count} page{'s' if page_count != 1 else ''}")
