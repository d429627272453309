"""Remote files through fsspec: sequential reads, downloads and small reads with retries.

* Every failure becomes :class:`fastdata.errors.RemoteError` naming the URL and keeping the
  reason: the HTTP status and message (also when fsspec wraps it in a bare
  ``FileNotFoundError(url)``), or the exception type and text.
* Transient failures (connection drops, truncated bodies, timeouts, HTTP 408/425/429/5xx) are
  retried with exponential backoff and full jitter (:class:`RetryPolicy`); the error after the
  last attempt says how many were made.
* :class:`RemoteStream` reads a file sequentially with one GET per attempt (no ``Range``
  requests over HTTP), so servers without Range support work for files of any size; after a
  drop it reopens and skips what it had already delivered (seeks where the file allows it).
* Messages, warnings and logs show URLs through :func:`redact_url`: a signed URL's tokens (its
  query values) and passwords never appear, its path (the shard name) does.
"""
from __future__ import annotations

import http.client
import io
import os
import urllib.error
import urllib.request
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastdata._util import is_url
from fastdata.errors import RemoteError

__all__ = [
    "RemoteStream", "RetryPolicy", "env_retry", "filesystem", "is_transient", "is_url", "read_bytes", "redact",
    "redact_url", "remote_error", "download", "remote_size", "safe_cause", "upload", "url_identity", "url_join",
    "with_retries",
]

T = TypeVar("T")
_TRANSIENT_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})
_CHUNK = 4 << 20
_TIMEOUT_S = 60.0  # per socket operation (connect, each read) of the standard-library HTTP client


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


def url_join(base: str, name: str) -> str:
    """``base/name`` for a folder URL (``base`` may end with ``/``; the query of an ``http(s)``
    folder URL goes to the end: ``https://h/ds?sig=x`` + ``a.tar`` is ``https://h/ds/a.tar?sig=x``;
    ``name``, a file name, is percent-encoded there: ``part 1.tar`` is ``part%201.tar``)."""
    path, query = split_query(base)
    if base.split("://", 1)[0].lower() in ("http", "https"):
        import urllib.parse

        name = urllib.parse.quote(name, safe="/")
    return path.rstrip("/") + "/" + name + query


@dataclass(frozen=True)
class RetryPolicy:
    """Retries of transient remote failures: ``attempts`` in all, sleeping
    ``uniform(0, min(max_delay, base_delay * 2**k))`` before attempt ``k + 1`` (full jitter)."""

    attempts: int = 5
    base_delay: float = 0.25
    max_delay: float = 8.0

    def __post_init__(self) -> None:
        if isinstance(self.attempts, bool) or not isinstance(self.attempts, int) or self.attempts < 1:
            raise ValueError(f"RetryPolicy.attempts must be an int >= 1, got {self.attempts!r}")
        for name in ("base_delay", "max_delay"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v >= 0:
                raise ValueError(f"RetryPolicy.{name} must be a number >= 0, got {v!r}")

    def delay(self, attempt: int) -> float:
        """Seconds to sleep after failed attempt number ``attempt`` (1-based)."""
        return random.uniform(0.0, min(self.max_delay, self.base_delay * (2 ** (attempt - 1))))


def _status(e: BaseException) -> tuple[int | None, str | None]:
    """(HTTP status, server message) found anywhere in the cause chain of ``e``."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        status = getattr(cur, "status", None)
        if isinstance(status, int) and not isinstance(status, bool) and 100 <= status < 600:
            text = getattr(cur, "message", None) or getattr(cur, "reason", None)  # aiohttp / urllib
            return status, (str(text) if isinstance(text, str) and text else None)
        resp = getattr(cur, "response", None)  # botocore ClientError
        if isinstance(resp, dict):
            meta = resp.get("ResponseMetadata", {}) or {}
            err = resp.get("Error", {}) or {}
            code = meta.get("HTTPStatusCode")
            if isinstance(code, int):
                return code, " ".join(str(x) for x in (err.get("Code"), err.get("Message")) if x) or None
        cur = cur.__cause__ or cur.__context__
    return None, None


def _reason(e: BaseException) -> str:
    status, message = _status(e)
    if status is not None:
        return f"HTTP {status}" + (f" {message}" if message else "")
    if isinstance(e, FileNotFoundError):  # fsspec raises a bare FileNotFoundError(url) for HTTP 404 / no object
        return "not found (HTTP 404 or no such object)"
    text = str(e)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def is_transient(e: BaseException) -> bool:
    """Whether retrying may help: connection trouble, truncation, timeouts, HTTP 408/425/429/5xx."""
    if isinstance(e, RemoteError):
        return bool(getattr(e, "transient", False))
    status, _ = _status(e)
    if status is not None:
        return status in _TRANSIENT_STATUS
    if isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
        return False
    name = type(e).__name__
    if isinstance(e, (ConnectionError, TimeoutError, EOFError, http.client.IncompleteRead)) or "Timeout" in name:
        return True
    import ssl

    if isinstance(e, ssl.SSLError) and not isinstance(e, ssl.SSLCertVerificationError):
        return True  # a TLS record cut or garbled while a body is read (at connect, it comes as a URLError)
    if isinstance(e, urllib.error.URLError) and isinstance(e.reason, (ConnectionError, TimeoutError, OSError)):
        # a certificate that does not verify will not verify on the next attempt either
        return not isinstance(e.reason, (FileNotFoundError, PermissionError, ssl.SSLCertVerificationError))
    try:
        import aiohttp

        if isinstance(e, (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, aiohttp.ServerTimeoutError)):
            return True
    except ImportError:  # pragma: no cover - depends on the environment
        pass
    return False


def remote_error(url: str, e: BaseException, what: str = "reading", *, attempts: int | None = None,
                 at: int | None = None) -> RemoteError:
    """A RemoteError for failure ``e`` of ``what`` on ``url`` (status and message kept)."""
    if isinstance(e, RemoteError):
        return e
    status, _ = _status(e)
    where = f" at byte {at}" if at else ""
    tries = f" after {attempts} attempts" if attempts and attempts > 1 else ""
    err = RemoteError(f"{what} {redact_url(url)} failed{where}{tries}: {redact(_reason(e), url)}")
    err.url, err.status, err.transient = redact_url(url), status, is_transient(e)  # type: ignore[attr-defined]
    return err


def with_retries(fn: Callable[[], T], url: str, policy: RetryPolicy, what: str = "reading") -> T:
    """``fn()``, retried on transient failures per ``policy``; RemoteError after the last attempt."""
    for attempt in range(1, policy.attempts + 1):
        try:
            return fn()
        except RemoteError:
            raise
        except Exception as e:  # noqa: BLE001 - classified and re-raised as RemoteError below
            if not is_transient(e) or attempt == policy.attempts:
                raise remote_error(url, e, what, attempts=attempt) from safe_cause(e, url)
            time.sleep(policy.delay(attempt))
    raise AssertionError("unreachable")  # pragma: no cover


def filesystem(url: str) -> tuple[Any, str]:
    """(fsspec filesystem, path) for ``url``; an ImportError names the extra to install."""
    scheme = url.split("://", 1)[0].lower()
    try:
        import fsspec.core
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(f"reading {redact_url(url)} needs fsspec: pip install 'fastdata[remote]'") from e
    try:
        return fsspec.core.url_to_fs(url)
    except ImportError as e:
        extra = {"http": "http", "https": "http", "s3": "s3", "gs": "gcs", "gcs": "gcs"}.get(scheme, "remote")
        raise ImportError(f"reading {redact_url(url)} needs a package fsspec could not import ({e}); "
                          f"pip install 'fastdata[{extra}]'") from e


def _stdlib_http(url: str) -> bool:
    """Plain ``http(s)://`` goes through the standard library's client (about twice the single-stream
    throughput of fsspec's aiohttp path measured on loopback) unless fsspec is configured for HTTP (headers,
    auth: ``fsspec.config.conf["http"]``) or ``FASTDATA_HTTP_CLIENT=fsspec`` asks for fsspec."""
    if url.split("://", 1)[0].lower() not in ("http", "https"):
        return False
    if os.environ.get("FASTDATA_HTTP_CLIENT", "").lower() == "fsspec":
        return False
    try:
        import fsspec.config
    except ImportError:
        return True
    return not (fsspec.config.conf.get("http") or fsspec.config.conf.get("https"))


def _basic_auth(url: str) -> tuple[str, str | None]:
    """(``url`` without its user info, the ``Authorization`` header it asks for or None): the standard
    library's client would take ``user:password@host`` for a host name (fsspec's sends basic auth)."""
    import base64
    import urllib.parse

    scheme, rest = url.split("://", 1)
    netloc, slash, path = rest.partition("/")
    if "@" not in netloc:
        return url, None
    userinfo, host = netloc.rsplit("@", 1)
    user, _, password = userinfo.partition(":")
    token = f"{urllib.parse.unquote(user)}:{urllib.parse.unquote(password)}".encode()
    return f"{scheme}://{host}{slash}{path}", "Basic " + base64.b64encode(token).decode("ascii")


def _open_raw(url: str, size: int | None) -> Any:
    if _stdlib_http(url):  # one GET, no Range; HTTPError (status, reason) and URLError are classified
        url, auth = _basic_auth(url)
        request = urllib.request.Request(url, headers={"Accept-Encoding": "identity", "User-Agent": "fastdata"})
        if auth:
            request.add_unredirected_header("Authorization", auth)  # not sent on to where a redirect points
        return urllib.request.urlopen(request, timeout=_TIMEOUT_S)  # noqa: S310 - URLs the user gave
    fs, path = filesystem(url)
    kwargs: dict[str, Any] = {}
    if url.split("://", 1)[0].lower() in ("http", "https"):
        kwargs["block_size"] = 0  # one streaming GET, no Range requests
        if size is not None:
            kwargs["size"] = size  # no HEAD request first
    else:
        kwargs["block_size"] = _CHUNK
        kwargs["cache_type"] = "readahead"
    return fs.open(path, "rb", **kwargs)


class RemoteStream(io.RawIOBase):
    """A remote file read front to back, reopened transparently after transient failures.

    ``size`` (bytes, when known from a manifest) spares a metadata request and lets a short
    body be detected as truncation.
    """

    def __init__(self, url: str, *, size: int | None = None, retry: RetryPolicy | None = None,
                 what: str = "reading"):
        super().__init__()
        self.url, self.size, self.what = url, size, what
        self.retry = retry or RetryPolicy()
        self._f: Any = None
        self._pos = 0
        self._failures = 0  # consecutive failed attempts

    def readable(self) -> bool:
        return True

    def _reopen(self) -> None:
        self._close_inner()
        f = _open_raw(self.url, self.size)
        try:
            if self._pos:
                try:
                    seeked = bool(f.seekable()) and f.seek(self._pos) == self._pos
                except (ValueError, OSError, NotImplementedError):  # fsspec's HTTP stream says seekable, is not
                    seeked = False
                if not seeked:  # no Range support: read and discard what was delivered already
                    left = self._pos
                    while left > 0:
                        got = f.read(min(left, _CHUNK))
                        if not got:
                            raise EOFError(f"body ended at byte {self._pos - left} while skipping to {self._pos}")
                        left -= len(got)
        except BaseException:
            f.close()
            raise
        self._f = f

    def _close_inner(self) -> None:
        f, self._f = self._f, None
        if f is not None:
            try:
                f.close()
            except Exception:  # noqa: BLE001 - a broken connection may fail to close; it is dropped
                pass

    def read(self, n: int | None = -1) -> bytes:
        if self.closed:
            raise ValueError(f"read of closed RemoteStream {redact_url(self.url)}")
        if n is None or n < 0:  # to the end, in chunks (each one retried on its own)
            parts = []
            while chunk := self.read(_CHUNK):
                parts.append(chunk)
            return b"".join(parts)
        while True:
            try:
                if self._f is None:
                    self._reopen()
                data = self._f.read(n)
                if not data and n != 0:
                    left = getattr(self._f, "length", None)  # http.client: Content-Length not yet received
                    if isinstance(left, int) and left > 0:
                        raise http.client.IncompleteRead(b"", left)
                    if self.size is not None and self._pos < self.size:
                        raise EOFError(f"body ended at byte {self._pos} of {self.size}")
                self._pos += len(data)
                self._failures = 0
                return data
            except Exception as e:  # noqa: BLE001 - classified below
                self._close_inner()
                self._failures += 1
                if not is_transient(e) or self._failures >= self.retry.attempts:
                    raise remote_error(self.url, e, self.what, attempts=self._failures,
                                       at=self._pos) from safe_cause(e, self.url)
                time.sleep(self.retry.delay(self._failures))

    def readinto(self, b: Any) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)

    def tell(self) -> int:
        return self._pos

    def close(self) -> None:
        self._close_inner()
        super().close()


def upload(local: str | os.PathLike[str], url: str, *, retry: RetryPolicy | None = None) -> None:
    """Copy local file ``local`` to ``url`` (whole-object put), with retries; RemoteError on failure."""
    scheme = url.split("://", 1)[0].lower()
    if scheme in ("http", "https"):
        raise RemoteError(f"writing {redact_url(url)}: HTTP(S) URLs are read-only here; write to s3://, gs://, another "
                          "fsspec filesystem, or a local folder served over HTTP")
    fs, path = filesystem(url)
    with_retries(lambda: fs.put_file(os.fspath(local), path), url, retry or RetryPolicy(), "uploading to")


def remove(url: str, *, retry: RetryPolicy | None = None) -> None:
    """Delete the object at ``url`` (none there: nothing to do), with retries; RemoteError on failure."""
    fs, path = filesystem(url)

    def rm() -> None:
        try:
            fs.rm_file(path)
        except FileNotFoundError:
            pass

    with_retries(rm, url, retry or RetryPolicy(), "deleting")


def remote_size(url: str) -> int | None:
    """Byte size of the object at ``url``, or None when there is none (other failures raise RemoteError)."""
    fs, path = filesystem(url)
    try:
        info = fs.info(path)
    except FileNotFoundError:
        return None
    except Exception as e:  # noqa: BLE001 - classified below
        raise remote_error(url, e, "checking") from safe_cause(e, url)
    size = info.get("size")
    return int(size) if size is not None else None


def download(url: str, dest: str | os.PathLike[str], *, size: int | None = None, sha256: str | None = None,
             retry: RetryPolicy | None = None) -> None:
    """Copy ``url`` to local file ``dest`` (atomically: a unique temporary name, then a rename).

    With ``size``/``sha256`` (from a manifest) the copy is checked before the rename; a mismatch is
    a RemoteError with both values, and nothing is left at ``dest``.
    """
    import hashlib
    import uuid

    dest = os.fspath(dest)
    tmp = f"{dest}.{os.getpid()}.{uuid.uuid4().hex}.part"
    digest = hashlib.sha256()
    got = 0
    try:
        try:
            with RemoteStream(url, size=size, retry=retry, what="downloading") as src, open(tmp, "wb") as out:
                while chunk := src.read(_CHUNK):
                    digest.update(chunk)
                    out.write(chunk)
                    got += len(chunk)
        except OSError as e:
            if isinstance(e, RemoteError):  # the network's failures are RemoteErrors already
                raise
            # disk full, no permission
            raise RemoteError(f"downloading {redact_url(url)}: cannot write {dest}: {e}") from e
        if size is not None and got != size:
            raise RemoteError(f"downloading {redact_url(url)}: {got} bytes, the manifest says {size}")
        if sha256 is not None and digest.hexdigest() != sha256:
            raise RemoteError(f"downloading {redact_url(url)}: sha256 {digest.hexdigest()}, the manifest says {sha256}")
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def read_bytes(url: str, *, retry: RetryPolicy | None = None, what: str = "reading") -> bytes:
    """The whole content of a (small) remote file, with retries."""
    with RemoteStream(url, retry=retry, what=what) as s:
        return s.read()


def env_retry() -> RetryPolicy:
    """The default policy, overridable by ``FASTDATA_REMOTE_RETRIES`` (attempts)."""
    text = os.environ.get("FASTDATA_REMOTE_RETRIES")
    if not text:
        return RetryPolicy()
    try:
        return RetryPolicy(attempts=int(text))
    except ValueError as e:
        raise ValueError(f"FASTDATA_REMOTE_RETRIES must be an int >= 1, got {text!r}") from e
