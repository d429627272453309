"""The producer thread of ``CUDAPrefetcher``: one run of epochs staged into one pipe.

A ``Run`` is one producer thread, its ``Pipe`` and the epochs it and the consumer have reached.
``produce`` is the thread's body: it pulls every batch of an epoch from the wrapped iterable, stages
it (``_stage``) and puts it into the pipe with the loader's state after it; at the end of the epoch
it asks the epoch policy (``_epochs.next_start``) whether it may start the next epoch
itself (at most one epoch ahead of the consumer) or must leave it to the consumer (``Run.handoff``).

Invariants: the thread holds no reference to the prefetcher (dropping it stops the thread); it never
dies silently (every error travels to the consumer as a ``Failure``, with its traceback and a note
naming the step); it stops at the next batch boundary once ``pipe.stop`` is set; a generator it ran
is closed in this thread. Every run is listed in ``RUNS`` until collected, so that the interpreter's
exit can stop them. Design: docs/design/prefetch.md.
"""
from __future__ import annotations

import threading
import types
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from fastdata._runtime import thread
from fastdata._util import add_note, release_frames
from fastdata.prefetch._epochs import EpochRunner, NextStart, next_start
from fastdata.prefetch._queue import END, POLL_S, EpochStart, Failure, Pipe, Stats, Stopped, perf_counter
from fastdata.prefetch._stage import CpuStager, CudaStager

__all__ = ["RUNS", "Run", "close_generator", "note", "produce"]

RUNS: weakref.WeakSet[Run] = weakref.WeakSet()  # every producer run not yet collected
_thread_ids = iter(range(1 << 62))


class Run:
    """One producer thread: its pipe, and the epochs it and the consumer have reached."""

    def __init__(self, pipe: Pipe) -> None:
        self.pipe = pipe
        self.thread: threading.Thread | None = None
        self.cv = threading.Condition()
        self.requested = 1  # epochs the consumer has begun (or asked for)
        self.claimed = 0  # the latest epoch an iterator was handed out for (only one iterator per epoch)
        self.begun = -1  # the latest epoch the consumer has begun
        self.finished = -1  # the latest epoch the consumer has taken to its end
        self.ahead: tuple[int, Any] | None = None  # (number, epoch value) of the latest look-ahead epoch
        # set by a thread that ended after its epoch instead of looking ahead: (the next epoch's number,
        # may the consumer start it before taking the current epoch's last batches?)
        self.handoff: tuple[int, bool] | None = None
        RUNS.add(self)

    def alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def request(self, number: int) -> None:
        with self.cv:
            self.requested = max(self.requested, number + 1)
            self.cv.notify_all()

    def wait_requested(self, count: int) -> None:
        with self.cv:
            while self.requested < count:
                if self.pipe.stop.is_set():
                    raise Stopped
                self.cv.wait(POLL_S)
        if self.pipe.stop.is_set():
            raise Stopped

    def start(self, source: Iterator[Any], epochs: EpochRunner, stager: CpuStager | CudaStager, stats: Stats,
              device: torch.device, seamless: bool, number: int = 0) -> None:
        """Start the producer thread on ``source``, epoch ``number`` of this run (see ``produce``)."""
        self.thread = thread(
            produce,
            args=(self, source, epochs, stager, stats, device, seamless, number),
            name=f"fastdata-prefetch-{next(_thread_ids)}",
        )
        self.thread.start()


def produce(
    run: Run,
    source: Iterator[Any],
    epochs: EpochRunner,
    stager: CpuStager | CudaStager,
    stats: Stats,
    device: torch.device,
    seamless: bool,
    number: int = 0,
) -> None:
    """Thread body, from epoch ``number`` of the run on. Holds no reference to the prefetcher, so
    dropping it stops the thread. Starts the next epoch itself only where the epoch policy allows;
    otherwise it leaves ``run.handoff`` and ends, and the consumer starts that epoch in its thread."""
    pipe = run.pipe
    where = [f"raised while setting up the thread for {device}"]
    try:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        stager.begin_thread()
        while True:
            _pump(pipe, source, stager, stats, epochs, number, device, where)
            if seamless:
                where[0] = "raised while inspecting the wrapped iterable before the next epoch"
                start = next_start(epochs.hazards(epochs.iterable))
                if start is not NextStart.THREAD:  # set before END: the consumer sees it once it has taken END
                    # forking: as soon as the consumer notices; global RNG: where a plain loop draws
                    run.handoff = (number + 1, start is NextStart.CONSUMER)
                    seamless = False
            pipe.items.put(END)
            close_generator(source)
            if not seamless:
                return
            run.wait_requested(number + 1)  # at most one epoch ahead of the consumer
            number += 1
            where[0] = f"raised while starting epoch {number} ahead (iter() of the wrapped iterable)"

            def started(value: Any, n: int = number) -> None:
                run.ahead = (n, value)

            source, state, value = epochs.begin(started, ahead=True)
            stats.add(lookahead_epochs=1)
            pipe.items.put(EpochStart(number, state, value))
    except Stopped:
        return
    except BaseException as e:  # noqa: BLE001  travels to the consumer, traceback included
        release_frames(e)  # a torch DataLoader's error must not keep its workers alive in a cycle
        note(e, f"{where[0]} (thread {threading.current_thread().name})")
        pipe.items.put(Failure(e))
    finally:
        close_generator(source)


def _pump(pipe: Pipe, source: Iterator[Any], stager: CpuStager | CudaStager, stats: Stats, epochs: EpochRunner,
          number: int, device: torch.device, where: list[str]) -> None:
    """Stage every batch of one epoch into the pipe (raises ``Stopped`` when the run is stopped);
    ``where[0]`` names the step in progress, for the note on an error."""
    index = 0
    snapshot = epochs.snapshot
    stop = pipe.stop
    while True:
        if stop.is_set():
            raise Stopped
        t0 = perf_counter()
        where[0] = f"raised by the wrapped iterable at batch {index} of epoch {number}"
        try:
            batch = next(source)
        except StopIteration:
            return
        where[0] = f"raised by the wrapped iterable's state_dict() after batch {index}"
        state = snapshot() if snapshot is not None else None
        stats.add(load_s=perf_counter() - t0)
        credit = pipe.take_credit()
        if stop.is_set():
            raise Stopped
        where[0] = f"raised while staging batch {index} (transform or copy to {device})"
        item = stager.stage(batch, credit)
        del batch
        item.state = state
        pipe.items.put(item)
        index += 1


def close_generator(source: Any) -> None:
    """Run a generator's cleanup in the thread that ran it (it may be stopped mid-epoch)."""
    if not isinstance(source, types.GeneratorType):
        return
    try:
        source.close()
    except Exception as e:  # noqa: BLE001  nobody is waiting for this epoch any more
        warnings.warn(f"CUDAPrefetcher: closing the wrapped generator raised {e!r}", RuntimeWarning, stacklevel=1)


def note(error: BaseException, text: str) -> None:
    """Add ``text`` to ``error``'s notes, prefixed with the class that reports it."""
    add_note(error, f"fastdata.CUDAPrefetcher: {text}")
