"""The walk of a streaming (URL) source: whole shards dealt to (rank, worker) slots, read in file order.

A streaming source has no sample counts, so its order is not index math: pass ``p`` deals the shard
order (shuffled by ``(seed, p)`` or the listed order) round-robin over the ``world_size x num_workers``
slots, each slot streams its shards through an optional seeded shuffle buffer, and with
``samples_per_epoch`` a slot takes its quota from an endless sequence of passes. A stream position
counts samples and shard failures alike, so a resume skips the consumed prefix without decoding it.
A shard that fails mid-way loses the rest of it (one skip record stands for all of them).
See docs/design/split.md.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np

from fastdata.dataset._cursor import Cursor
from fastdata._rng import permutation, random_floats, rng_key
from fastdata.dataset._split import Stage, split_sizes
from fastdata.errors import FastdataError, ShardError, SourceError, StateError

__all__ = ["check_stream_stages", "iter_stream"]


class _ShardCut(NamedTuple):
    """A streamed shard that failed after ``read`` samples: the rest of it is lost (one stream position)."""

    error: FastdataError
    read: int


def check_stream_stages(ds: Any, stages: Sequence[Stage]) -> None:
    """A streaming source resumes only with the worker count it was saved with, and needs a shard per slot."""
    if len(stages) > 1:
        raise StateError("a streaming (URL) source resumes only with the num_workers it was saved with")
    slots = ds.world_size * stages[-1][0]
    if len(ds.source.names) < slots:
        raise ValueError(f"a streaming source needs at least world_size x num_workers = {slots} shards, "
                         f"got {len(ds.source.names)}")


def iter_stream(ds: Any, cursor: Cursor) -> Iterator[Any]:
    """The samples of ``cursor``'s walk of a streaming ``ds`` from its position on, advancing it."""
    check_stream_stages(ds, cursor.stages)
    samples = ds._samples
    nwe = cursor.stages[-1][0]
    slots, slot = ds.world_size * nwe, ds.rank * nwe + cursor.worker
    quota = None if ds.samples_per_epoch is None else split_sizes(ds._per_rank(), nwe)[cursor.worker]
    key = rng_key(ds.seed, 2, cursor.epoch, ds.rank, nwe, cursor.worker)
    # members a shard leaves out are listed when it is read (outside the shuffle buffer: no stream position)
    raw = _stream_raw(ds, cursor.epoch, slot, slots, quota is not None,
                      lambda shard, members: _list_left_out(ds, members, shard, cursor))
    if ds.shuffle is not None and ds.shuffle.buffer_size > 1:
        raw = _shuffle_buffer(raw, ds.shuffle.buffer_size, key)
    pos = 0
    for shard, item in raw:
        if quota is not None and pos >= quota:
            break
        pos += 1
        if pos <= cursor.pos:  # resume: consumed before, skipped without decoding
            if isinstance(item, _ShardCut):  # unreadable now: the positions after it would shift and
                _stream_cut(ds, item, shard, cursor)  # lose samples in silence
            continue
        if isinstance(item, _ShardCut):
            _stream_cut(ds, item, shard, cursor)
            cursor.pos = pos
            continue
        if ds.fields is not None:  # as a reader's read(i, fields=) does for indexed sources
            item = {k: v for k, v in item.items() if k in ds.fields or k.startswith("__")}
        if samples.required and samples.lacks(ds, item, samples.required, shard, -1, cursor):
            cursor.pos = pos
            continue
        try:
            sample = samples.decode(ds, item, shard, -1, cursor.epoch)
            if not samples.pil_to_transform:
                sample = samples.apply(ds.preprocess, sample)
        except FastdataError as e:
            samples.handle_error(ds, e, e, shard, -1, -1, cursor, key=str(item.get("__key__", "?")))
            cursor.pos = pos
            continue
        sample = samples.randomize(ds, sample, shard, -1, cursor.epoch)
        cursor.pos = pos
        cursor.mark_current()
        yield sample
    yield from ds._skips.end_of_walk(cursor)


def _list_left_out(ds: Any, members: list[tuple[str, str]], shard: int, cursor: Cursor) -> None:
    """Tar members a streamed shard left out (a symlink out of the archive, a name that is no key.field), in
    ``skipped`` as those of local tars are (with ``member``; not sample skips: ``max_skips`` does not count
    them). A DataLoader worker's ride to the main process with its skip records."""
    from fastdata.shards import split_member_name

    name = ds.source.names[shard]
    records = []
    for member, reason in members:
        parts = split_member_name(member)
        records.append({"shard": name, "key": None if parts is None else parts[0], "member": member,
                        "index": None, "epoch": cursor.epoch, "reason": reason})
    ds._skips.add_left_out(ds, records, cursor)


def _stream_cut(ds: Any, cut: _ShardCut, shard: int, cursor: Cursor) -> None:
    """Apply ``on_error`` to a streamed shard that failed after ``cut.read`` samples. A skip is one record
    (key ``'?'``) for all the samples behind the failure: a tar URL has no manifest to count them."""
    if ds.on_error == "raise":
        raise cut.error
    lost = (f"the rest of the shard is lost after its first {cut.read} samples" if cut.read else
            "no sample of the shard could be read")
    reason = ShardError(f"{cut.error}; {lost} (count unknown: a streamed tar has no manifest; this one "
                        "record stands for all of them)")
    ds._samples.record_skip(ds, reason, shard, -1, cursor, "?")


def _stream_raw(ds: Any, epoch: int, slot: int, slots: int, endless: bool,
                left_out: Callable[[int, list[tuple[str, str]]], None]) -> Iterator[tuple[int, Any]]:
    source = ds.source
    n = len(source.names)
    p = epoch
    empty: set[int] = set()  # shards that gave nothing (no sample, no error): not fetched again this walk
    while True:
        order = permutation(rng_key(ds.seed, 0, p), n) if ds.shuffle is not None else np.arange(n)
        dealt = [s for s in order[slot::slots].tolist() if s not in empty]
        for shard in dealt:
            items = 0
            members: list[tuple[str, str]] = []  # members that give no data (iter_tar_stream warns too)
            try:
                for sample in source.stream(shard, members):
                    items += 1
                    yield shard, sample
            except (FastdataError, OSError) as e:  # the rest of this shard is lost
                err = e if isinstance(e, FastdataError) else ShardError(f"{source.names[shard]}: {e}")
                yield shard, _ShardCut(err, items)
                items += 1
            if members:
                left_out(shard, members)
            if not items:
                empty.add(shard)
        if not endless:
            return
        if len(empty) == n or (ds.shuffle is None and not dealt):
            # samples_per_epoch asks for more, but every shard this slot is dealt holds nothing (without
            # shuffling each pass deals the same ones): it looped over them for good, a GET each time
            names = [source.names[s] for s in sorted(empty)][:3]
            raise SourceError(
                f"rank {ds.rank} of world_size={ds.world_size}, worker slot {slot} of {slots}: every shard "
                f"it is dealt is empty ({', '.join(names)}{', ...' if len(empty) > 3 else ''}), so "
                "samples_per_epoch= cannot be filled: remove the empty tar files from the list"
                + ("" if ds.shuffle is not None else ", or shuffle (each pass then deals other shards)"))
        p += 1


def _shuffle_buffer(items: Iterator[tuple[int, Any]], size: int, key: int) -> Iterator[tuple[int, Any]]:
    buf: list[tuple[int, Any]] = []
    rand = iter(())
    block = 0
    for item in items:
        if len(buf) < size:
            buf.append(item)
            continue
        r = next(rand, None)
        if r is None:
            rand = iter(random_floats(rng_key(key, block), 4096).tolist())
            block += 1
            r = next(rand)
        j = int(r * len(buf))
        out, buf[j] = buf[j], item
        yield out
    order = permutation(rng_key(key, -1), len(buf)).tolist()
    for j in order:
        yield buf[j]
