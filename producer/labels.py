"""Labels as people type them (`key=value`), read once for every front end: the CLI's
`--label`, the dashboard's filter and the Python client's checks agree on what is a label.
"""

from __future__ import annotations

from collections.abc import Sequence

from vlmq.shared.keys import label_problem


def split_labels(values: Sequence[str]) -> dict[str, str]:
    """`key=value` strings as a dict; ValueError names the first one without a key or '='
    or one no job could carry (shared/keys.py's label_problem)."""
    labels: dict[str, str] = {}
    for raw in values:
        key, sep, value = raw.partition("=")
        if not sep or not key:
            raise ValueError(f"label {raw!r} is not key=value")
        problem = label_problem(key, value)
        if problem is not None:
            raise ValueError(problem)
        labels[key] = value
    return labels
