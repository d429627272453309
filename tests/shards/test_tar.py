"""Tar shards: deterministic writing, sidecar vs scanned index, random access, streaming (plain and
gzipped), and tar files that are not what they seem (concatenated, compressed, sparse, linked)."""
from __future__ import annotations

import io
import multiprocessing as mp
import os
import pickle
import tarfile

import numpy as np
import pytest

from fastdata.dataset import ShardedDataset
from fastdata.errors import FastdataError, ShardError
from fastdata.shards._keys import check_key, encode_value, member_name, split_member_name
from fastdata.shards.convert import convert
from fastdata.shards.tar import TarIndex, TarShardReader, iter_tar_stream, write_tar_shard
from tests.helpers.loopback_server import LoopbackServer, make_shard_set
from tests.helpers.sources import opts, small_tar


pytestmark = pytest.mark.filterwarnings("ignore:Unclosed:ResourceWarning")


def payload(i: int, field: str = "jpg") -> bytes:
    """Predictable bytes derived from the sample index (sizes cross 512-byte block edges)."""
    n = (i * 397 + len(field) * 31) % 3000
    return bytes((i * 7 + j + len(field)) % 256 for j in range(n))


def make_samples(n: int, prefix: str = "train/n01.x/s") -> list[dict]:
    return [{"__key__": f"{prefix}{i:05d}", "jpg": payload(i), "cls": i % 10, "seg.png": payload(i, "seg.png")}
            for i in range(n)]


def expected(sample: dict) -> dict:
    return {k: (v if k == "__key__" else encode_value(k, v)) for k, v in sample.items()}


@pytest.fixture()
def shard(tmp_path):
    samples = make_samples(40)
    info = write_tar_shard(tmp_path / "shard-000000.tar", samples)
    return tmp_path / "shard-000000.tar", samples, info


def test_round_trip_byte_exact(shard):
    path, samples, info = shard
    reader = TarShardReader(path)
    assert len(reader) == info.num_samples == 40
    assert list(reader.keys) == [s["__key__"] for s in samples]
    assert list(reader.iter_range()) == [expected(s) for s in samples]
    for i in (17, 0, 39, 5):  # random access
        assert reader.read(i) == expected(samples[i])
    assert info.bytes == os.path.getsize(path) and info.index == "shard-000000.tar.idx"


def test_sidecar_index_equals_header_scan(shard):
    path, _, _ = shard
    assert TarIndex.load(str(path) + ".idx") == TarIndex.build(path)


def test_read_selected_fields_and_ranges(shard):
    path, samples, _ = shard
    reader = TarShardReader(path)
    assert reader.read(3, fields={"cls"}) == {"__key__": samples[3]["__key__"], "cls": b"3"}
    assert reader.read(3, fields="cls") == reader.read(3, fields=["cls"])  # a str is one field name
    got = list(reader.iter_range(10, 13, fields=["jpg"]))
    assert [g["jpg"] for g in got] == [payload(i) for i in range(10, 13)]
    with pytest.raises(IndexError, match="sample index 40 out of range"):
        reader.read(40)
    with pytest.raises(IndexError, match="range 5:41"):
        list(reader.iter_range(5, 41))


def test_deterministic_output(tmp_path):
    a = write_tar_shard(tmp_path / "a.tar", make_samples(25))
    b = write_tar_shard(tmp_path / "b.tar", make_samples(25))
    assert a.sha256 == b.sha256
    assert (tmp_path / "a.tar").read_bytes() == (tmp_path / "b.tar").read_bytes()
    assert (tmp_path / "a.tar.idx").read_bytes() == (tmp_path / "b.tar.idx").read_bytes()


def test_tar_members_are_standard(shard):
    path, samples, _ = shard
    with tarfile.open(path) as tf:
        members = tf.getmembers()
        assert [m.name for m in members[:3]] == [f"{samples[0]['__key__']}.{f}" for f in ("cls", "jpg", "seg.png")]
        assert all(m.mtime == 0 and m.uid == 0 and m.uname == "" and m.mode == 0o444 for m in members)
        assert tf.extractfile(members[4]).read() == payload(1)


def test_without_sidecar_builds_index(shard):
    path, samples, _ = shard
    os.remove(str(path) + ".idx")
    assert TarShardReader(path).read(7) == expected(samples[7])


def test_stream_reader(shard):
    path, samples, _ = shard
    with open(path, "rb") as f:
        assert list(iter_tar_stream(f, str(path))) == [expected(s) for s in samples]


def test_key_splitting_rules():
    assert split_member_name("train/n0144.x/img001.seg.png") == ("train/n0144.x/img001", "seg.png")
    assert member_name("a.b/c.d/e", "img.npy") == "a.b/c.d/e.img.npy"
    for bad, why in [("img.001", "contains a dot"), ("", "empty"), ("/abs", "starts with '/'"),
                     ("a/../b", "'..'"), ("__meta", "reserved"), ("a\x00b", "NUL"), ("a//b", "empty")]:
        with pytest.raises(ValueError, match=why):
            check_key(bad)


def test_writer_rejects_ambiguous_and_duplicate_keys(tmp_path):
    with pytest.raises(ValueError, match=r"invalid sample key 'dir/img\.001'"):
        write_tar_shard(tmp_path / "x.tar", [{"__key__": "dir/img.001", "jpg": b"x"}])
    with pytest.raises(ValueError, match="duplicate key 'k1'"):
        write_tar_shard(tmp_path / "x.tar", [{"__key__": "k1", "jpg": b"x"}, {"__key__": "k1", "jpg": b"y"}])
    with pytest.raises(TypeError, match="cannot encode field 'jpg' of sample 'k'"):
        write_tar_shard(tmp_path / "x.tar", [{"__key__": "k", "jpg": object()}])
    assert not list(tmp_path.iterdir())  # nothing left behind


def test_encode_values():
    arr = np.arange(6, dtype=np.int16).reshape(2, 3)
    assert np.array_equal(np.load(io.BytesIO(encode_value("x.npy", arr))), arr)
    assert encode_value("meta.json", {"b": 1, "a": [1]}) == b'{"a": [1], "b": 1}'
    assert encode_value("txt", "héllo") == "héllo".encode()
    assert encode_value("cls", 7) == b"7"
    with pytest.raises(TypeError, match="'arr'"):
        encode_value("arr", arr)


def test_truncated_tar_names_shard_and_offset(shard):
    path, _, _ = shard
    data = path.read_bytes()
    cut = tmp = path.with_name("cut.tar")
    tmp.write_bytes(data[:5000])
    with pytest.raises(ShardError, match=r"cut\.tar: truncated tar: member data at byte offset \d+"):
        TarIndex.build(cut)
    with open(cut, "rb") as f, pytest.raises(ShardError, match=r"cut\.tar.*byte offset \d+"):
        list(iter_tar_stream(f, str(cut)))
    tmp.write_bytes(data[:1024])  # cut at a member boundary: looks like a shorter tar to `tar tf`
    with pytest.raises(ShardError, match=r"cut\.tar: truncated tar: ends at byte offset 1024 without"):
        TarIndex.build(cut)
    with open(cut, "rb") as f, pytest.raises(ShardError, match=r"cut\.tar: truncated tar: ends at byte offset 1024"):
        list(iter_tar_stream(f, str(cut)))
    tmp.write_bytes(data[:1100])  # cut inside a header
    with pytest.raises(ShardError, match=r"header at byte offset \d+ is cut off"):
        TarIndex.build(cut)


def test_stale_sidecar_detected(shard):
    path, _, _ = shard
    with open(path, "ab") as f:
        f.write(bytes(512))
    with pytest.raises(ShardError, match="shard-000000.tar.*changed or truncated"):
        len(TarShardReader(path))


def test_corrupt_header_checksum(shard):
    path, _, _ = shard
    data = bytearray(path.read_bytes())
    data[1024 + 5] ^= 0xFF  # inside the second member's header name
    path.write_bytes(bytes(data))
    with pytest.raises(ShardError, match=r"shard-000000\.tar: bad tar header checksum at byte offset 1024"):
        TarIndex.build(path)


def test_non_consecutive_key_rejected(tmp_path):
    path = tmp_path / "bad.tar"
    with tarfile.open(path, "w") as tf:
        for name in ("a.jpg", "b.jpg", "a.cls"):
            info = tarfile.TarInfo(name)
            info.size = 1
            tf.addfile(info, io.BytesIO(b"x"))
    with pytest.raises(ShardError, match=r"bad\.tar: key 'a' reappears at byte offset 2048"):
        TarIndex.build(path)


def _child_read(reader: TarShardReader, i: int, queue) -> None:
    queue.put(reader.read(i))


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_reader_pickles_and_works_in_child(shard, method):
    path, samples, _ = shard
    reader = TarShardReader(path)
    reader.read(0)  # opens the map in the parent first
    clone = pickle.loads(pickle.dumps(reader))
    assert clone.read(9) == expected(samples[9])
    ctx = mp.get_context(method)
    queue = ctx.Queue()
    proc = ctx.Process(target=_child_read, args=(reader, 11, queue))
    proc.start()
    got = queue.get(timeout=60)
    proc.join(timeout=60)
    assert proc.exitcode == 0 and got == expected(samples[11])


def test_corrupt_sidecar_index(shard):
    path, _, _ = shard
    idx = path.with_name(path.name + ".idx")
    data = bytearray(idx.read_bytes())
    data[-3] ^= 0x10
    idx.write_bytes(bytes(data))
    with pytest.raises(ShardError, match=r"shard-000000\.tar\.idx: not a valid fastdata tar index: .*checksum"):
        len(TarShardReader(path))
    idx.write_bytes(b"garbage")
    with pytest.raises(ShardError, match="bad magic"):
        TarIndex.load(idx)


def test_concatenated_tars_are_refused_not_read_as_the_first(tmp_path):
    """`cat a.tar b.tar > ab.tar` leaves a.tar's end-of-archive blocks in the middle: readers
    stopped there and served a.tar's samples only, silently losing b.tar's (tar and webdataset
    stop there too). It is now a ShardError naming the tar and the offset."""
    from fastdata.shards.tar import TarIndex, iter_tar_stream

    a = small_tar(tmp_path / "a.tar", ["a0", "a1"])
    b = small_tar(tmp_path / "b.tar", ["b0", "b1"])
    ab = tmp_path / "ab.tar"
    ab.write_bytes(a.read_bytes() + b.read_bytes())
    with pytest.raises(ShardError, match=r"ab\.tar: .*byte offset \d+.*concatenated"):
        TarIndex.build(ab)
    with pytest.raises(ShardError, match=r"ab\.tar: .*concatenated"):
        list(iter_tar_stream(io.BytesIO(ab.read_bytes()), "ab.tar"))
    with pytest.raises(FastdataError, match=r"ab\.tar"):
        convert(ab, tmp_path / "out", opts())
    # a plain tar (zero padding to a whole record after its end) still reads in full
    assert TarIndex.build(a).keys == ("a0", "a1")
    assert [s["__key__"] for s in iter_tar_stream(io.BytesIO(a.read_bytes()), "a.tar")] == ["a0", "a1"]


def test_bytes_after_the_end_of_a_tar_that_are_not_a_header_are_ignored(tmp_path):
    """Trailing garbage that is no tar header is ignored, as tar ignores it."""
    from fastdata.shards.tar import TarIndex

    a = small_tar(tmp_path / "a.tar", ["a0"])
    t = tmp_path / "t.tar"
    t.write_bytes(a.read_bytes() + b"not a tar header".ljust(512, b"x"))
    assert TarIndex.build(t).keys == ("a0",)


def test_bytes_after_a_gzip_stream_holding_a_tar_are_still_ignored(tmp_path):
    """The concatenation check reads on after the end-of-archive blocks: what a decompressor then
    raises (trailing garbage after the gzip stream) must not fail a tar whose members were all read."""
    import gzip

    from fastdata.shards.tar import iter_tar_stream

    raw = small_tar(tmp_path / "a.tar", ["a0", "a1"]).read_bytes()
    stream = gzip.open(io.BytesIO(gzip.compress(raw) + b"garbage!"))
    assert [s["__key__"] for s in iter_tar_stream(stream, "a.tar.gz")] == ["a0", "a1"]


@pytest.mark.parametrize("kind", ["bz2", "lzma"])
def test_a_compressed_tar_named_tar_says_so(tmp_path, kind):
    """`tar --xz -cf x.tar` (or bzip2, zstd): 'truncated tar: header at byte offset 0 is cut off'."""
    import importlib

    from fastdata.shards.tar import TarIndex

    raw = small_tar(tmp_path / "a.tar", ["a0"]).read_bytes()
    packed = tmp_path / "x.tar"
    packed.write_bytes(importlib.import_module(kind).compress(raw))
    with pytest.raises(ShardError, match=r"x\.tar: is (bzip2|xz)-compressed"):
        TarIndex.build(packed)


def _tarfile_shard(path, samples):
    """``samples`` written by Python's tarfile (another tool: no sidecar index)."""
    import tarfile

    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for sample in samples:
            for fld in sorted(k for k in sample if k != "__key__"):
                data = str(sample[fld]).encode()
                info = tarfile.TarInfo(f"{sample['__key__']}.{fld}")
                info.size, info.mtime, info.mode = len(data), 0, 0o444
                tar.addfile(info, io.BytesIO(data))


def test_stale_sidecar_beside_a_rewritten_tar_is_refused(tmp_path):
    """Read without a manifest, a sidecar left beside a same-size tar rewritten by another tool
    paired every key with another sample's data, silently."""
    import fastdata
    from fastdata.shards.tar import TarShardReader, write_tar_shard

    samples = [{"__key__": f"k{i}", "txt": f"value-{i}", "cls": i} for i in range(4)]
    shard = tmp_path / "x.tar"
    write_tar_shard(shard, samples)
    size = shard.stat().st_size
    _tarfile_shard(shard, samples[::-1])  # same members, other order; x.tar.idx stays
    assert shard.stat().st_size == size
    with pytest.raises(ShardError, match=r"x\.tar: the tar header .*delete it"):
        len(TarShardReader(shard))
    with pytest.raises(ShardError, match=r"x\.tar"):
        fastdata.ShardedDataset([str(shard)])
    (tmp_path / "x.tar.idx").unlink()  # as the message says: a header scan reads it right
    got = {s["__key__"]: s["txt"] for s in fastdata.ShardedDataset([str(shard)])}
    assert got == {f"k{i}": f"value-{i}" for i in range(4)}


def test_sidecar_of_a_tar_with_links_is_accepted(tmp_path):
    """A scanned index of a foreign tar whose sample starts with a hardlink points at the link
    target's data (after the target's header): the header check defers to a full scan."""
    import tarfile

    from fastdata.shards.tar import TarIndex, TarShardReader

    shard = tmp_path / "links.tar"
    with tarfile.open(shard, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in (("a.cls", b"1"), ("a.txt", b"AAAA")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for name in ("b.cls", "c.cls", "d.cls"):
            link = tarfile.TarInfo(name)
            link.type, link.linkname = tarfile.LNKTYPE, "a.cls"
            tar.addfile(link)
    index = TarIndex.build(shard)
    index.save(str(shard) + ".idx")
    reader = TarShardReader(shard)
    assert reader.keys == ("a", "b", "c", "d")
    assert [bytes(reader.read(i)["cls"]) for i in range(4)] == [b"1"] * 4


def test_pax_sparse_member_is_refused_not_read_as_its_sparse_map(tmp_path):
    """GNU tar --format=posix -S stores a sparse file as a regular member named
    './GNUSparseFile.N/<name>' holding a sparse map: it was read as sample './GNUSparseFile.N/a'
    with that map as its data."""
    import tarfile

    from fastdata.shards.tar import TarIndex, iter_tar_stream

    shard = tmp_path / "sparse.tar"
    with tarfile.open(shard, "w", format=tarfile.PAX_FORMAT) as tar:
        data = b"1\n0\n512\n" + bytes(503) + b"hello"
        info = tarfile.TarInfo("./GNUSparseFile.7/a.bin")
        info.size = len(data)
        info.pax_headers = {"GNU.sparse.major": "1", "GNU.sparse.minor": "0", "GNU.sparse.name": "a.bin",
                            "GNU.sparse.realsize": "2097152"}
        tar.addfile(info, io.BytesIO(data))
    with pytest.raises(ShardError, match=r"sparse\.tar: GNU sparse member 'a\.bin' at byte offset \d+ is not"):
        TarIndex.build(shard)
    with pytest.raises(ShardError, match="sparse member 'a.bin'"):
        list(iter_tar_stream(io.BytesIO(shard.read_bytes()), "sparse.tar"))


def test_a_corrupt_gzip_stream_is_a_shard_error_naming_the_shard(tmp_path):
    # zlib.error (a corrupt deflate stream inside a .tar.gz) is neither an OSError nor an EOFError: it escaped
    # as a bare "Error -3 while decompressing data: invalid stored block lengths", naming no shard, and ended a
    # streaming epoch even under on_error="skip".
    import gzip
    import io

    import numpy as np

    from fastdata.errors import ShardError
    from fastdata.shards.tar import iter_tar_stream

    raw = bytearray(gzip.compress(np.random.default_rng(0).bytes(3000)))  # any payload: the stream is bad
    raw[12:] = np.random.default_rng(1).bytes(len(raw) - 12)
    with pytest.raises(ShardError, match=r"https://h/x\.tar\.gz: cannot read tar header at byte offset 0"):
        list(iter_tar_stream(gzip.GzipFile(fileobj=io.BytesIO(bytes(raw)), mode="rb"), "https://h/x.tar.gz"))


def test_tar_urls_with_upper_case_suffixes_stream_and_a_gzip_named_tar_says_so(tmp_path):
    # "https://h/ds/B.TAR" was taken for a folder URL (its manifest.json: HTTP 404); "A.TAR.GZ" was read as a plain
    # tar; a gzip file named .tar said "truncated tar: header at byte offset 0 is cut off after 330 of 512 bytes".
    import gzip
    import io

    from fastdata.errors import ShardError
    from fastdata.shards.tar import iter_tar_stream

    assert ShardedDataset("https://data.invalid/ds/B.TAR").streaming  # no request made
    make_shard_set(tmp_path / "www" / "ds", 4, 4, payload=30, seed=1)
    raw = (tmp_path / "www" / "ds" / "shard-000000.tar").read_bytes()
    (tmp_path / "www" / "ds" / "A.TAR.GZ").write_bytes(gzip.compress(raw))
    with LoopbackServer(tmp_path / "www", max_requests=10, lifetime=60) as srv:
        assert [s["__key__"] for s in ShardedDataset([f"{srv.url}/ds/A.TAR.GZ"], decode=False)] == \
            [f"k{i:05d}" for i in range(4)]
    with pytest.raises(ShardError, match=r"https://h/c\.tar: is gzip-compressed"):
        list(iter_tar_stream(io.BytesIO(gzip.compress(raw)), "https://h/c.tar"))
    (tmp_path / "B.TAR").write_bytes(raw)  # a local one too ("only uncompressed .tar shards can be read ...")
    assert len(list(ShardedDataset([str(tmp_path / "B.TAR")], decode=False))) == 4
