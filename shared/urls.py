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


# Query parameters that carry a credential in a presigned or token URL (S3 SigV4 and V2,
# Azure SAS, GCS, OAuth), besides the Redis ones above; matched case-insensitively.
_SIGNED_PARAMS = ("x-amz-signature", "x-amz-credential", "x-amz-security-token",
                  "x-goog-signature", "x-goog-credential", "signature", "awsaccesskeyid",
                  "sig", "token", "access_token", "secret", "api_key", "apikey")
_ANY_SECRET_PARAM_RE = re.compile(
    r"(?i)(?<![A-Za-z0-9_-])(" + "|".join(
        re.escape(p) for p in sorted({*_SECRET_PARAMS, *_SIGNED_PARAMS}, key=len,
                                     reverse=True)) + r")(=|%3D)[^&#\s'\"]*")
# scheme://userinfo@host: the whole userinfo goes (a user name may be an access key id).
_ANY_USERINFO_RE = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/@\s'\"]+@")


def redact_text(text: str) -> str:
    """`text` (an error, a log line, a stored item error) with every secret a URL in it
    may carry replaced by ***: the userinfo of `scheme://user:pass@host`, and the value of
    any password, signature, credential or token query parameter, wherever it appears.

    Errors quote URLs they did not build (botocore quotes AWS_ENDPOINT_URL; a user's
    `--store` value may be a presigned URL), so this runs on the text, not on one URL,
    and everything that is not a secret is kept for diagnosis.
    """
    out = _ANY_USERINFO_RE.sub(rf"\1{MASK}@", text)
    return _ANY_SECRET_PARAM_RE.sub(rf"\1\2{MASK}", out)
