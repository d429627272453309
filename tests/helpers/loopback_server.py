"""A real HTTP server on 127.0.0.1 for tests and benchmarks of remote shards (never another address).

Serves the files of one folder, with or without ``Range`` support, and a fault mode: a function
``(path, nth GET of path; 0 for HEAD) -> action`` where action is ``None`` (serve), an HTTP status
(500, 503, 404, ...), ``"drop"`` (send the headers and half the body, then close the
connection) or ``"corrupt"`` (serve the body with one byte flipped). Bounded: it refuses to serve after ``max_requests`` and shuts itself down after
``lifetime`` seconds, so a test that forgets it cannot leave it running.

Usable as a module (``LoopbackServer(root, ...)``, a context manager) or as a script::

    python3 tests/helpers/loopback_server.py ROOT --port-file FILE [--lifetime S]
"""
from __future__ import annotations

import argparse
import collections
import http.server
import os
import re
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["LoopbackServer"]

Fault = Callable[[str, int], "int | str | None"]
_RANGE = re.compile(r"bytes=(\d*)-(\d*)$")


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def _begin(self, head: bool = False) -> tuple[Path, int] | None:
        srv = self.server
        path = urllib.parse.unquote(self.path.split("?", 1)[0])  # as real servers do: "a%20b.tar" is "a b.tar"
        with srv.lock:
            srv.total += 1
            if head:
                srv.heads[path] += 1
                nth = 0
            else:
                srv.counts[path] += 1
                nth = srv.counts[path]
            over = srv.total > srv.max_requests
        if over:
            self.send_error(429, "loopback server: request budget exhausted")
            return None
        action = srv.fault(path, nth) if srv.fault is not None else None
        if isinstance(action, int):
            with srv.lock:
                srv.faults += 1
            self.send_error(action, f"injected fault {action}")
            return None
        file = (srv.root / path.lstrip("/")).resolve()
        if srv.root not in file.parents or not file.is_file():
            self.send_error(404, "not found")
            return None
        if action in ("drop", "corrupt") and not head:
            with srv.lock:
                srv.faults += 1
            return file, -1 if action == "drop" else 1
        return file, 0

    def do_HEAD(self) -> None:  # noqa: N802
        got = self._begin(head=True)
        if got is None:
            return
        file, _ = got
        self.send_response(200)
        self.send_header("Content-Length", str(file.stat().st_size))
        if self.server.ranges:
            self.send_header("Accept-Ranges", "bytes")
        self.end_headers()

    def do_GET(self) -> None:  # noqa: N802
        got = self._begin()
        if got is None:
            return
        file, mode = got
        size = file.stat().st_size
        start, stop = 0, size
        rng = self.headers.get("Range")
        status = 200
        if rng and self.server.ranges:
            m = _RANGE.match(rng.strip())
            if m is None:
                self.send_error(416, "bad range")
                return
            a, b = m.groups()
            if a == "":
                start, stop = max(0, size - int(b)), size
            else:
                start, stop = int(a), size if b == "" else min(size, int(b) + 1)
            if start >= size:
                self.send_error(416, "range not satisfiable")
                return
            status = 206
        self.send_response(status)
        self.send_header("Content-Length", str(stop - start))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{stop - 1}/{size}")
        if self.server.ranges:
            self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        limit = start + (stop - start) // 2 if mode == -1 else stop
        flip = start + (stop - start) // 3 if mode == 1 else -1
        if mode == 0 and not self.server.rate:  # plain serving: zero-copy sendfile, little server CPU
            with open(file, "rb") as f:
                try:
                    self.wfile.flush()
                    self.connection.sendfile(f, offset=start, count=stop - start)
                except (BrokenPipeError, ConnectionResetError):
                    pass
            return
        with open(file, "rb") as f:
            f.seek(start)
            left = limit - start
            while left > 0:
                at = f.tell()
                chunk = f.read(min(left, 1 << 20))
                if not chunk:
                    break
                if at <= flip < at + len(chunk):
                    b = bytearray(chunk)
                    b[flip - at] ^= 0xFF
                    chunk = bytes(b)
                try:
                    self.wfile.write(chunk)
                except (BrokenPipeError, ConnectionResetError):
                    return
                left -= len(chunk)
                if self.server.rate:
                    time.sleep(len(chunk) / self.server.rate)
        if mode == -1:
            self.close_connection = True
            self.wfile.flush()
            self.connection.shutdown(2)


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, root: Path, ranges: bool, fault: Fault | None, max_requests: int, rate: float | None):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.root = root.resolve()
        self.ranges = ranges
        self.fault = fault
        self.max_requests = max_requests
        self.rate = rate
        self.lock = threading.Lock()
        self.counts: collections.Counter[str] = collections.Counter()  # GET requests per path
        self.heads: collections.Counter[str] = collections.Counter()  # HEAD requests per path
        self.total = 0
        self.faults = 0
        self.handlers: dict[threading.Thread, socket.socket] = {}  # connections being served, by thread

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        with self.lock:
            self.handlers[threading.current_thread()] = request
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self.lock:
                self.handlers.pop(threading.current_thread(), None)


class LoopbackServer:
    """Serve ``root`` on ``http://127.0.0.1:<port>/`` in a thread (see the module docstring)."""

    def __init__(self, root: str | os.PathLike[str], *, ranges: bool = True, fault: Fault | None = None,
                 max_requests: int = 100_000, lifetime: float = 300.0, rate: float | None = None):
        self._srv = _Server(Path(root), ranges, fault, max_requests, rate)
        self.url = f"http://127.0.0.1:{self._srv.server_address[1]}"
        self._thread = threading.Thread(target=self._srv.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True, name="loopback-http")
        self._timer = threading.Timer(lifetime, self.close)
        self._timer.daemon = True
        self._closed = False

    def start(self) -> LoopbackServer:
        self._thread.start()
        self._timer.start()
        return self

    @property
    def counts(self) -> dict[str, int]:
        """GET requests per path so far (HEAD requests are not counted here; faults see them as nth=0)."""
        with self._srv.lock:
            return dict(self._srv.counts)

    @property
    def faults(self) -> int:
        with self._srv.lock:
            return self._srv.faults

    def set_fault(self, fault: Fault | None) -> None:
        self._srv.fault = fault

    def reset_counts(self) -> None:
        with self._srv.lock:
            self._srv.counts.clear()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._timer.cancel()
        self._srv.shutdown()
        self._srv.server_close()
        # as a real server going away: its open (keep-alive) connections are closed, so their handler
        # threads end now, not when the client happens to drop its pooled connection (a lingering
        # thread made every later pooled `convert` in the test process spawn instead of fork)
        with self._srv.lock:
            handlers = dict(self._srv.handlers)
        for conn in handlers.values():
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in handlers:
            thread.join(5)

    def __enter__(self) -> LoopbackServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root")
    ap.add_argument("--port-file", required=True, help="written with the base URL once serving")
    ap.add_argument("--lifetime", type=float, default=300.0)
    ap.add_argument("--no-ranges", action="store_true")
    args = ap.parse_args()
    srv = LoopbackServer(args.root, ranges=not args.no_ranges, lifetime=args.lifetime).start()
    tmp = args.port_file + ".tmp"
    with open(tmp, "w") as f:
        f.write(srv.url)
    os.replace(tmp, args.port_file)
    srv._thread.join()



def make_shard_set(dest: Path, n: int, per_shard: int, *, payload: int, seed: int) -> Path:
    """A tar shard set to serve: ``n`` samples (``k00000``...) of ``payload`` random bytes, ``per_shard`` per shard."""
    import numpy as np

    from fastdata.shards.writer import ShardWriter

    rng = np.random.default_rng(seed)
    with ShardWriter(dest, max_samples=per_shard) as w:
        for i in range(n):
            w.write({"__key__": f"k{i:05d}", "cls": str(i).encode(), "bin": rng.bytes(payload)})
    return dest

if __name__ == "__main__":
    main()
