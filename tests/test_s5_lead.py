"""Small user-surface fixes of session 5 (the lead's, from the helpers' reports)."""
import re

import pytest
import torch

from fastdata.cli import main


def _help(argv, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    return capsys.readouterr().out


def test_shard_help_does_not_offer_verify_but_the_tool_does(capsys):
    from fastdata.cli._shard_cmd import build_tool_parser

    text = " ".join(_help(["shard", "--help"], capsys).split())
    assert "--verify" not in text  # `fastdata shard` has no --verify (`fastdata verify` is its own command)
    assert "with --verify, threads checking shards" in " ".join(build_tool_parser().format_help().split())


@pytest.mark.parametrize("command", ["verify", "shard"])
def test_a_file_given_as_dest_is_not_called_missing(tmp_path, capsys, command):
    f = tmp_path / "afile"
    f.write_text("x")
    if command == "verify":
        rc = main(["verify", str(f)])
        err = capsys.readouterr().err
        assert rc != 0 and "not a folder" in err and "no such folder" not in err and str(f) in err
    else:
        from fastdata.errors import ConversionError
        from fastdata.shards.convert import verify_dest

        with pytest.raises(ConversionError, match="not a folder"):
            verify_dest(f)


def test_demo_table_shows_no_first_epoch_time_without_a_warm_up_epoch():
    from fastdata.cli._demo import Row, _table

    rows = [Row("torch", "r", None, 100.0, 0.5, None, 1.0, True), Row("fastdata", "r", 2.5, 200.0, 0.1, None, 1.0, False)]
    lines = _table(rows, torch.device("cpu"))
    assert lines[2].rstrip().endswith("-") and "0.0s" not in lines[2]
    assert lines[3].rstrip().endswith("2.5s")


def test_streaming_source_over_several_ranks_without_samples_per_epoch_warns(tmp_path):
    """Whole streamed shards are dealt to ranks: their counts can differ (a DDP hang) unless
    samples_per_epoch fixes each rank's share. The warning comes once per dataset, not at world_size 1."""
    import warnings

    fsspec = pytest.importorskip("fsspec")
    from fastdata import ShardedDataset
    from fastdata.shards.writer import ShardWriter

    with ShardWriter(tmp_path / "s", max_samples=4) as w:
        for i in range(10):
            w.write({"__key__": f"k{i:03d}", "cls": i})
    fs = fsspec.filesystem("memory")
    urls = []
    for p in sorted((tmp_path / "s").glob("*.tar")):
        fs.pipe(f"/fastdata-uneven/{p.name}", p.read_bytes())
        urls.append(f"memory://fastdata-uneven/{p.name}")
    with pytest.warns(UserWarning, match="samples_per_epoch") as record:
        ds = ShardedDataset(urls, rank=0, world_size=2)
        ds.loader_seam.resolve_dist()
    assert sum("samples_per_epoch" in str(r.message) for r in record) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ShardedDataset(urls, rank=0, world_size=2, samples_per_epoch=6)
        ShardedDataset(urls)


def test_a_missing_source_is_a_fastdata_error_and_still_a_file_not_found_error(tmp_path):
    import fastdata
    from fastdata import FastdataError, ShardedDataset, SourceError, SourceNotFoundError

    (tmp_path / "imgs").mkdir()
    for source, what in ((tmp_path / "imgs", "no manifest.json"), ([str(tmp_path / "missing.tar")], "missing.tar")):
        with pytest.raises(SourceNotFoundError, match=what) as info:
            ShardedDataset(source)
        assert isinstance(info.value, FastdataError) and isinstance(info.value, SourceError)
        assert isinstance(info.value, FileNotFoundError)
    assert fastdata.SourceNotFoundError is SourceNotFoundError


def test_a_failed_cache_build_stops_its_workers_without_a_garbage_collection(tmp_path):
    """build_cache over a too-small cache fails in a worker; torch's iterator then sat in a cycle through
    the traceback and its worker was joined only at the next gc.collect(), after a 5 s timeout."""
    import gc
    import multiprocessing as mp

    import numpy as np
    from PIL import Image

    from fastdata import Cache, CacheError, ResizeCenterCrop, ShardedDataset
    from fastdata.shards.writer import ShardWriter
    from fastdata.cli._synth import jpeg_bytes

    with ShardWriter(tmp_path / "s") as w:
        for i in range(4):
            img = Image.fromarray(np.full((40, 40, 3), 60 * i, np.uint8))
            w.write({"__key__": f"k{i}", "jpg": jpeg_bytes(img, 90), "cls": i})
    ds = ShardedDataset(tmp_path / "s", preprocess=ResizeCenterCrop(8), cache=Cache(tmp_path / "c", max_bytes=10))
    gc.disable()
    try:
        with pytest.raises(CacheError):
            ds.build_cache(num_workers=1)
        workers = mp.active_children()  # those still ending
        for w in workers:
            w.join(30)  # a hang guard: with gc off nothing else would stop them
        # ended on their own: not left running, not terminated after torch's 5 s join timeout (SIGTERM)
        assert [w.exitcode for w in workers] == [0] * len(workers) and not mp.active_children()
    finally:
        gc.enable()


def test_an_unidentifiable_image_is_named_by_its_bytes_not_a_memory_address(tmp_path):
    from fastdata import DecodeError, ShardedDataset
    from fastdata.shards.writer import ShardWriter

    with ShardWriter(tmp_path / "s") as w:
        w.write({"__key__": "k013", "jpg": b"\xff\xd8garbage", "cls": 0})
    with pytest.raises(DecodeError) as info:
        next(iter(ShardedDataset(tmp_path / "s")))
    msg = str(info.value)
    assert "'k013'" in msg and "'jpg'" in msg and "cannot identify image file" in msg
    assert not re.search("0x[0-9a-f]{6}", msg) and "BytesIO" not in msg and "9 bytes starting b'\\xff\\xd8garbag'" in msg


def _memory_urls(tmp_path, name, n, per_shard):
    fsspec = pytest.importorskip("fsspec")
    from fastdata.shards.writer import ShardWriter

    with ShardWriter(tmp_path / name, max_samples=per_shard) as w:
        for i in range(n):
            w.write({"__key__": f"k{i:03d}", "cls": i})
    fs = fsspec.filesystem("memory")
    urls = []
    for p in sorted((tmp_path / name).glob("*.tar")):
        fs.pipe(f"/{name}/{p.name}", p.read_bytes())
        urls.append(f"memory://{name}/{p.name}")
    return urls


def test_a_streaming_source_with_too_few_shards_fails_at_iter_not_in_a_worker(tmp_path):
    from fastdata import DataLoader, ShardedDataset

    urls = _memory_urls(tmp_path, "fastdata-few", 4, 2)  # 2 shards
    loader = DataLoader(ShardedDataset(urls), batch_size=2, num_workers=3)
    with pytest.raises(ValueError, match=r"at least world_size x num_workers = 3 shards, got 2") as info:
        iter(loader)
    assert "worker process" not in str(info.value)  # raised in this process, not re-raised from a worker
    assert sorted(int(c) for b in DataLoader(ShardedDataset(urls), batch_size=2, num_workers=2) for c in b["cls"]) \
        == list(range(4))


def test_thread_decoder_warns_of_skips_when_the_consumer_reaches_them(tmp_path):
    """on_error="warn": the pool meets a bad sample ahead of the consumer; its warning comes when the
    consumer reaches the batch, in batch order (with the skip record), as the skip records do."""
    import time
    import warnings

    from fastdata import DataLoader, ShardedDataset, SkippedSampleWarning
    from fastdata.shards.writer import ShardWriter

    with ShardWriter(tmp_path / "ds", max_samples=10) as w:
        for i in range(20):  # virtual workers: k000-k009, k010-k019
            w.write({"__key__": f"k{i:03d}", "cls": b"x" if i in (2, 10, 13) else str(i).encode()})
    ds = ShardedDataset(tmp_path / "ds", on_error="warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        it = iter(DataLoader(ds, batch_size=3, num_workers=2, decode_threads=2))
        next(it)  # k000 k001 k003 (k002 skipped)
        time.sleep(0.5)  # the pool has loaded ahead (k010, a skip, in worker 1's first batch)
        keys = lambda: [str(c.message).split("'")[1] for c in caught if issubclass(c.category, SkippedSampleWarning)]
        assert keys() == ["k002"]
        list(it)
        assert keys() == ["k002", "k010", "k013"]
    assert [r["key"] for r in ds.skipped] == ["k002", "k010", "k013"]
