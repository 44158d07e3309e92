"""What one API key may hold: each limit one row, from which `vlmq api`'s options, the
server's settings and docs/openai-api.md's table follow (a test holds the page to it).

A key pays for its own bytes: an upload's size is checked from its Content-Length before
any of it is read, the uploads a key has on the wire at once are counted as their headers
arrive, and the files a key keeps (their number and bytes) are checked before an upload's
form is parsed. Imports nothing heavy: the CLI reads it to build its options.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

MB = 1000 * 1000  # as OpenAI states its file limits
GB = 1000 * MB
MAX_JSON_BYTES = 1 << 20  # a create request is a few hundred bytes; metadata is bounded
# A chat request carries its image inline (base64): OpenAI's limit on a request's payload.
MAX_CHAT_BYTES = 50 * MB
FORM_SLACK = 1 << 20  # multipart's headers and the purpose field, beyond the file


@dataclass(frozen=True)
class Limit:
    name: str  # the ApiLimits field, and the option's parameter
    flag: str
    default: float  # in `unit`s
    unit: str
    scale: int  # the field's value is the option's times this
    doc: str

    @property
    def integer(self) -> bool:
        return self.unit != "GB"


LIMITS: tuple[Limit, ...] = (
    Limit("upload_bytes", "--max-upload-mb", 200, "MB", MB,
          "the size of one upload (OpenAI's limit for a batch file); a larger "
          "Content-Length is refused (413) before the body is read"),
    Limit("files_per_key", "--max-files-per-key", 1000, "files", 1,
          "the files one key keeps at once; the next upload is refused (400) until it "
          "deletes one"),
    Limit("stored_bytes_per_key", "--max-stored-gb-per-key", 20, "GB", GB,
          "the bytes of the files one key keeps at once, an upload's included (400 past "
          "it)"),
    Limit("uploads_per_key", "--max-uploads-per-key", 4, "uploads", 1,
          "the uploads one key sends at once; one more is refused (429, which the SDKs "
          "retry) before its body is read"),
)
BY_NAME: Mapping[str, Limit] = {limit.name: limit for limit in LIMITS}


def _default(name: str) -> int:
    row = BY_NAME[name]
    return int(row.default * row.scale)


@dataclass(frozen=True)
class ApiLimits:
    upload_bytes: int = _default("upload_bytes")
    files_per_key: int = _default("files_per_key")
    stored_bytes_per_key: int = _default("stored_bytes_per_key")
    uploads_per_key: int = _default("uploads_per_key")

    @classmethod
    def from_options(cls, values: Mapping[str, float]) -> ApiLimits:
        """From the options' values (in their units), each row's default where absent."""
        return cls(**{f.name: int(values.get(f.name, BY_NAME[f.name].default)
                                  * BY_NAME[f.name].scale) for f in fields(cls)})


def doc_table() -> str:
    """docs/openai-api.md's table of the limits, as the page must hold it."""
    rows = ["| option | default | what it bounds |", "| --- | --- | --- |"]
    rows += [f"| `{r.flag}` | {r.default:,g} {r.unit} | {r.doc} |" for r in LIMITS]
    return "\n".join(rows)
