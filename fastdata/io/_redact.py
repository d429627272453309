"""Redaction: how messages, warnings and logs show a URL without its secrets.

A signed URL's tokens (its query values, except the few that say why a request was refused:
start, expiry, version, permissions), its fragment and a password never appear in text fastdata
writes; its path (the shard name) does. :func:`safe_cause` keeps an exception out of a cause
chain whose text would show a secret. Design note: ``docs/design/io.md``.
"""
from __future__ import annotations

__all__ = ["redact", "redact_url", "safe_cause"]

_HIDDEN = "***"
# parameters of signed URLs whose values are no secret and tell why a request was refused (a token
# expired, a permission missing): shown; every other parameter's value is hidden
_SHOWN_PARAMS = frozenset({
    "sv", "st", "se", "sp", "sr", "spr", "srt", "ss",  # Azure SAS: version, start, expiry, permissions
    "x-amz-date", "x-amz-expires", "x-amz-algorithm", "x-amz-signedheaders",
    "x-goog-date", "x-goog-expires", "x-goog-algorithm", "x-goog-signedheaders", "expires",
})


def _shown(name: str) -> bool:
    return name.lower() in _SHOWN_PARAMS


def redact_url(url: str) -> str:
    """``url`` as messages, warnings and logs show it: the value of each query parameter (the tokens
    of a signed URL: an Azure SAS ``sig``, an S3 presigned ``X-Amz-Signature``, a CDN token), the
    fragment and a password in the user info become ``***``; scheme, host, path (the shard name),
    the parameter names and the values of a signed URL's start, expiry, version and permissions
    stay (``https://h/ds/a.tar?se=2030-01-01&sig=***``)."""
    if not isinstance(url, str) or "://" not in url:
        return url
    scheme, rest = url.split("://", 1)
    cut = min((k for k in (rest.find("?"), rest.find("#")) if k >= 0), default=len(rest))
    head, tail = rest[:cut], rest[cut:]
    slash = head.find("/")
    netloc, path = (head, "") if slash < 0 else (head[:slash], head[slash:])
    if "@" in netloc:
        user, host = netloc.rsplit("@", 1)
        if ":" in user:
            netloc = f"{user.split(':', 1)[0]}:{_HIDDEN}@{host}"
    query, _, fragment = tail.partition("#")
    if query:
        query = "?" + "&".join(
            (f"{k}={v if _shown(k) else _HIDDEN}" if v else k + "=") if sep else (_HIDDEN if k else "")
            for k, sep, v in (item.partition("=") for item in query[1:].split("&")))
    return f"{scheme}://{netloc}{path}{query}" + (f"#{_HIDDEN}" if fragment or tail.find("#") >= 0 else "")


def _secrets(url: str) -> list[str]:
    """The parts of ``url`` that :func:`redact_url` hides and that may show up in other text: the whole
    query, long parameter values (raw and decoded), the password; longest first."""
    import urllib.parse

    if not isinstance(url, str) or "://" not in url:
        return []
    rest = url.split("://", 1)[1]
    cut = min((k for k in (rest.find("?"), rest.find("#")) if k >= 0), default=len(rest))
    head, tail = rest[:cut], rest[cut:]
    found = [tail] if len(tail) > 1 else []
    netloc = head.split("/", 1)[0]
    if "@" in netloc and ":" in netloc.rsplit("@", 1)[0]:
        found.append(netloc.rsplit("@", 1)[0].split(":", 1)[1])
    for item in tail[1:].replace("#", "&").split("&"):
        name, sep, value = item.partition("=")
        if not sep:
            value = name
        elif _shown(name):
            continue
        for v in (value, urllib.parse.unquote(value), urllib.parse.unquote_plus(value)):
            if len(v) >= 8:  # short values ("r", "2021") are no secret and would garble the text
                found.append(v)
    return sorted(set(found), key=len, reverse=True)


def redact(text: str, url: str) -> str:
    """``text`` (an error message, a library's exception text) with ``url`` and its secret parts
    (see :func:`redact_url`) hidden."""
    secrets = _secrets(url)
    if not secrets:
        return text
    text = text.replace(url, redact_url(url))
    for s in secrets:  # the whole query first (longest), shown with its names as redact_url shows it
        text = text.replace(s, redact_url("x://h" + s)[5:] if s[:1] in "?#" else _HIDDEN)
    return text


def safe_cause(e: BaseException, url: str) -> BaseException | None:
    """``e`` as the cause of an error about ``url`` (``raise ... from safe_cause(e, url)``), or None
    when the text of ``e`` or of its causes shows a secret part of ``url`` (see :func:`redact_url`):
    a traceback prints the whole chain (an ``InvalidURL`` quotes the query, aiohttp the URL)."""
    secrets = _secrets(url)
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen and secrets:
        seen.add(id(cur))
        text = f"{cur} {cur.args!r}"
        if any(s in text for s in secrets):
            return None
        cur = cur.__cause__ or cur.__context__
    return e
