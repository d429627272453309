"""Shared test configuration: CUDA tests skip cleanly on machines without a GPU; shared fixtures."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers import fork_probe  # noqa: F401  registers its fork hook before fastdata's, so it runs after them
from tests.helpers.loopback_server import make_shard_set


@pytest.fixture(scope="module")
def seven(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """7 samples in tar shards of 4 and 3 (cls = global index): the resume and multi-rank tests' set."""
    from fastdata.shards.tar import write_tar_shard

    dest = tmp_path_factory.mktemp("seven")
    paths, i = [], 0
    for j, size in enumerate([4, 3]):
        path = dest / f"s{j}.tar"
        write_tar_shard(path, [{"__key__": f"k{i + k:04d}", "cls": str(i + k).encode()} for k in range(size)])
        paths.append(str(path))
        i += size
    return paths


@pytest.fixture
def make_shards(tmp_path: Path) -> Callable[..., Path]:
    """``tests.helpers.shards.make_shards`` writing into a new folder under ``tmp_path`` (or ``dest=``):
    ``make_shards(n, per_shard=None, **fields)`` returns the folder."""
    from tests.helpers.shards import shard_maker

    return shard_maker(tmp_path)


@pytest.fixture(scope="module", autouse=True)
def _no_fsspec_io_thread_after_the_module():
    """A module that used fsspec (s3, HTTP through aiohttp) leaves its IO-loop thread (and a
    keep-alive connection's server thread) running for the rest of the session, so every later
    ``convert``/``fastdata shard`` pooled run spawns its workers instead of forking them
    (``convert._mp_context`` forks only from a single-threaded process): test_shard_tool took
    2.5x as long in the suite as alone. Each module starts as it would alone: fsspec's cached
    filesystems are dropped (their sessions closed on the running loop) and the loop is stopped;
    fsspec starts a new one when next used. (The LoopbackServer closes its connections itself.)"""
    yield
    _stop_fsspec_io_thread()


_STOPPED_FSSPEC_LOOPS: list = []


def _stop_fsspec_io_thread() -> None:
    import sys

    asyn = sys.modules.get("fsspec.asyn")
    if asyn is None or asyn.loop[0] is None:
        return
    import asyncio
    import gc

    from fsspec.spec import AbstractFileSystem

    classes, todo = set(), [AbstractFileSystem]
    while todo:
        cls = todo.pop()
        if cls not in classes:
            classes.add(cls)
            todo.extend(cls.__subclasses__())
    for cls in classes:
        cls.clear_instance_cache()
    gc.collect()  # weakref finalizers close the filesystems' sessions while their loop still runs
    loop, thread = asyn.loop[0], asyn.iothread[0]
    with asyn.get_lock():
        asyncio.run_coroutine_threadsafe(loop.shutdown_default_executor(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        if not thread.is_alive():
            # stopped, not closed, and kept: an fsspec file dropped later (one whose open failed is
            # closed only by its __del__) schedules its close here harmlessly, with no warning
            _STOPPED_FSSPEC_LOOPS.append(loop)
            asyn.loop[0] = asyn.iothread[0] = None


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def pytest_configure(config: pytest.Config) -> None:
    """Workers under the ``forkserver`` start method fork from a server that has imported torch and
    fastdata already, as a training script's forkserver would after its first loader: each test then
    pays that import once, not once per worker (seconds each on a loaded 2-core machine). The
    start method's semantics (pickled datasets, fresh worker state) are unchanged."""
    import multiprocessing as mp

    if "forkserver" in mp.get_all_start_methods():
        mp.set_forkserver_preload(["torch", "fastdata", "fastdata.loader", "fastdata.dataset"])


class VirtualClock:
    """The clock of a :class:`fastdata.StallMeter` under test: time passes only by :meth:`sleep`, so the
    waits, wall time and shares a meter reports come out exactly, however busy the machine is."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def stall_clock(monkeypatch: pytest.MonkeyPatch) -> VirtualClock:
    """StallMeter reads this clock (``fastdata.monitor._stall.time``) in the test: loaders and steps call
    ``stall_clock.sleep(s)`` where they would sleep."""
    from fastdata.monitor import _stall

    clock = VirtualClock()
    monkeypatch.setattr(_stall, "time", clock)
    return clock


@pytest.fixture
def decode_thread_joins(monkeypatch: pytest.MonkeyPatch) -> list:
    """The timeout of every ``Thread.join`` on a fastdata decode thread from here on in the test
    (None: no timeout): how long a close or an error waits for stuck decode threads, without a clock."""
    import threading

    waits: list = []
    join = threading.Thread.join

    def recorded(self: threading.Thread, timeout: float | None = None) -> None:
        if self.name.startswith("fastdata-decode"):
            waits.append(timeout)
        return join(self, timeout)

    monkeypatch.setattr(threading.Thread, "join", recorded)
    return waits


@pytest.fixture(scope="module")
def served_6_shards(tmp_path_factory):
    """A folder for a loopback server: ds/ holds 24 samples in 6 shards of ~8 KB."""
    root = tmp_path_factory.mktemp("www")
    make_shard_set(root / "ds", 24, 4, payload=2000, seed=1)  # 6 shards of ~8 KB
    return root


@pytest.fixture
def array_shards(tmp_path):
    """16 samples of a stored uint8 (3, 8, 8) image and a class label, in 2 tar shards."""
    from tests.helpers.shards import make_shards

    return make_shards(tmp_path / "s", 16, 8, key="k{i:03d}", cls=lambda i: i % 2, array=(3, 8, 8))


@pytest.fixture
def loader_factory(tmp_path):
    """A function making a DataLoader (batches of 3) over 12 samples in 2 shards."""
    from fastdata.dataset import ShardedDataset
    from fastdata.loader import DataLoader
    from tests.helpers.shards import make_shards

    make_shards(tmp_path / "ds", 12, 6)

    def make() -> DataLoader:
        return DataLoader(ShardedDataset(tmp_path / "ds"), batch_size=3)

    return make


@pytest.fixture(scope="module")
def served_4_shards(tmp_path_factory):
    """A folder for a loopback server: ds/ holds 16 samples in 4 shards."""
    root = tmp_path_factory.mktemp("www")
    make_shard_set(root / "ds", 16, 4, payload=500, seed=1)  # 4 shards
    return root


@pytest.fixture
def one_array_shard(tmp_path):
    """8 samples of a stored uint8 (3, 8, 8) image and a class label, in one tar shard."""
    from tests.helpers.shards import make_shards

    return make_shards(tmp_path / "s", 8, key="k{i:03d}", cls=lambda i: i % 2, array=(3, 8, 8))


@pytest.fixture
def jpeg_shards(tmp_path):
    """16 small JPEGs (12 pixels high, 16 to 23 wide) with a class label, in 2 tar shards."""
    from tests.helpers.images import jpeg
    from tests.helpers.shards import make_shards

    return make_shards(tmp_path / "shards", 16, 8, key="k{i:04d}", image=lambda i: jpeg(i % 8, 16 + i % 8, 12),
                       cls=lambda i: i % 3)
