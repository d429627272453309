"""Nothing lost silently: trust no metadata (manifest counts, shard identity, HDF5 shapes), report
every skip, name every failure. Test names carry the number of the rule they check."""
from __future__ import annotations

import io
import warnings

import numpy as np
import pytest
from PIL import Image

from fastdata.errors import DecodeError


def jpeg(w: int, h: int, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(buf, format="JPEG", quality=80)
    return buf.getvalue()


def test_12_pillow_bomb_warning_is_visible(monkeypatch):
    from fastdata.decode import SampleDecoder

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # 40x40 = 1600: over the limit, under 2x
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = SampleDecoder()({"__key__": "k", "jpg": jpeg(40, 40)}, shard="s.tar")
    assert out["jpg"].shape == (3, 40, 40)
    assert any(issubclass(w.category, Image.DecompressionBombWarning) for w in caught)


def test_12_max_pixels_refuses_before_decoding():
    from fastdata.decode import ImageDecoder, SampleDecoder

    data = jpeg(64, 48)
    with pytest.raises(DecodeError, match=r"shard-3.tar: sample 'big' field 'jpg'.*64x48 = 3072 pixels exceeds "
                                          r"max_pixels=3000"):
        SampleDecoder(max_pixels=3000)({"__key__": "big", "jpg": data}, shard="shard-3.tar")
    assert SampleDecoder(max_pixels=3072)({"__key__": "ok", "jpg": data}, shard="s")["jpg"].shape == (3, 48, 64)
    assert ImageDecoder(max_pixels=None).pil(data).size == (64, 48)
    for bad in (0, -5, 2.5, True):
        with pytest.raises(ValueError, match="max_pixels must be an int >= 1 or None"):
            ImageDecoder(max_pixels=bad)


def links_tar(tmp_path, name: str = "links.tar", a: bytes = b"AAAA", c: bytes = b"CCCCCC"):
    """GNU-style tar: a.jpg; b.jpg hardlinked to a; c.jpg; d.jpg -> c.jpg; e.jpg and f.jpg leave the archive."""
    import tarfile

    path = tmp_path / name

    def add(tf, info, data=None):
        tf.addfile(info, None if data is None else io.BytesIO(data))

    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tf:
        info = tarfile.TarInfo("a.jpg")
        info.size = len(a)
        add(tf, info, a)
        info = tarfile.TarInfo("b.jpg")
        info.type, info.linkname = tarfile.LNKTYPE, "a.jpg"
        add(tf, info)
        info = tarfile.TarInfo("c.jpg")
        info.size = len(c)
        add(tf, info, c)
        for n, target in (("d.jpg", "c.jpg"), ("e.jpg", "../../etc/passwd"), ("f.jpg", "/etc/hostname")):
            info = tarfile.TarInfo(n)
            info.type, info.linkname = tarfile.SYMTYPE, target
            add(tf, info)
    return path


LINK_SKIPS = [("e.jpg", "symlink to '../../etc/passwd' points outside the archive (refused)"),
              ("f.jpg", "symlink to '/etc/hostname' points outside the archive (refused)")]


def test_4_tar_links_on_random_access_read(tmp_path):
    from fastdata.shards.tar import TarShardReader

    with pytest.warns(UserWarning, match="skipped 2 member"):
        reader = TarShardReader(links_tar(tmp_path))
        assert reader.keys == ("a", "b", "c", "d")
    assert bytes(reader.read(1)["jpg"]) == b"AAAA"  # hardlink: the target's data
    assert bytes(reader.read(3)["jpg"]) == b"CCCCCC"  # symlink inside the archive: followed
    assert list(reader.index.skipped) == LINK_SKIPS


def test_4_tar_links_in_a_stream(tmp_path):
    from fastdata.shards.tar import iter_tar_stream

    skipped: list = []
    with open(links_tar(tmp_path), "rb") as f, pytest.warns(UserWarning, match="skipped 2 member"):
        samples = list(iter_tar_stream(f, "links.tar", skipped))
    assert [(s["__key__"], bytes(s["jpg"])) for s in samples] == [
        ("a", b"AAAA"), ("b", b"AAAA"), ("c", b"CCCCCC"), ("d", b"CCCCCC")]
    assert skipped == LINK_SKIPS


def test_4_tar_links_in_conversion(tmp_path):
    from fastdata.shards.convert import ConvertOptions, convert
    from fastdata.shards.tar import TarShardReader

    a, c = jpeg(8, 8, 1), jpeg(8, 8, 2)
    with pytest.warns(UserWarning, match="skipped 2 member"):
        result = convert(links_tar(tmp_path, a=a, c=c), tmp_path / "out", ConvertOptions(workers=1, progress=False))
    got = {s["__key__"]: bytes(s["jpg"]) for s in TarShardReader(tmp_path / "out" / "shard-000000.tar")}
    assert got == {"a": a, "b": a, "c": c, "d": c}
    assert [(s["source"], s["reason"]) for s in result.manifest.skipped] == [
        (f"links.tar:{n}", r) for n, r in LINK_SKIPS]


def write_set(dest, n_shards: int = 3, per_shard: int = 100, fmt: str = "tar", size: int = 8, sample=None):
    """A manifest folder of ``n_shards`` x ``per_shard`` samples ``s<i>`` with an image array and a label."""
    from fastdata.shards.writer import ShardWriter

    with ShardWriter(dest, format=fmt, max_samples=per_shard) as w:
        for i in range(n_shards * per_shard):
            s = {"__key__": f"s{i:04d}", "cls": i % 10,
                 "img.npy": np.full((3, size, size), i % 251, np.uint8)}
            w.write(sample(i, s) if sample is not None else s)
    return dest


def keys_of(ds) -> list[str]:
    return [s["__key__"] for s in ds]


def edit_manifest(folder, fn) -> None:
    import json

    path = folder / "manifest.json"
    data = json.loads(path.read_text())
    fn(data)
    data["num_samples"] = sum(s["num_samples"] for s in data["shards"])
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("fmt", ["tar", "hdf5"])
def test_2_manifest_undercount_is_an_error_naming_the_shard(tmp_path, fmt):
    from fastdata import ShardedDataset
    from fastdata.errors import ShardError

    if fmt == "hdf5":
        pytest.importorskip("h5py")
    folder = write_set(tmp_path / "d", n_shards=3, per_shard=20, fmt=fmt)
    edit_manifest(folder, lambda m: m["shards"][1].update(num_samples=10))
    ds = ShardedDataset(folder)
    assert len(ds) == 50  # what the manifest says: nothing is opened yet
    name = "shard-000001.tar" if fmt == "tar" else "shard-000001.h5"
    with pytest.raises(ShardError, match=rf"{name}: has 20 samples but the manifest says 10"):
        keys_of(ds)


def test_3_swapped_tar_shards_with_their_index_are_refused(tmp_path):
    import os

    from fastdata import ShardedDataset
    from fastdata.errors import ShardError

    folder = write_set(tmp_path / "d", n_shards=3, per_shard=20)
    for ext in ("", ".idx"):  # swap shards 0 and 2, each with its index; the manifest stays
        a, b = folder / f"shard-000000.tar{ext}", folder / f"shard-000002.tar{ext}"
        os.rename(a, tmp_path / "tmp")
        os.rename(b, a)
        os.rename(tmp_path / "tmp", b)
    with pytest.raises(ShardError, match=r"shard-000000.tar: its index .*shard-000000.tar.idx was written for a "
                                         r"tar with sha256 [0-9a-f]{64} but the manifest says [0-9a-f]{64}; "
                                         r"the shard was replaced"):
        keys_of(ShardedDataset(folder))


def test_3_tar_replaced_under_its_index_is_refused(tmp_path):
    import shutil

    from fastdata import ShardedDataset
    from fastdata.errors import ShardError

    folder = write_set(tmp_path / "d", n_shards=2, per_shard=20)
    # same size, other keys: only the tar is replaced, its (old) index and the manifest stay
    other = write_set(tmp_path / "o", n_shards=1, per_shard=20,
                      sample=lambda i, s: {**s, "__key__": f"t{i:04d}"})
    shutil.copy(other / "shard-000000.tar", folder / "shard-000001.tar")
    with pytest.raises(ShardError, match=r"shard-000001.tar: the tar header at byte offset \d+ is for "
                                         r"'t0000.cls' .* expects 's0020.cls'"):
        keys_of(ShardedDataset(folder))


def test_3_swapped_hdf5_shards_are_refused(tmp_path):
    import os

    pytest.importorskip("h5py")
    from fastdata import ShardedDataset
    from fastdata.errors import ShardError

    folder = write_set(tmp_path / "d", n_shards=2, per_shard=20, fmt="hdf5")
    a, b = folder / "shard-000000.h5", folder / "shard-000001.h5"
    assert a.stat().st_size == b.stat().st_size  # the size check alone cannot tell them apart
    os.rename(a, tmp_path / "tmp")
    os.rename(b, a)
    os.rename(tmp_path / "tmp", b)
    with pytest.raises(ShardError, match=r"shard-000000.h5: was written as shard 'shard-000001.h5', but the "
                                         r"manifest lists it as 'shard-000000.h5'"):
        keys_of(ShardedDataset(folder))


def test_3_swapped_shards_never_reach_a_cached_epoch(tmp_path):
    import os

    from fastdata import ShardedDataset
    from fastdata.errors import ShardError
    from fastdata.transforms import Deterministic

    folder = write_set(tmp_path / "d", n_shards=3, per_shard=10,
                       sample=lambda i, s: {"__key__": s["__key__"], "cls": i, "x.png": png(i)})
    pre = Deterministic(lambda img: img, version="id")
    ds = ShardedDataset(folder, preprocess=pre, cache=tmp_path / "cache")
    assert len(keys_of(ds)) == 30  # fills the cache
    for ext in ("", ".idx"):
        a, b = folder / f"shard-000000.tar{ext}", folder / f"shard-000001.tar{ext}"
        os.rename(a, tmp_path / "tmp")
        os.rename(b, a)
        os.rename(tmp_path / "tmp", b)
    with pytest.raises(ShardError, match="shard-000000.tar: .*the shard was replaced"):
        keys_of(ShardedDataset(folder, preprocess=pre, cache=tmp_path / "cache"))


def png(i: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((6, 6, 3), i % 256, np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def test_6_hdf5_shape_differing_from_the_manifest_is_refused_on_open(tmp_path):
    pytest.importorskip("h5py")
    from fastdata import ShardedDataset
    from fastdata.errors import ShardError
    from fastdata.shards.hdf5 import write_hdf5_shard

    folder = write_set(tmp_path / "d", n_shards=2, per_shard=10, fmt="hdf5", size=32)
    # shard 1 rewritten with (3, 16, 16) images: same keys, manifest untouched except size/sha
    samples = [{"__key__": f"s{i:04d}", "cls": i % 10, "img.npy": np.zeros((3, 16, 16), np.uint8)}
               for i in range(10, 20)]
    info = write_hdf5_shard(folder / "shard-000001.h5", samples)
    edit_manifest(folder, lambda m: m["shards"][1].update(bytes=info.bytes, sha256=info.sha256))
    with pytest.raises(ShardError, match=r"shard-000001.h5: field 'img.npy' has rows of shape \(3, 16, 16\) "
                                         r"uint8, the manifest says \(3, 32, 32\) uint8"):
        keys_of(ShardedDataset(folder))


def test_7_duplicate_keys_across_tars_without_a_manifest(tmp_path):
    from fastdata import ShardedDataset
    from fastdata.errors import SourceError
    from fastdata.shards.tar import write_tar_shard

    for name, first in (("a.tar", 0), ("b.tar", 3)):  # keys 3..5 are in both
        write_tar_shard(tmp_path / name, [{"__key__": f"k{i}", "cls": i} for i in range(first, first + 6)])
        (tmp_path / (name + ".idx")).unlink()  # foreign tars: no sidecar
    with pytest.raises(SourceError, match=r"key 'k3' is in shard .*a.tar and in shard .*b.tar"):
        ShardedDataset([str(tmp_path / "a.tar"), str(tmp_path / "b.tar")])
    with pytest.raises(SourceError, match=r"a.tar is listed twice"):
        ShardedDataset([str(tmp_path / "a.tar"), str(tmp_path / "a.tar")])


def test_8_empty_dataset_error_names_the_path(tmp_path):
    from fastdata import ShardedDataset
    from fastdata.errors import SourceError
    from fastdata.shards.tar import write_tar_shard
    from fastdata.shards.writer import ShardWriter

    with ShardWriter(tmp_path / "empty"):
        pass
    with pytest.raises(SourceError, match=rf"{tmp_path / 'empty' / 'manifest.json'}: the dataset has no samples"):
        ShardedDataset(tmp_path / "empty")
    write_tar_shard(tmp_path / "e.tar", [])
    with pytest.raises(SourceError, match=rf"{tmp_path / 'e.tar'}: the dataset has no samples"):
        ShardedDataset(str(tmp_path / "e.tar"))


def tar_with_a_missing_field(path, n: int = 8, missing: int = 5):
    from fastdata.shards.tar import write_tar_shard

    samples = [{"__key__": f"s{i}", "jpg": jpeg(8, 8, i), **({} if i == missing else {"cls": i % 3})}
               for i in range(n)]
    write_tar_shard(path, samples)
    return path


def test_5_conversion_skips_and_lists_a_sample_missing_a_field(tmp_path):
    from fastdata.shards.convert import ConvertOptions, convert

    src = tar_with_a_missing_field(tmp_path / "src.tar")
    result = convert(src, tmp_path / "out", ConvertOptions(workers=1, progress=False))
    assert result.manifest.num_samples == 7
    assert [(s["source"], s["reason"]) for s in result.manifest.skipped] == [
        ("src.tar[5]", "sample 's5' lacks field(s) ['cls'] (SRC's fields: ['cls', 'jpg'])")]


def test_5_conversion_strict_fails_on_a_missing_field(tmp_path, capsys):
    from fastdata.cli._shard_cmd import tool_main

    src = tar_with_a_missing_field(tmp_path / "src.tar")
    code = tool_main([str(src), str(tmp_path / "out"), "--strict", "--workers", "1", "--quiet"])
    err = capsys.readouterr().err
    assert code == 1
    assert "src.tar[5]: sample 's5' lacks field(s) ['cls']" in err and "(--strict)" in err


def test_5_image_formats_are_alternatives_not_missing_fields():
    from fastdata.shards import missing_fields, required_fields

    groups = required_fields(["cls", "jpg", "png", "seg.png", "json"])
    assert missing_fields({"cls", "png", "seg.png", "json"}, groups) == []
    assert missing_fields({"cls", "json", "jpg"}, groups) == ["seg.png"]
    assert missing_fields({"seg.png"}, groups) == ["cls", "jpg|png", "json"]


def test_8_disk_full_names_shard_and_dest(tmp_path, capsys, monkeypatch):
    import errno

    from fastdata.cli._shard_cmd import tool_main
    from fastdata.shards import _tarwrite as tar_mod

    src = tar_with_a_missing_field(tmp_path / "src.tar", missing=-1)
    real = tar_mod._HashingFile.write

    def full(self, data):
        if self.pos + len(data) > 2048:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(self, data)

    monkeypatch.setattr(tar_mod._HashingFile, "write", full)
    dest = tmp_path / "out"
    code = tool_main([str(src), str(dest), "--workers", "1", "--quiet", "--samples-per-shard", "4"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1
    assert err[-1] == (f"shard.py: error: writing shard-000000.tar into DEST {dest}: "
                       "[Errno 28] No space left on device")


def test_8_disk_full_writing_the_manifest_names_dest(tmp_path, monkeypatch):
    import errno

    from fastdata.errors import ConversionError
    from fastdata.manifest import Manifest
    from fastdata.shards.convert import ConvertOptions, convert

    def full(self, folder):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Manifest, "save", full)
    src = tar_with_a_missing_field(tmp_path / "src.tar", missing=-1)
    with pytest.raises(ConversionError, match=rf"writing manifest.json into DEST {tmp_path / 'out'}: "
                                              r"\[Errno 28\] No space left on device"):
        convert(src, tmp_path / "out", ConvertOptions(workers=1, progress=False))


def _children(pid: int) -> set[int]:
    import os

    out = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                out.add(int(entry))
    return out


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="reads /proc")
def test_9_pool_workers_exit_when_the_converter_is_killed(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    src = tmp_path / "src" / "cat"
    src.mkdir(parents=True)
    for i in range(7):
        (src / f"{i}.png").write_bytes(png(i))
    os.mkfifo(tmp_path / "fifo")
    # an input whose read never ends, so that a worker is busy when the parent dies: 6.png becomes a fifo
    # once the conversion is planned (planning lists a fifo among the inputs as skipped)
    script = ("import os, sys\n"
              "import fastdata.shards.convert as c\n"
              "real = c.plan_conversion\n"
              "def plan(*a, **k):\n"
              "    p = real(*a, **k)\n"
              "    os.replace(sys.argv[3], os.path.join(sys.argv[1], 'cat', '6.png'))\n"
              "    return p\n"
              "c.plan_conversion = plan\n"
              "c.convert(sys.argv[1], sys.argv[2], c.ConvertOptions(workers=2, samples_per_shard=1, progress=False))\n")
    proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "src"), str(tmp_path / "out"),
                             str(tmp_path / "fifo")])
    workers: set[int] = set()
    try:
        deadline = time.monotonic() + 60
        while len(workers) < 2 and time.monotonic() < deadline and proc.poll() is None:
            workers = _children(proc.pid)
            time.sleep(0.05)
        assert len(workers) == 2, "the converter did not start its 2 pool workers"
        time.sleep(0.5)  # let them take jobs (one blocks on the fifo)
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(os.path.exists(f"/proc/{w}") and _alive(w) for w in workers):
            time.sleep(0.1)
        left = [w for w in workers if _alive(w)]
        assert not left, f"pool workers {left} outlived the killed converter"
    finally:
        for w in workers:  # the processes this test started, by pid
            if _alive(w):
                os.kill(w, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def nine_with_a_corrupt_last(tmp_path):
    from fastdata.shards.tar import write_tar_shard

    path = tmp_path / "nine.tar"
    write_tar_shard(path, [{"__key__": f"s{i}", "cls": i, "png": png(i) if i < 8 else b"not an image"}
                           for i in range(9)])
    return path


@pytest.mark.parametrize("workers, batch, drop_last, persistent", [
    (0, 4, False, False), (1, 4, False, False), (2, 4, False, False), (1, 4, True, False), (2, 3, True, True),
    (1, None, False, False), (2, 8, False, True),
])
def test_1_skip_after_a_workers_last_batch_is_reported(tmp_path, workers, batch, drop_last, persistent):
    from fastdata import DataLoader, ShardedDataset

    ds = ShardedDataset(str(nine_with_a_corrupt_last(tmp_path)), on_error="skip")
    loader = DataLoader(ds, batch_size=batch, num_workers=workers, drop_last=drop_last,
                        persistent_workers=persistent)
    for epoch in range(2):
        ds.set_epoch(epoch)
        got = [k for b in loader for k in (b["__key__"] if batch else [b["__key__"]])]
        assert "s8" not in got and len(got) <= 8
        assert [(r["key"], r["epoch"]) for r in ds.skipped] == [("s8", e) for e in range(epoch + 1)]
        assert "not a recognised image" in ds.skipped[-1]["reason"] or "cannot identify" in ds.skipped[-1]["reason"]


def test_1_worker_whose_shard_is_truncated_reports_every_skip(tmp_path):
    from fastdata import DataLoader, ShardedDataset

    folder = write_set(tmp_path / "d", n_shards=2, per_shard=20)
    shard = folder / "shard-000001.tar"
    shard.write_bytes(shard.read_bytes()[:-3000])  # cut: worker 1 yields nothing at all
    ds = ShardedDataset(folder, on_error="skip")
    got = [k for b in DataLoader(ds, batch_size=8, num_workers=2) for k in b["__key__"]]
    assert len(got) == 20
    assert sorted(r["index"] for r in ds.skipped) == list(range(20, 40))  # keys: '#i' (the index is refused)
    assert all(r["shard"].endswith("shard-000001.tar") and "truncated" in r["reason"] for r in ds.skipped)


def test_1_plain_torch_loader_gets_samples_only(tmp_path):
    import torch

    from fastdata import DataLoader, ShardedDataset

    ds = ShardedDataset(str(nine_with_a_corrupt_last(tmp_path)), on_error="skip")
    list(DataLoader(ds, batch_size=4, num_workers=1))  # a fastdata loader first: the flag must not stay set
    got = [k for b in torch.utils.data.DataLoader(ds, batch_size=4, num_workers=1) for k in b["__key__"]]
    assert got == [f"s{i}" for i in range(8)]


def set_with_a_missing_field(tmp_path):
    return write_set(tmp_path / "d", n_shards=1, per_shard=8,
                     sample=lambda i, s: {k: v for k, v in s.items() if not (i == 5 and k == "cls")})


def test_5_missing_field_raises_naming_shard_and_key_by_default(tmp_path):
    from fastdata import DataLoader, ShardedDataset
    from fastdata.errors import MissingFieldError

    folder = set_with_a_missing_field(tmp_path)
    for on_error in ("raise", "skip"):  # on_missing, not on_error, decides
        with pytest.raises(MissingFieldError, match=r"shard-000000.tar: sample 's0005' lacks field\(s\) \['cls'\] "
                                                    r"\(it has \['img.npy'\]\); pass on_missing="):
            list(DataLoader(ShardedDataset(folder, on_error=on_error), batch_size=4))


def test_5_on_missing_skip_and_allow(tmp_path):
    from fastdata import DataLoader, ShardedDataset

    folder = set_with_a_missing_field(tmp_path)
    ds = ShardedDataset(folder, on_missing="skip")
    got = [k for b in DataLoader(ds, batch_size=4, num_workers=1) for k in b["__key__"]]
    assert "s0005" not in got and len(got) == 7
    assert [r["key"] for r in ds.skipped] == ["s0005"] and "lacks field(s) ['cls']" in ds.skipped[0]["reason"]
    allowed = {s["__key__"]: s for s in ShardedDataset(folder, on_missing="allow")}
    assert "cls" not in allowed["s0005"] and allowed["s0004"]["cls"] == 4
    only = [s for s in ShardedDataset(folder, fields=["img.npy"])]  # cls not asked for: not required
    assert len(only) == 8


def test_5_unknown_field_names_list_the_available_ones(tmp_path):
    from fastdata import ShardedDataset

    folder = set_with_a_missing_field(tmp_path)
    with pytest.raises(ValueError, match=r"fields=\['jpeg'\]: \['jpeg'\] not in this dataset; available fields: "
                                         r"\['cls', 'img.npy'\]"):
        ShardedDataset(folder, fields=["jpeg"])
    tar = tmp_path / "d" / "shard-000000.tar"
    with pytest.raises(ValueError, match=r"available fields: \['cls', 'img.npy'\]"):
        ShardedDataset(str(tar), fields=["jpg"])  # no manifest: the tar index knows the fields


def test_4_dataset_lists_members_that_give_no_data(tmp_path):
    from fastdata import ShardedDataset

    with pytest.warns(UserWarning, match="skipped 2 member"):
        ds = ShardedDataset(str(links_tar(tmp_path)), decode=False)
    assert [s["__key__"] for s in ds] == ["a", "b", "c", "d"]
    assert [(r["key"], r["member"], r["reason"]) for r in ds.skipped] == [
        ("e", "e.jpg", LINK_SKIPS[0][1]), ("f", "f.jpg", LINK_SKIPS[1][1])]


def mostly_corrupt(tmp_path, bad: int = 6, n: int = 20):
    from fastdata.shards.tar import write_tar_shard

    path = tmp_path / "bad.tar"
    write_tar_shard(path, [{"__key__": f"s{i:02d}", "cls": i, "png": png(i) if i >= bad else b"junk"}
                           for i in range(n)])
    return path


@pytest.mark.parametrize("workers", [0, 2])
def test_11_max_skips_count_raises_with_the_skipped_samples(tmp_path, workers):
    from fastdata import DataLoader, ShardedDataset
    from fastdata.errors import SkipBudgetError

    ds = ShardedDataset(str(mostly_corrupt(tmp_path)), on_error="skip", max_skips=3)
    with pytest.raises(SkipBudgetError, match=r"samples skipped in this pass over epoch 0: more than max_skips=3 "
                                              r"allows \(3 samples\); skipped: .*bad.tar: 's0\d'") as info:
        list(DataLoader(ds, batch_size=2, num_workers=workers))
    assert len(info.value.skipped) >= 4 and all(r["key"] < "s06" for r in info.value.skipped)
    ok = ShardedDataset(str(mostly_corrupt(tmp_path)), on_error="skip", max_skips=6)
    for _ in range(3):  # the budget is per pass: 6 skips each time is fine
        assert len([k for b in DataLoader(ok, batch_size=2, num_workers=workers) for k in b["__key__"]]) == 14


def test_11_max_skips_fraction(tmp_path):
    from fastdata import ShardedDataset
    from fastdata.errors import SkipBudgetError

    with pytest.raises(SkipBudgetError, match=r"max_skips=0.25 allows \(5 0.25 of the 20 samples\)"):
        list(ShardedDataset(str(mostly_corrupt(tmp_path)), on_error="skip", max_skips=0.25))
    assert len(list(ShardedDataset(str(mostly_corrupt(tmp_path)), on_error="skip", max_skips=0.3))) == 14
    for bad in (-1, 1.0, 0.0, "3", True):
        with pytest.raises(ValueError, match="max_skips must be None"):
            ShardedDataset(str(mostly_corrupt(tmp_path)), max_skips=bad)


def test_12_dataset_max_pixels(tmp_path):
    from fastdata import ShardedDataset

    ds = ShardedDataset(str(nine_with_a_corrupt_last(tmp_path)), on_error="skip", max_pixels=35)  # 6x6 = 36
    assert list(ds) == []
    assert all("exceeds max_pixels=35" in r["reason"] for r in ds.skipped[:8])
