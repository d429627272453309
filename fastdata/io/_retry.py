"""Retries of transient remote failures, and the one error every remote failure becomes.

Every failure becomes :class:`fastdata.errors.RemoteError` naming the (redacted) URL and keeping
the reason: the HTTP status and message (also when fsspec wraps it in a bare
``FileNotFoundError(url)``), or the exception type and text. Transient failures (connection drops,
truncated bodies, timeouts, HTTP 408/425/429/5xx) are retried with exponential backoff and full
jitter (:class:`RetryPolicy`); the error after the last attempt says how many were made.
Design note: ``docs/design/io.md``.
"""
from __future__ import annotations

import http.client
import os
import random
import time
import urllib.error
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from fastdata.errors import RemoteError
from fastdata.io._redact import redact, redact_url, safe_cause

__all__ = ["RetryPolicy", "env_retry", "is_transient", "remote_error", "with_retries"]

T = TypeVar("T")
_TRANSIENT_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})


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


def env_retry() -> RetryPolicy:
    """The default policy, overridable by ``FASTDATA_REMOTE_RETRIES`` (attempts)."""
    text = os.environ.get("FASTDATA_REMOTE_RETRIES")
    if not text:
        return RetryPolicy()
    try:
        return RetryPolicy(attempts=int(text))
    except ValueError as e:
        raise ValueError(f"FASTDATA_REMOTE_RETRIES must be an int >= 1, got {text!r}") from e
