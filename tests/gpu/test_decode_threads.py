"""DecodeImages(decode_threads=K): a batch's device-routed images in K chunks, decoded at once by K threads,
each call on a stream of its own and joined back to the consumer's stream.

On the CPU (a stub device decoder, or nvImageCodec's CPU backend, take the device-routed images there):
every image decoded exactly once and in order, the chunks really concurrent, a thread's error raised at
the consumer with its traceback, shard and key; the threads end on ``close()``, when the stage is
collected and at interpreter exit, are never running when the process forks, and the stage works in
fork, spawn and forkserver children. The stream and event logic with fake CUDA streams and events. On a
GPU: TorchCodec with four threads against the CPU decode and against one thread (the hazard case with
several threads is in test_stream_order_guard.py)."""
from __future__ import annotations

import gc
import multiprocessing as mp
import subprocess
import sys
import textwrap
import threading
import time
import types
from concurrent.futures import CancelledError
from pathlib import Path

import numpy as np
import pytest
import torch

from fastdata import gpu
from fastdata.gpu import _decode, _threads

from tests.helpers import fork_probe
from tests.helpers.images import jpeg, many_jpegs, packed, pillow_rgb

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[2]


def alive() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith(_threads.THREAD_NAME) and t.is_alive())


def wait_until_none_alive() -> list[str]:
    """The decode threads still alive after at most 20 s (a hang guard, not a time bound)."""
    deadline = time.monotonic() + 20
    while alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    return alive()


class Stub:
    """A device decoder (as ``_decode.decode_device``) decoding with Pillow; it logs each call's images and
    thread, and with ``barrier`` waits until that many calls run at once (a BrokenBarrierError otherwise)."""

    def __init__(self, datas: list[bytes], barrier: int = 0, fail: bytes | None = None) -> None:
        self.index = {d: i for i, d in enumerate(datas)}
        self.calls: list[tuple[str, list[int]]] = []
        self.barrier = threading.Barrier(barrier, timeout=20) if barrier else None
        self.fail = fail
        self.lock = threading.Lock()

    def __call__(self, views, device, backend="auto", **kw):
        rows = [self.index[bytes(v.numpy())] for v in views]
        with self.lock:
            self.calls.append((threading.current_thread().name, rows))
        if self.barrier is not None:
            self.barrier.wait()
        if self.fail is not None and self.fail in [bytes(v.numpy()) for v in views]:
            raise_engine_gone()
        return [pillow_rgb(bytes(v.numpy())) for v in views]


def raise_engine_gone() -> None:
    raise OSError("the JPEG engine went away")


@pytest.fixture
def stub(monkeypatch):
    """Install a Stub as the stage's device decoder (routing device-decodable images to it on the CPU)."""
    def install(datas: list[bytes], **kw) -> Stub:
        s = Stub(datas, **kw)
        monkeypatch.setattr(_decode, "device_backend", lambda name="auto": "nvimgcodec")
        monkeypatch.setattr(_decode, "decode_device", s)
        return s
    return install


@pytest.mark.parametrize("bad", [0, 33, True, 1.5, "2", None])
def test_decode_threads_is_checked(bad):
    with pytest.raises(ValueError, match=rf"DecodeImages: decode_threads must be an int from 1 to 32 .*got {bad!r}"):
        gpu.DecodeImages(device="cpu", decode_threads=bad)


@pytest.mark.parametrize("threads", [2, 3, 4])
def test_chunks_decode_at_once_each_image_once_and_in_order(stub, threads):
    datas = many_jpegs(4 * threads + 1)
    s = stub(datas, barrier=threads)  # every chunk must be in a call at the same time
    with gpu.DecodeImages(device="cpu", decode_threads=threads, host_decoder="pillow") as stage:
        out = stage({"jpg": packed(datas), "cls": torch.arange(len(datas))})
        assert len(alive()) == threads and "decode_threads=" in repr(stage)
    assert sorted(r for _, rows in s.calls for r in rows) == list(range(len(datas)))  # each image once
    assert len(s.calls) == threads and len({name for name, _ in s.calls}) == threads
    assert sorted(rows[0] for _, rows in s.calls) == [rows[0] for _, rows in sorted(s.calls, key=lambda c: c[1])]
    ib = out["jpg"]
    assert ib.ids.tolist() == [100 + i for i in range(len(datas))]  # the batch's order
    assert all(torch.equal(im, pillow_rgb(d)) for im, d in zip(ib.images, datas))
    assert out["cls"].tolist() == list(range(len(datas)))


@pytest.mark.parametrize(("threads", "chunk_size", "ahead", "want"), [
    (1, None, True, [12]), (1, None, False, [6, 6]),  # as before decode_threads: one call, or two halves
    (3, None, True, [4, 4, 4]), (3, None, False, [4, 4, 4]), (4, None, True, [3, 3, 3, 3]),
    (5, None, True, [3, 3, 3, 3]),  # never an empty call
    (2, 5, True, [5, 5, 2]),  # chunk_size decides where given
])
def test_a_batch_splits_into_one_chunk_per_thread(stub, threads, chunk_size, ahead, want):
    datas = many_jpegs(12)
    s = stub(datas)
    stage = gpu.DecodeImages(device="cpu", decode_threads=threads, chunk_size=chunk_size)
    p = packed(datas)
    _, on_device, pieces = stage._start(p, p.views(), CPU, ahead=ahead)
    assert [len(rows) for rows, _ in pieces] == want and on_device == list(range(12))
    for rows, fut in pieces:
        images, ready = stage._threads.result(fut)
        assert ready is None and len(images) == len(rows)
    assert sorted(r for _, rows in s.calls for r in rows) == list(range(12))
    stage.close()


def test_a_threads_error_reaches_the_consumer_with_its_traceback_shard_and_key(stub):
    datas = many_jpegs(9)
    stub(datas, fail=datas[7])  # in the third chunk (rows 6-8)
    stage = gpu.DecodeImages(device="cpu", decode_threads=3)
    with pytest.raises(OSError, match="the JPEG engine went away") as info:
        stage({"jpg": packed(datas)})
    assert "raise_engine_gone" in [entry.name for entry in info.traceback]  # raised in the thread, kept
    notes = "\n".join(info.value.__notes__)
    assert f"in thread {_threads.THREAD_NAME}-" in notes and "decoding 3 images with 'nvimgcodec'" in notes
    assert "field 'jpg', shard-0.tar: sample 'k6' to shard-0.tar: sample 'k8'" in notes
    ok = stage({"jpg": packed(datas[:6])})["jpg"]  # the stage goes on
    assert len(ok.images) == 6
    stage.close()


def test_threads_end_on_close_when_collected_and_start_again_on_demand(stub):
    datas = many_jpegs(6)
    stub(datas)
    stage = gpu.DecodeImages(device="cpu", decode_threads=3)
    stage({"jpg": packed(datas)})
    assert len(alive()) == 3
    stage.close()
    assert alive() == []  # joined
    stage.close()  # twice is fine
    stage({"jpg": packed(datas)})  # new threads for the next batch
    assert len(alive()) == 3
    del stage
    gc.collect()
    assert wait_until_none_alive() == []


def test_no_decode_thread_runs_while_the_process_forks(stub):
    datas = many_jpegs(6)
    stub(datas)
    stage = gpu.DecodeImages(device="cpu", decode_threads=2)
    first = stage({"jpg": packed(datas)})["jpg"]
    assert len(alive()) == 2
    exitcode, recorded = fork_probe.fork_child()
    assert exitcode == 0 and recorded
    assert not [n for names in recorded for n in names if n.startswith(_threads.THREAD_NAME)]
    again = stage({"jpg": packed(datas)})["jpg"]  # threads restarted on demand after the fork
    assert all(torch.equal(a, b) for a, b in zip(first.images, again.images)) and len(alive()) == 2
    stage.close()


def test_a_wait_restarts_threads_a_fork_paused_meanwhile(stub):
    from fastdata.loader import _pool

    datas = many_jpegs(4)
    stub(datas)
    stage = gpu.DecodeImages(device="cpu", decode_threads=2)
    p = packed(datas)
    stage({"jpg": p})  # the threads run
    _pool._pause_before_fork()  # another thread forks: the threads are joined
    try:
        _, _, pieces = stage._start(p, p.views(), CPU, ahead=False)  # queued while paused
        assert alive() == []
    finally:
        _pool._resume_after_fork()  # in the parent, after the fork: nothing restarts by itself
    decoded = [stage._threads.result(fut)[0] for _, fut in pieces]  # the wait restarts them
    assert [len(images) for images in decoded] == [2, 2]
    stage.close()


def _checksums(images: list[torch.Tensor]) -> list[int]:
    # numpy's sum: a torch reduction would start OpenMP threads, which a forked child cannot (a test matter)
    return [int(im.numpy().sum(dtype=np.int64)) for im in images]


def test_a_batch_submitted_ahead_of_a_close_is_decoded_anew(stub):
    from fastdata.loader import _pool

    datas = many_jpegs(6)
    s = stub(datas)
    stage = gpu.DecodeImages(device="cpu", decode_threads=3)
    stage({"jpg": packed(datas[:3])})
    s.calls.clear()
    p = packed(datas)
    _pool._pause_before_fork()  # the threads stop, so the calls below stay queued
    try:
        p.pending = stage._start(p, p.views(), CPU, ahead=True)  # submitted ahead, as DecodeImages.ahead does
        stage.close()  # ... then the stage is closed: its queued calls are cancelled
    finally:
        _pool._resume_after_fork()
    assert all(fut.cancelled() for _, fut in p.pending[2])
    with pytest.raises(CancelledError):  # a wait for a cancelled call ends (it never runs)
        stage._threads.result(p.pending[2][0][1])
    ib = stage({"jpg": p})["jpg"]  # decoded anew by new threads
    assert all(torch.equal(im, pillow_rgb(d)) for im, d in zip(ib.images, datas))
    assert sorted(r for _, rows in s.calls for r in rows) == list(range(6))
    stage.close()


def _decode_in_child(stage: gpu.DecodeImages, datas: list[bytes], q) -> None:
    try:
        out = stage({"jpg": packed(datas)})["jpg"]
        q.put(_checksums(out.images))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        q.put(repr(e))


@pytest.mark.parametrize("method", [m for m in ("fork", "spawn", "forkserver") if m in mp.get_all_start_methods()])
def test_the_stage_decodes_in_a_child_process(method):
    pytest.importorskip("nvidia.nvimgcodec")
    datas = many_jpegs(6)
    stage = gpu.DecodeImages(device="cpu", device_decoder="nvimgcodec", decode_threads=3)
    want = _checksums(stage({"jpg": packed(datas)})["jpg"].images)  # the threads run here
    ctx = mp.get_context(method)
    q = ctx.Queue()
    p = ctx.Process(target=_decode_in_child, args=(stage, datas, q))
    p.start()
    try:
        got = q.get(timeout=120)
    finally:
        p.join(30)
        if p.is_alive():  # never leave a hung child behind (the interpreter would wait for it at exit)
            p.kill()
    assert got == want and p.exitcode == 0
    stage.close()


def test_threads_end_at_interpreter_exit(tmp_path):
    pytest.importorskip("nvidia.nvimgcodec")
    script = tmp_path / "decode_and_exit.py"
    script.write_text(textwrap.dedent(f"""
        import atexit, threading

        def report():  # registered first, so it runs last: after fastdata's own exit hooks
            names = [t.name for t in threading.enumerate() if t.name.startswith({_threads.THREAD_NAME!r})]
            print("decode threads at exit:", names, flush=True)

        atexit.register(report)
        from fastdata import gpu
        from tests.helpers.images import many_jpegs, packed

        stage = gpu.DecodeImages(device="cpu", device_decoder="nvimgcodec", decode_threads=3)
        out = stage({{"jpg": packed(many_jpegs(6))}})
        print("decoded", len(out["jpg"].images), "with", threading.active_count() - 1, "threads", flush=True)
    """))
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    run = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
                         check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "decoded 6 with" in run.stdout and "decode threads at exit: []" in run.stdout


# ---- the CUDA side with fake streams and events ----------------------------------------------------------


class FakeCuda:
    """torch.cuda.Stream / stream() / current_stream() / Event stand-ins: the current stream is per thread;
    the consumer's is ``consumer``."""

    def __init__(self, monkeypatch) -> None:
        self.made: list[types.SimpleNamespace] = []
        self.local = threading.local()
        self.consumer = types.SimpleNamespace(name="consumer", priority=0, waits=[])
        self.lock = threading.Lock()
        fake = self

        def stream_ctor(device=None, priority=0):
            with fake.lock:
                s = types.SimpleNamespace(name=f"decode-{len(fake.made)}", priority=priority, waits=[])
                fake.made.append(s)
            return s

        class use:  # torch.cuda.stream(s)
            def __init__(self, s) -> None:
                self.s = s

            def __enter__(self):
                self.prev = getattr(fake.local, "current", None)
                fake.local.current = self.s

            def __exit__(self, *exc):
                fake.local.current = self.prev

        class Event:
            def record(self, s):
                self.stream = s

        monkeypatch.setattr(torch.cuda, "Stream", stream_ctor)
        monkeypatch.setattr(torch.cuda, "stream", use)
        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "current_stream",
                            lambda device=None: getattr(fake.local, "current", None) or fake.consumer)
        self.consumer.wait_event = lambda e: self.consumer.waits.append(e)

    def current(self):
        return getattr(self.local, "current", None)


class Image:
    """A decoded image on the device: which streams it was recorded on."""

    def __init__(self, stream) -> None:
        self.decoded_on = stream
        self.streams: list = []

    def record_stream(self, s) -> None:
        self.streams.append(s)


def test_each_call_decodes_on_a_stream_of_its_own_joined_to_the_consumer(monkeypatch):
    fake = FakeCuda(monkeypatch)
    barrier = threading.Barrier(4, timeout=20)

    def decode(views, device, backend="auto", **kw):
        stream = fake.current()
        barrier.wait()  # four calls in flight at once
        return [Image(stream) for _ in views]

    monkeypatch.setattr(_decode, "decode_device", decode)
    threads = _threads.DecodeThreads(4)
    streams = _threads.DecodeStreams(torch.device("cuda", 0), priority=-1)
    views = packed(many_jpegs(2)).views()
    dev = torch.device("cuda", 0)
    for _ in range(2):
        futures = [threads.submit(_decode._decode_chunk, views, dev, streams, "torchcodec", True) for _ in range(4)]
        results = [threads.result(f) for f in futures]
        used = [images[0].decoded_on for images, _ in results]
        assert len({id(s) for s in used}) == 4  # a stream each
        assert all(ready.stream is s for (_, ready), s in zip(results, used))  # ready: after the call, there
        for result in results:
            images = _decode._take(result, dev)  # on the consumer's stream
            assert fake.consumer.waits[-1] is result[1] and all(im.streams == [fake.consumer] for im in images)
    assert len(fake.made) == 4 and len(streams.streams) == 4  # four streams for eight calls: handed out again
    assert {s.priority for s in streams.streams} == {-1} and fake.current() is None
    threads.close()
    assert alive() == []


def test_a_stage_keeps_one_stream_set_per_device_and_priority(monkeypatch):
    fake = FakeCuda(monkeypatch)
    stage = gpu.DecodeImages(device="cpu", decode_threads=2)
    dev = torch.device("cuda", 0)
    a = stage._decode_streams(dev)
    assert stage._decode_streams(dev) is a and a.priority == 0
    with torch.cuda.stream(types.SimpleNamespace(priority=-2)):
        b = stage._decode_streams(dev)
    assert b is not a and b.priority == -2 and len(stage._streams) == 2
    assert fake.made == []  # streams are made when a call takes one
    assert pickle_roundtrip(stage)._streams == {}


def pickle_roundtrip(obj):
    import pickle

    return pickle.loads(pickle.dumps(obj))


# ---- CUDA --------------------------------------------------------------------------------------------------


@pytest.mark.cuda
def test_cuda_torchcodec_with_four_threads_matches_one_thread_and_the_cpu_decode():
    from fastdata.gpu import _codec
    from fastdata.prefetch import CUDAPrefetcher

    if _codec.torchcodec_status()[0] is None:
        pytest.skip("TorchCodec does not load here")
    datas = many_jpegs(64) + [jpeg(99, format="PNG")]  # a host-routed image too
    batches = [{"jpg": packed(datas[k : k + 13]).pin_memory(), "cls": torch.arange(13)} for k in range(0, 65, 13)]
    out = {}
    for threads in (1, 4):
        stage = gpu.DecodeImages(device="cuda", device_decoder="torchcodec", decode_threads=threads)
        pipe = gpu.Compose(stage, gpu.RandomResizedCrop(48), gpu.RandomHorizontalFlip())
        with stage, CUDAPrefetcher(stage.ahead(batches), device="cuda", transform=pipe, seamless=False) as pf:
            out[threads] = torch.cat([b["jpg"].cpu() for b in pf])
        assert all(len(s.streams) <= threads for s in stage._streams.values())
    assert out[4].shape == (65, 3, 48, 48) and int((out[4].int() - out[1].int()).abs().max()) <= 1  # same crops
    plain = gpu.DecodeImages(device="cuda", device_decoder="torchcodec", decode_threads=4)
    images = plain({"jpg": packed(datas[:32]).pin_memory()})["jpg"].images
    means = [float((im.cpu().int() - pillow_rgb(d).int()).abs().float().mean()) for im, d in zip(images, datas)]
    assert max(means) < 4.5
    plain.close()
