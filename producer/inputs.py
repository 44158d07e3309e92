"""A set of inputs turned into a job's items: every file named is found
(producer/expand.py), checked by content (producer/files.py, media/checks.py) and cut into
pages (producer/page_specs.py), and every problem is found here, before one byte reaches
Redis; all bad files are reported together, so the user fixes the set in one go.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

from vlmq.media.checks import NotMedia
from vlmq.media.formats import suffix_kind
from vlmq.producer import files
from vlmq.producer.expand import FoundFile, check_name, expand_inputs
from vlmq.producer.files import BlobSource, CheckedFile, LocalStores
from vlmq.producer.page_specs import PageSpec, PagesWithoutPdf, parse_pages
from vlmq.shared import constants as C
from vlmq.shared.errors import InputError
from vlmq.shared.messages import Item, Ref
from vlmq.stores.backends import Stores


class InputErrors(InputError):
    """Several files are bad; raised once with all of them so the user fixes the set in one go."""

    def __init__(self, errors: Sequence[InputError]) -> None:
        self.errors = list(errors)
        lines = "\n".join(f"  {e.path}: {e.problem}" for e in self.errors)
        super().__init__(f"{len(self.errors)} file(s)", f"rejected:\n{lines}")

    def __str__(self) -> str:
        return f"{len(self.errors)} bad input file(s):\n" + "\n".join(
            f"  {e.path}: {e.problem}" for e in self.errors)


# A file a folder held that is not media: (path, kind as formats.suffix_kind, reason).
NotMediaFile = tuple[str, str, str]


def not_media(found: FoundFile, exc: InputError) -> NotMediaFile | None:
    """The one rule for what a set leaves out (and reports) rather than refuses: a file
    found in a folder (or under a prefix) that the content check found is not media
    (media/checks.py NotMedia). A file named on its own is never left out: the person
    asked for that file, so its refusal stands."""
    if found.walked and isinstance(exc, NotMedia):
        return found.path, suffix_kind(found.path), exc.problem
    return None


def not_media_summary(left_out: Sequence[NotMediaFile]) -> str:
    """"skipped 3 files that are not PDFs or images: .txt 1, .xmp 2"."""
    what = "file that is not a PDF or an image" if len(left_out) == 1 else \
        "files that are not PDFs or images"
    return f"skipped {len(left_out)} {what}: {_kind_counts(left_out)}"


def _kind_counts(left_out: Sequence[NotMediaFile]) -> str:
    kinds = Counter(kind for _, kind, _ in left_out)
    return ", ".join(f"{kind} {n}" for kind, n in sorted(kinds.items()))


class NoMedia(InputError):
    """The folders given hold files, and none of them is a PDF or an image."""

    def __init__(self, left_out: Sequence[NotMediaFile]) -> None:
        path, _, reason = left_out[0]
        super().__init__(path, reason)
        self.left_out = list(left_out)

    def __str__(self) -> str:
        path, _, reason = self.left_out[0]
        return (f"no PDFs or images to enqueue, only {len(self.left_out)} other file(s): "
                f"{_kind_counts(self.left_out)}\n  e.g. {path}: {reason}")


@dataclass
class Prepared:
    """Items ready for a payload (uploads and references), the distinct blobs the uploads
    need, and what was left out: bad files (`rejected`, with skip_bad) and files in
    folders that are not media (`not_media`)."""

    items: list[Item] = field(default_factory=list)
    blobs: dict[str, BlobSource] = field(default_factory=dict)
    rejected: list[tuple[str, str]] = field(default_factory=list)
    not_media: list[NotMediaFile] = field(default_factory=list)

    def add(self, checked: CheckedFile, pages: Iterable[int | None], *,
            custom_id: str | None = None) -> None:
        if checked.ref is not None:
            for page in pages:
                self.items.append(Item(kind=checked.kind, blob=None, source=checked.source,
                                       page=page, custom_id=custom_id, ref=checked.ref,
                                       size=checked.size, ref_sha256=checked.sha256))
            return
        self.blobs.setdefault(checked.sha256, checked.blob())
        for page in pages:
            self.items.append(Item(kind=checked.kind, blob=checked.sha256,
                                   source=checked.source, page=page, custom_id=custom_id))

    def by_reference(self, stores: Stores) -> Prepared:
        """The same items, those whose file lies in one of `stores` as references (the
        rest stay uploads): for sets checked as uploads first, such as a manifest."""
        if not stores:
            return self
        out = Prepared(rejected=list(self.rejected), not_media=list(self.not_media))
        refs: dict[str, tuple[Ref, int]] = {}
        for sha, src in self.blobs.items():
            ref = stores.ref_for_path(src.path)
            if ref is not None:
                refs[sha] = (ref, src.size)
            else:
                out.blobs[sha] = src
        for item in self.items:
            hit = refs.get(item.sha256) if item.blob is not None else None
            out.items.append(item if hit is None else replace(
                item, blob=None, ref=hit[0], size=hit[1], ref_sha256=item.blob))
        return out


def prepare(paths: Iterable[str | os.PathLike[str]], *, pages: PageSpec = None,
            recursive: bool = False, skip_bad: bool = False,
            stores: Stores | None = None,
            limit: int | None = C.MAX_ITEMS_PER_JOB,
            on_file: Callable[[int, int], None] | None = None) -> Prepared:
    """Check every file and build items: an image is one item, a PDF or TIFF one item per
    page.

    `pages` applies to each PDF and TIFF (an image is always its one page); given with
    none among the inputs it is refused (PagesWithoutPdf). All bad files are
    collected first; unless skip_bad, any bad file rejects the whole set (InputErrors).
    Files are read one at a time and only their hash kept (upload reads them again). The
    item `limit` (one job's; None for a set that becomes a batch, producer/job_sets.py) is
    enforced the moment it is passed: reading thousands more files only to refuse the set
    afterwards would waste minutes.

    Files in one of `stores` (s3:// sources always) become references: nothing of theirs
    is uploaded, and their bytes are hashed as a stream. `on_file(done, total)` is called
    after each file, for progress over a folder that takes minutes to hash.
    """
    stores = stores if stores is not None else Stores()
    found, errors = expand_inputs(paths, stores, recursive=recursive)
    local = LocalStores(stores)
    prepared = Prepared()
    for done, f in enumerate(found, start=1):
        try:
            checked, page_list = checked_pages(f, stores, pages, local)
        except InputError as exc:
            left_out = not_media(f, exc)
            if left_out is not None:
                prepared.not_media.append(left_out)
            else:
                errors.append(exc)
            continue
        finally:
            if on_file is not None:
                on_file(done, len(found))
        prepared.add(checked, page_list)
        if limit is not None and len(prepared.items) > limit:
            raise InputError(f"{len(found)} file(s)",
                             f"the first {done} file(s) already make {len(prepared.items)} "
                             f"items, over the {limit}-item limit per job; Client.submit_set "
                             "(and `vlmq enqueue`) split a set this size into a batch of jobs")
    return finished(prepared, errors, skip_bad=skip_bad, pages=pages)


def checked_pages(found: FoundFile, stores: Stores, pages: PageSpec,
                  local: LocalStores | None = None) -> tuple[CheckedFile, list[int | None]]:
    """One found file checked, with the pages of it that become items. Errors name the
    path as found; the item carries the relative source. `local`: the stores' folder
    roots, resolved once per set."""
    check_name(found)
    checked = files.check_found(found, stores, local)
    if checked.kind not in C.PAGED_KINDS:
        return checked, [None]
    return checked, list(parse_pages(pages, checked.pages, found.path))


def finished(prepared: Prepared, errors: list[InputError], *, skip_bad: bool,
              pages: PageSpec) -> Prepared:
    """The set once every file was looked at: refused whole for a bad file (unless
    skip_bad), for nothing to enqueue (NoMedia when its folders held only files that are
    not media), or for a page range nothing has."""
    if errors and not skip_bad:
        if len(errors) == 1:
            raise errors[0]
        raise InputErrors(errors)
    prepared.rejected = [(e.path, e.problem) for e in errors]
    if not prepared.items:
        if errors:
            raise InputErrors(errors)
        if prepared.not_media:
            raise NoMedia(prepared.not_media)
        raise InputError("(no files)", "nothing to enqueue")
    if pages is not None and not any(i.kind in C.PAGED_KINDS for i in prepared.items):
        # An image is always its one page, so the range would be dropped without a word;
        # more likely the user meant a different file.
        raise PagesWithoutPdf()
    return prepared
