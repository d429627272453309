"""Interoperability with webdataset, GNU tar and Python's tarfile, both ways."""
from __future__ import annotations

import gzip
import io
import shutil
import subprocess
import tarfile

import pytest

from fastdata.errors import ShardError
from fastdata.shards.tar import TarIndex, TarShardReader, iter_tar_stream, write_tar_shard


wds = pytest.importorskip("webdataset")


LONG_DIR = "very/" + "long-directory.name/" * 6  # > 100 bytes: needs PAX / GNU long-name headers


def payload(i: int, field: str) -> bytes:
    return bytes((i * 31 + j + len(field)) % 256 for j in range((i * 733 + 17 * len(field)) % 4000))


def make_samples(n: int, prefix: str = "set.a/cls_1/img") -> list[dict]:
    return [{"__key__": f"{prefix}{i:04d}", "jpg": payload(i, "jpg"), "cls": str(i % 5).encode(),
             "seg.png": payload(i, "seg.png")} for i in range(n)]


def from_wds(sample: dict) -> dict:
    return {k: v for k, v in sample.items() if k == "__key__" or not k.startswith("__")}


@pytest.mark.parametrize("prefix", ["set.a/cls_1/img", LONG_DIR + "img", "ünï/çødé/img"])
def test_fastdata_shards_read_by_webdataset_and_tar(tmp_path, prefix):
    samples = make_samples(25, prefix)
    path = tmp_path / "shard-000000.tar"
    write_tar_shard(path, samples)
    got = [from_wds(s) for s in wds.WebDataset(str(path), shardshuffle=False)]
    assert got == samples
    if shutil.which("tar"):
        names = subprocess.run(["tar", "tf", str(path)], check=True, capture_output=True, text=True).stdout.split("\n")
        assert names[:3] == [f"{samples[0]['__key__']}.{f}" for f in ("cls", "jpg", "seg.png")]
        assert len([n for n in names if n]) == 75
    assert TarIndex.build(path) == TarIndex.load(str(path) + ".idx")


@pytest.mark.parametrize("compress", [False, True])
def test_webdataset_shardwriter_output_read_by_fastdata(tmp_path, compress):
    samples = make_samples(30)
    pattern = str(tmp_path / ("wds-%04d.tar.gz" if compress else "wds-%04d.tar"))
    with wds.ShardWriter(pattern, maxcount=12, compress=compress) as sink:
        for s in samples:
            sink.write(dict(s))
    shards = sorted(tmp_path.glob("wds-*"))
    assert len(shards) == 3
    got = []
    for shard in shards:
        if compress:
            with gzip.open(shard, "rb") as f:
                got.extend(iter_tar_stream(f, str(shard)))
            with pytest.raises(ShardError, match=r"wds-\d+\.tar\.gz: is gzip-compressed"):
                TarIndex.build(shard)
        else:
            reader = TarShardReader(shard)  # no sidecar: index built by header scan
            got.extend(reader.iter_range())
            assert reader.read(len(reader) - 1) == got[-1]
            with open(shard, "rb") as f:
                assert list(iter_tar_stream(f, str(shard))) == list(reader.iter_range())
    assert got == samples


def test_webdataset_tarwriter_read_by_fastdata(tmp_path):
    samples = make_samples(10, LONG_DIR + "x")
    path = tmp_path / "w.tar"
    with wds.TarWriter(str(path)) as sink:
        for s in samples:
            sink.write(dict(s))
    reader = TarShardReader(path)
    assert [reader.read(i) for i in range(len(reader))] == samples


@pytest.mark.parametrize("fmt", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT, tarfile.USTAR_FORMAT])
def test_long_names_in_all_tar_formats(tmp_path, fmt):
    """GNU 'L' long names, PAX 'x' path records and ustar name prefixes all resolve to the full key."""
    key = ("d" * 60 + "/" + "e" * 60 + "/x") if fmt == tarfile.USTAR_FORMAT else LONG_DIR * 3 + "x"
    samples = [{"__key__": f"{key}{i}", "jpg": payload(i, "jpg"), "cls": b"1"} for i in range(4)]
    path = tmp_path / "t.tar"
    with tarfile.open(path, "w", format=fmt) as tf:
        if fmt == tarfile.PAX_FORMAT:
            tf.pax_headers = {"comment": "global header"}  # adds a 'g' member
        dirinfo = tarfile.TarInfo("d")
        dirinfo.type = tarfile.DIRTYPE
        tf.addfile(dirinfo)  # non-file members are skipped
        for s in samples:
            for field in ("cls", "jpg"):
                info = tarfile.TarInfo(f"{s['__key__']}.{field}")
                info.size = len(s[field])
                tf.addfile(info, io.BytesIO(s[field]))
    assert list(TarShardReader(path).iter_range()) == samples
    with open(path, "rb") as f:
        assert list(iter_tar_stream(f, str(path))) == samples


@pytest.mark.skipif(shutil.which("tar") is None, reason="needs GNU tar")
def test_gnu_tar_created_archive(tmp_path):
    src = tmp_path / "src" / "train.v1" / "n01"
    src.mkdir(parents=True)
    for i in range(3):
        (src / f"img{i}.jpg").write_bytes(payload(i, "jpg"))
        (src / f"img{i}.cls").write_bytes(b"%d" % i)
    path = tmp_path / "g.tar"
    subprocess.run(["tar", "cf", str(path), "--sort=name", "-C", str(tmp_path / "src"), "train.v1"], check=True)
    got = list(TarShardReader(path).iter_range())
    assert [g["__key__"] for g in got] == [f"train.v1/n01/img{i}" for i in range(3)]
    assert [g["jpg"] for g in got] == [payload(i, "jpg") for i in range(3)]
