"""The stall watchdog: a consumer waiting ``stall_warning`` seconds for a batch gets one WARNING on the
``fastdata.loader`` logger with the workers' pids and every worker thread's Python stack, repeated
only while the stall lasts, and a last one when the batch arrives; nothing is raised or stopped."""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import re
import signal
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from fastdata.dataset import ShardedDataset
from fastdata.loader import DataLoader, _watchdog
from fastdata.shards.writer import ShardWriter
from tests.helpers.shards import make_shards


pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


HOLD_S = 20.0  # the longest a stalled sample waits for its release (the test fails before)
STALL = "no batch for"  # in every stall warning
# forkserver pickles like spawn (checked by hand: same warning); left out to keep the file fast
METHODS = [m for m in ("fork", "spawn") if m in mp.get_all_start_methods()]
# a spawned worker imports torch afresh (4 s here, 9 s beside two CPU hogs): marked slow, as in test_start_methods
PARAMS = [pytest.param(m, marks=[pytest.mark.slow] if m != "fork" else []) for m in METHODS]


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    return make_shards(tmp_path_factory.mktemp("stall") / "ds", 16, 8, key="s{i:03d}")


def _stall_here(folder: str, hold: float) -> None:
    """Blocks (in a worker process or thread) until ``folder/release`` exists or ``hold`` s passed."""
    tmp = Path(folder, f"stalled.{os.getpid()}.tmp")
    tmp.write_text(str(os.getpid()))
    tmp.replace(Path(folder, "stalled.pid"))
    deadline = time.monotonic() + hold
    while not Path(folder, "release").exists() and time.monotonic() < deadline:
        time.sleep(0.02)


class StallAt:
    """``decode=`` for the ``cls`` field: sample ``at`` stalls in ``_stall_here``. Picklable (spawn)."""

    def __init__(self, folder: Path, at: int, hold: float = HOLD_S):
        self.folder, self.at, self.hold = str(folder), at, hold

    def __call__(self, data: bytes) -> int:
        i = int(bytes(data))
        if i == self.at:
            _stall_here(self.folder, self.hold)
        return i


class _Release(logging.Handler):
    def __init__(self, folder: Path, needle: str):
        super().__init__()
        self.folder, self.needle = folder, needle

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if STALL in msg and self.needle in msg:
            (self.folder / "release").touch()


@contextmanager
def release_on_warning(folder: Path, needle: str = "_stall_here") -> Iterator[None]:
    """Release the stalled sample once a stall warning containing ``needle`` was logged."""
    handler = _Release(folder, needle)
    logger = logging.getLogger("fastdata.loader")
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        (folder / "release").touch()  # never leave a worker blocked


def stall_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "fastdata.loader" and r.levelno == logging.WARNING and STALL in r.getMessage()]


def recoveries(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "fastdata.loader" and "stall over:" in r.getMessage()]


def labels(loader) -> list[int]:
    return sorted(int(x) for b in loader for x in b["cls"])


def dumps(message: str) -> dict[str, str]:
    """The sections of a warning by their header: ``"pid 123"`` for a worker process's dump,
    the thread name (``"'fastdata-decode-0'"``) for a thread of this process."""
    out: dict[str, str] = {}
    for part in message.split("\n--- ")[1:]:
        head, _, body = part.partition("\n")
        key = re.search(r"\(pid (\d+)\)", head) if head.startswith("worker process") else re.search(r"thread ('[^']*')", head)
        if key is not None:
            out[f"pid {key.group(1)}" if head.startswith("worker process") else key.group(1)] = head + "\n" + body
    return out


@pytest.mark.parametrize("method", PARAMS)
def test_a_stalled_worker_is_reported_with_its_stack_and_pid(shards: Path, tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture, method: str):
    ds = ShardedDataset(shards, shuffle=False, decode={"cls": StallAt(tmp_path, 5)})
    workers = 2 if method == "fork" else 1  # a spawned worker imports torch: one is enough
    loader = DataLoader(ds, batch_size=2, num_workers=workers, multiprocessing_context=method, stall_warning=0.3)
    with release_on_warning(tmp_path):
        assert labels(loader) == list(range(16))  # nothing lost: the warning neither raises nor stops
    pid = int((tmp_path / "stalled.pid").read_text())
    hits = [m for m in stall_warnings(caplog) if "_stall_here" in m]
    assert hits, stall_warnings(caplog)
    msg = hits[0]
    assert re.search(rf"#\d pid {pid} alive", msg), msg  # the worker list: pid and state
    worker = dumps(msg)[f"pid {pid}"]  # the stalled worker's own dump: every thread of it
    assert "_stall_here" in worker and "most recent call first" in worker, worker
    assert "stall_warning=None turns this warning off" in msg
    assert any("the batch arrived" in r for r in recoveries(caplog)), recoveries(caplog)


_HELD = threading.Lock()  # held by a thread of the test process while it forks the worker


def _deadlock_here(folder: str) -> None:
    Path(folder, "stalled.pid").write_text(str(os.getpid()))
    with _HELD:  # in the forked worker this lock stays held forever: its holder thread was not forked
        pass


class DeadlockAt:
    def __init__(self, folder: Path, at: int):
        self.folder, self.at = str(folder), at

    def __call__(self, data: bytes) -> int:
        i = int(bytes(data))
        if i == self.at:
            _deadlock_here(self.folder)
        return i


class _Kill(logging.Handler):
    def __init__(self, folder: Path):
        super().__init__()
        self.folder = folder

    def emit(self, record: logging.LogRecord) -> None:
        if STALL in record.getMessage() and "_deadlock_here" in record.getMessage():
            os.kill(int((self.folder / "stalled.pid").read_text()), signal.SIGKILL)


@pytest.mark.skipif("fork" not in METHODS or not _watchdog.CAN_DUMP, reason="needs fork and faulthandler.register")
def test_a_worker_deadlocked_on_a_lock_inherited_through_fork_shows_where(shards: Path, tmp_path: Path,
                                                                           caplog: pytest.LogCaptureFixture):
    """The case this exists for: forked while another thread held a lock, the worker blocks forever
    (GIL released, no Python running in it); its stack still comes out, and the loop can kill it."""
    ds = ShardedDataset(shards, shuffle=False, decode={"cls": DeadlockAt(tmp_path, 0)})
    loader = DataLoader(ds, batch_size=2, num_workers=1, multiprocessing_context="fork", stall_warning=0.3)
    held, forked = threading.Event(), threading.Event()

    def hold() -> None:
        with _HELD:
            held.set()
            forked.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait(30)
    try:
        it = iter(loader)  # forks the worker while the lock is held
    finally:
        forked.set()
        holder.join()
    handler = _Kill(tmp_path)
    logging.getLogger("fastdata.loader").addHandler(handler)
    try:
        with pytest.raises(RuntimeError, match="DataLoader worker"):  # torch: the worker died
            next(it)
    finally:
        logging.getLogger("fastdata.loader").removeHandler(handler)
    del it
    pid = int((tmp_path / "stalled.pid").read_text())
    msg = next(m for m in stall_warnings(caplog) if "_deadlock_here" in m)
    assert "_deadlock_here" in dumps(msg)[f"pid {pid}"]
    assert any("next() raised RuntimeError" in r for r in recoveries(caplog)), recoveries(caplog)


def test_the_thread_decoder_reports_its_pool_threads_stacks(shards: Path, tmp_path: Path,
                                                            caplog: pytest.LogCaptureFixture):
    ds = ShardedDataset(shards, shuffle=False, decode={"cls": StallAt(tmp_path, 5)})
    # torch's timeout= above stall_warning: the warning fires first, nothing raises
    loader = DataLoader(ds, batch_size=2, num_workers=2, decode_threads=1, stall_warning=0.3, timeout=60)
    with release_on_warning(tmp_path):
        assert labels(loader) == list(range(16))
    assert loader.last_path == "threads"
    msg = next(m for m in stall_warnings(caplog) if "_stall_here" in m)
    pool = dumps(msg)["'fastdata-decode-0'"]
    assert "_stall_here" in pool and "_load_chunk" in pool, pool
    assert "(waiting for the batch)" in msg  # the consumer's own stack is there too
    assert any("the batch arrived" in r for r in recoveries(caplog))


def test_in_process_loading_reports_the_waiting_thread(shards: Path, tmp_path: Path,
                                                       caplog: pytest.LogCaptureFixture):
    """num_workers=0 (and the cached fast path alike): the batch is made in the thread that waits."""
    ds = ShardedDataset(shards, shuffle=False, decode={"cls": StallAt(tmp_path, 3)})
    loader = DataLoader(ds, batch_size=4, num_workers=0, stall_warning=0.3)
    with release_on_warning(tmp_path):
        assert labels(loader) == list(range(16))
    msg = next(m for m in stall_warnings(caplog) if "_stall_here" in m)
    assert "batch #1 of epoch 0" in msg
    mine = dumps(msg)[repr(threading.current_thread().name)]
    assert "(waiting for the batch)" in mine and "_stall_here" in mine


def test_the_cached_fast_path_reports_the_waiting_thread(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    """The cached path gathers in the consumer's thread (and loads a sample's uncached fields there)."""
    import numpy as np

    from fastdata.cli._synth import jpeg_bytes, synth_image
    from fastdata.transforms import ResizeCenterCrop

    with ShardWriter(tmp_path / "ds", max_samples=8) as w:
        for i in range(16):
            img = synth_image(np.random.default_rng(i), 12, 12)
            w.write({"__key__": f"s{i:03d}", "jpg": jpeg_bytes(img, 90), "cls": str(i).encode()})
    kw: dict = {"shuffle": False, "preprocess": ResizeCenterCrop(8), "cache": tmp_path / "cache"}
    ShardedDataset(tmp_path / "ds", **kw).build_cache()
    ds = ShardedDataset(tmp_path / "ds", decode={"cls": StallAt(tmp_path, 5)}, **kw)
    loader = DataLoader(ds, batch_size=4, num_workers=2, stall_warning=0.3)
    with release_on_warning(tmp_path):
        assert labels(loader) == list(range(16))
    assert loader.last_path == "cached"
    msg = next(m for m in stall_warnings(caplog) if "_stall_here" in m)
    mine = dumps(msg)[repr(threading.current_thread().name)]
    assert "_stall_here" in mine and "cached_batches" in mine, mine
    assert any("the batch arrived" in r for r in recoveries(caplog))


def test_the_warning_repeats_at_doubling_intervals_then_recovery(shards: Path, tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture):
    ds = ShardedDataset(shards, shuffle=False, decode={"cls": StallAt(tmp_path, 0, hold=1.2)})
    loader = DataLoader(ds, batch_size=4, num_workers=0, stall_warning=0.2)
    assert labels(loader) == list(range(16))
    waited = [float(re.search(r"no batch for ([\d.]+) s", m).group(1)) for m in stall_warnings(caplog)]
    # at 0.2, 0.4, 0.8 s (later under load, never sooner): not one per second or per poll
    assert 2 <= len(waited) <= 3, waited
    assert all(w >= 0.2 * 2**k - 0.05 for k, w in enumerate(waited)), waited  # printed to 0.1 s
    (rec,) = recoveries(caplog)
    assert "batch #1 of epoch 0" in rec and "the batch arrived" in rec
    assert float(re.search(r"ended after ([\d.]+) s", rec).group(1)) >= 1.15


def test_no_warning_while_the_consumer_itself_is_slow(shards: Path, caplog: pytest.LogCaptureFixture):
    """Only time spent waiting inside next() counts: a slow training step between batches is no stall."""
    loader = DataLoader(ShardedDataset(shards, shuffle=False), batch_size=2, num_workers=2,
                        multiprocessing_context="fork", stall_warning=1.0)
    it = iter(loader)
    next(it)  # the workers' start may be slow under load: this first wait is not the point
    time.sleep(1.3)  # the consumer is busy longer than stall_warning; the workers fill their queue
    assert sum(len(b["cls"]) for b in it) == 14
    assert [m for m in stall_warnings(caplog) if "batch #1 " not in m] == []
    assert not recoveries(caplog) or all("batch #1 " in r for r in recoveries(caplog))


@pytest.mark.parametrize("off", [None, 0])
def test_none_or_zero_turns_it_off(shards: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, off):
    ds = ShardedDataset(shards, shuffle=False, decode={"cls": StallAt(tmp_path, 0, hold=0.2)})
    loader = DataLoader(ds, batch_size=4, num_workers=0, stall_warning=off)
    before = set(threading.enumerate())
    it = iter(loader)
    assert it._watch is None
    assert sum(len(b["cls"]) for b in it) == 16
    assert stall_warnings(caplog) == [] and recoveries(caplog) == []
    assert not [t for t in threading.enumerate() if t.name == _watchdog.THREAD_NAME and t not in before]


def test_timeout_still_raises_and_a_warning_at_or_above_it_is_off(shards: Path, tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture):
    ds = ShardedDataset(shards, shuffle=False, decode={"cls": StallAt(tmp_path, 0)})
    loader = DataLoader(ds, batch_size=2, num_workers=1, multiprocessing_context="fork", timeout=0.5,
                        stall_warning=0.5)
    it = iter(loader)
    assert it._watch is None  # torch's timeout raises first: no warning to give
    try:
        with pytest.raises(RuntimeError, match="timed out"):
            next(it)
    finally:
        (tmp_path / "release").touch()
    del it
    assert stall_warnings(caplog) == []


def _watchdog_thread(it) -> threading.Thread:
    t = it._watch.thread
    assert t is not None and t.is_alive() and t.name == _watchdog.THREAD_NAME and t.daemon
    return t


def test_the_watchdog_thread_ends_with_its_iterator(shards: Path):
    loader = DataLoader(ShardedDataset(shards, shuffle=False), batch_size=4, num_workers=2,
                        multiprocessing_context="fork", stall_warning=30)
    it = iter(loader)
    assert it._watch.thread is None  # started lazily, at the first next()
    next(it)
    t = _watchdog_thread(it)
    for _ in it:
        pass
    assert not t.is_alive()  # exhausted: joined
    it = iter(loader)
    next(it)
    t = _watchdog_thread(it)
    it.close()
    assert not t.is_alive()  # closed: joined
    it = iter(loader)
    next(it)
    t = _watchdog_thread(it)
    inner = weakref.ref(it._inner)
    del it  # dropped mid-epoch: the watchdog keeps neither iterator alive and ends
    assert inner() is None
    t.join(5)
    assert not t.is_alive()


def test_the_users_worker_init_fn_runs_and_stays_in_place(shards: Path, tmp_path: Path):
    ds = ShardedDataset(shards, shuffle=False)
    user_init = _TouchInit(tmp_path)
    before = signal.getsignal(signal.SIGUSR2) if hasattr(signal, "SIGUSR2") else None
    loader = DataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context="fork", worker_init_fn=user_init,
                        persistent_workers=True)
    for _ in range(2):  # persistent workers: started once, with the user's function and the handler
        assert sum(len(b["cls"]) for b in loader) == 16
    assert loader.worker_init_fn is user_init
    assert sorted(p.name for p in tmp_path.iterdir()) == ["init-0", "init-1"]
    if hasattr(signal, "SIGUSR2"):
        assert signal.getsignal(signal.SIGUSR2) == before  # the main process's handlers are untouched
    assert loader.last_path == "workers"


class _TouchInit:
    def __init__(self, folder: Path):
        self.folder = folder

    def __call__(self, worker_id: int) -> None:
        (self.folder / f"init-{worker_id}").touch()


def test_without_faulthandler_register_the_stacks_are_unavailable(shards: Path, tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture, monkeypatch):
    monkeypatch.setattr(_watchdog, "CAN_DUMP", False)  # as on Windows
    ds = ShardedDataset(shards, shuffle=False, decode={"cls": StallAt(tmp_path, 0)})
    loader = DataLoader(ds, batch_size=2, num_workers=1, multiprocessing_context="fork", stall_warning=0.3)
    with release_on_warning(tmp_path, needle="stacks unavailable"):
        assert labels(loader) == list(range(16))
    pid = int((tmp_path / "stalled.pid").read_text())
    msg = next(m for m in stall_warnings(caplog) if "stacks unavailable" in m)
    assert f"pid {pid} alive" in msg


@pytest.mark.parametrize("bad", [-1, -0.5, float("nan"), float("inf"), "60", True])
def test_bad_stall_warning_values_are_refused(shards: Path, bad):
    with pytest.raises(ValueError, match="stall_warning"):
        DataLoader(ShardedDataset(shards), batch_size=2, stall_warning=bad)
