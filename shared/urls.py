"""Redis URLs with their secrets masked, for every message and log line vlmq prints.

Producer and worker output ends up in CI logs and terminals people share: a password
may be in the userinfo (`redis://:secret@host`) or in the query (`?password=secret`).
"""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, urlencode, urlsplit

MASK = "***"
_SECRET_PARAMS = frozenset({"password", "pass", "pwd", "auth", "sentinel_password"})
# Fallback for text urlsplit cannot parse: mask userinfo passwords and password params.
_USERINFO_RE = re.compile(r"(//[^/@:]*):[^@]*@")
_PARAM_RE = re.compile(r"(?i)\b(sentinel_password|password|pass|pwd|auth)=[^&#\s]*")


def redact_url(url: str) -> str:
    """The URL with any password replaced by ***; everything else kept, for diagnosis."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        return _PARAM_RE.sub(rf"\1={MASK}", _USERINFO_RE.sub(rf"\1:{MASK}@", url))
    netloc = parts.netloc
    if password is not None:
        userinfo, _, host = netloc.rpartition("@")
        user = userinfo.split(":", 1)[0]
        netloc = f"{user}:{MASK}@{host}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(k.lower() in _SECRET_PARAMS for k, _ in pairs):
            query = urlencode([(k, MASK if k.lower() in _SECRET_PARAMS else v) for k, v in pairs],
                              safe="*")
    # Replace the pieces in place: urlunsplit would rewrite e.g. unix:///path as unix:/path.
    out = url.replace(parts.netloc, netloc, 1) if netloc != parts.netloc else url
    return out.replace(f"?{parts.query}", f"?{query}", 1) if query != parts.query else out
