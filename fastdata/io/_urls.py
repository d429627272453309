"""URL anatomy: what is a URL, the local path rule, folder URLs, joining, and a URL's identity.

Every function here is pure string work (no request is made). A signed URL (an Azure SAS token,
an S3 presigned query, a CDN token) keeps its query at the end of a folder URL and of every URL
joined to it; :func:`url_identity` drops the signing parameters, so a rotated token names the same
object. Design note: ``docs/design/io.md``.
"""
from __future__ import annotations

import os

__all__ = ["folder_url", "is_url", "local_path", "split_query", "url_identity", "url_join"]


def is_url(path: str) -> bool:
    """True for ``scheme://...`` other than ``file://`` (a local path, see :func:`local_path`)."""
    return "://" in path and not path.startswith("file://")


def local_path(text: str) -> str:
    """The one rule for local path arguments: a leading ``file://`` stripped (``file:///data/ds`` is
    ``/data/ds``) and a leading ``~`` expanded to the home folder, as a shell and ``Cache`` do
    (``ShardWriter("~/out")``, ``ShardedDataset("~/shards")``, ``fastdata shard``, ``verify``)."""
    return os.path.expanduser(text[len("file://"):] if text.startswith("file://") else text)


def split_query(url: str) -> tuple[str, str]:
    """(``url`` without its query and fragment, ``"?query#fragment"``) for ``http(s)://`` URLs (a
    signed folder URL, e.g. an Azure SAS token or a CDN token, carries them); other URLs: (url, "")."""
    if url.split("://", 1)[0].lower() not in ("http", "https"):
        return url, ""
    cut = min((k for k in (url.find("?"), url.find("#")) if k >= 0), default=len(url))
    return url[:cut], url[cut:]


def folder_url(url: str) -> str:
    """The folder URL of a folder URL or of its ``manifest.json`` URL, a signed URL's query kept at the
    end (``https://h/ds/manifest.json?sig=x`` is ``https://h/ds?sig=x``)."""
    path, query = split_query(url)
    path = path.rstrip("/")
    if path.endswith("/manifest.json"):
        path = path[: -len("/manifest.json")]
    return path + query


def url_join(base: str, name: str) -> str:
    """``base/name`` for a folder URL (``base`` may end with ``/``; the query of an ``http(s)``
    folder URL goes to the end: ``https://h/ds?sig=x`` + ``a.tar`` is ``https://h/ds/a.tar?sig=x``;
    ``name``, a file name, is percent-encoded there: ``part 1.tar`` is ``part%201.tar``)."""
    path, query = split_query(base)
    if base.split("://", 1)[0].lower() in ("http", "https"):
        import urllib.parse

        name = urllib.parse.quote(name, safe="/")
    return path.rstrip("/") + "/" + name + query


# Query parameters of signed-URL schemes: they authorize a request, they do not choose the content
# (Azure SAS; S3, GCS, OSS, OBS and COS presigned URLs, also their V2 forms; CloudFront; Google Cloud CDN;
# Akamai; generic tokens)
_SIGNING_PARAMS = frozenset({
    "sv", "ss", "srt", "sp", "se", "st", "spr", "sig", "si", "sr", "sdd", "ses", "skoid", "sktid", "skt", "ske",
    "sks", "skv", "saoid", "suoid", "scid", "rscc", "rscd", "rsce", "rscl", "rsct",
    "awsaccesskeyid", "googleaccessid", "ossaccesskeyid", "accesskeyid", "security-token", "signature", "expires",
    "policy", "key-pair-id", "keyname", "urlprefix", "q-sign-algorithm", "q-ak", "q-sign-time", "q-key-time",
    "q-header-list", "q-url-param-list", "q-signature",
    "hdnts", "hdnea", "__token__", "token", "access_token", "auth", "sas", "exp",
})
_SIGNING_PREFIXES = ("x-amz-", "x-goog-", "x-oss-", "x-obs-", "x-cos-")


def url_identity(url: str) -> str:
    """What names the object at ``url`` whatever its credentials: ``url`` without a password and
    without the query parameters of signed-URL schemes (Azure SAS, S3/GCS presigned, CloudFront,
    Akamai, ``token=``...), which change when a token is rotated; other parameters (an object
    version, a file chosen by the query) are kept. Other URLs and local paths are returned as is."""
    if not isinstance(url, str) or "://" not in url:
        return url
    scheme, rest = url.split("://", 1)
    cut = min((k for k in (rest.find("?"), rest.find("#")) if k >= 0), default=len(rest))
    head, tail = rest[:cut], rest[cut:]
    netloc, slash, path = head.partition("/")
    if "@" in netloc:
        netloc = netloc.rsplit("@", 1)[1]
    query = tail.partition("#")[0][1:]
    kept = [item for item in query.split("&") if item and not _signing(item.partition("=")[0])]
    return f"{scheme}://{netloc}{slash}{path}" + ("?" + "&".join(kept) if kept else "")


def _signing(name: str) -> bool:
    import urllib.parse

    name = urllib.parse.unquote_plus(name).lower()
    return name in _SIGNING_PARAMS or name.startswith(_SIGNING_PREFIXES)

