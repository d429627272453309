"""Remote files through fsspec (and the standard library's HTTP client): streams, downloads, uploads.

:class:`RemoteStream` reads a file front to back with one GET per attempt (no ``Range`` requests
over HTTP), so servers without Range support work for files of any size; after a transient drop it
reopens and skips what it had already delivered (seeking where the file allows it). Plain
``http(s)://`` goes through the standard library's client unless fsspec is configured for HTTP or
``FASTDATA_HTTP_CLIENT=fsspec``. :func:`download` is atomic (a unique temporary name, then a
rename) and checks size and sha256 when given. Every failure is a RemoteError (:mod:`._retry`).
Design note: ``docs/design/io.md``.
"""
from __future__ import annotations

import http.client
import io
import os
import time
import urllib.request
from typing import Any

from fastdata.errors import RemoteError
from fastdata.io._redact import redact_url, safe_cause
from fastdata.io._retry import RetryPolicy, is_transient, remote_error, with_retries

__all__ = ["RemoteStream", "download", "filesystem", "read_bytes", "remote_size", "remove", "upload"]

_CHUNK = 4 << 20
_TIMEOUT_S = 60.0  # per socket operation (connect, each read) of the standard-library HTTP client


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
    """Plain ``http(s)://`` goes through the standard library's client (faster than fsspec's aiohttp path
    for one stream: ``docs/design/io.md``) unless fsspec is configured for HTTP (headers, auth:
    ``fsspec.config.conf["http"]``) or ``FASTDATA_HTTP_CLIENT=fsspec`` asks for fsspec."""
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

