"""The worker's JobSettings is the settings table's, not a copy: every field is a row, its
default is the row's, and the result-cache key leaves out exactly the rows that do not
decide an item's text."""

from __future__ import annotations

from dataclasses import MISSING, fields

from vlmq.shared import settings as S
from vlmq.worker.job_settings import NOT_DECIDING_TEXT, JobSettings
from vlmq.worker.model.defaults import Resolved


def test_every_field_is_a_row_with_the_rows_default() -> None:
    resolved = {f.name for f in fields(Resolved)}
    for f in fields(JobSettings):
        row = S.BY_NAME[f.name]
        if f.name not in resolved:  # Resolved's come from the model's rows, no default
            assert f.default is not MISSING and f.default == row.default, f.name


def test_not_deciding_text_is_the_rows_that_do_not() -> None:
    names = {f.name for f in fields(JobSettings)}
    assert {n for n in names if not S.BY_NAME[n].decides_text} == NOT_DECIDING_TEXT
    assert {"result_cache", "blob_ttl", "stream"} == NOT_DECIDING_TEXT  # as the rows say
