"""Loader states refused at load_state_dict that only the loader can judge: the worker count of a streaming
source's positions, and a load while another thread is inside next() of the loader's iterator."""
from __future__ import annotations

import threading

import pytest

from fastdata import DataLoader, ShardedDataset, StateError
from tests.helpers.shards import make_shards, memory_urls


def test_a_streaming_state_of_another_worker_count_is_refused_at_load(tmp_path):
    pytest.importorskip("fsspec")
    urls = memory_urls(make_shards(tmp_path / "s", 8, 2, key="k{i:02d}", cls="int"), "loader-state-stream")
    src = DataLoader(ShardedDataset(urls), batch_size=2, num_workers=2)
    it = iter(src)
    next(it)
    state = src.state_dict()
    other = DataLoader(ShardedDataset(urls), batch_size=2, num_workers=1)
    with pytest.raises(StateError, match="positions are of num_workers=2; a streaming .* this loader has "
                                         "num_workers=1"):
        other.load_state_dict(state)  # was refused only when the epoch started
    same = DataLoader(ShardedDataset(urls), batch_size=2, num_workers=2)
    same.load_state_dict(state)
    assert len(list(same)) == 3


def test_a_load_while_another_thread_is_inside_next_is_refused(tmp_path):
    gate, inside = threading.Event(), threading.Event()

    def slow(sample):
        inside.set()
        gate.wait(30)
        return sample

    loader = DataLoader(ShardedDataset(make_shards(tmp_path / "s", 8, 4, key="k{i:02d}", cls="int"), sample_transform=slow), batch_size=2)
    state = loader.state_dict()
    got = []
    consumer = threading.Thread(target=lambda: got.extend(loader), name="consumer")
    consumer.start()
    try:
        assert inside.wait(30)
        with pytest.raises(StateError, match="while thread 'consumer' is inside next"):
            loader.load_state_dict(state)
    finally:
        gate.set()
        consumer.join(30)
    assert len(got) == 4  # the refused load changed nothing: that epoch went on
    loader.load_state_dict(state)
    assert len(list(loader)) == 4
