"""What a conversion reads as SRC: image folders (class folders, odd file names, links, FIFOs), tar
folders, npz files, HDF5, a fastdata folder; what it lists instead of reading."""
from __future__ import annotations

import io
import os
import tarfile

import numpy as np
import pytest

from fastdata.errors import ShardError, SourceError
from fastdata.manifest import Manifest
from fastdata.shards.convert import ConversionError, convert
from fastdata.shards.reader import verify
from tests.helpers.sources import image_folder, interrupted_convert, opts, pattern_png, small_tar


def test_unfinished_conversion_is_not_a_source(tmp_path):
    """A DEST whose conversion was interrupted (no manifest yet, progress records left) is not
    read as a complete folder of tar shards: converting it would silently lose the missing shards."""
    out = tmp_path / "out"
    convert(image_folder(tmp_path / "src"), out, opts(samples_per_shard=2))
    (out / "manifest.json").unlink()
    (out / ".fastdata-progress").mkdir()  # what an interrupted run leaves (its records inside)
    (out / "shard-000002.tar").unlink()  # the shard it did not get to
    (out / "shard-000002.tar.idx").unlink()
    with pytest.raises(SourceError, match=r"out.*did not finish"):
        convert(out, tmp_path / "again", opts())
    assert not (tmp_path / "again" / "manifest.json").exists()


@pytest.mark.parametrize("fmt, files", [("tar", (".tar", ".tar.idx")), ("hdf5", (".h5",))])
def test_converting_a_folder_with_swapped_shards_is_refused(tmp_path, fmt, files):
    """A dataset refuses a folder whose shards were swapped; converting it went through silently
    and wrote their samples under a new manifest with fresh checksums."""
    src = tmp_path / "src"
    convert(image_folder(tmp_path / "imgs"), src, opts(format=fmt, samples_per_shard=2))
    for suffix in files:
        one, two = src / f"shard-000001{suffix}", src / f"shard-000002{suffix}"
        one.rename(tmp_path / "tmp")
        two.rename(one)
        (tmp_path / "tmp").rename(two)
    with pytest.raises(ShardError, match=r"shard-000001\.(tar|h5): .*replaced or changed"):
        convert(src, tmp_path / "out", opts())
    assert not (tmp_path / "out" / "manifest.json").exists()


def _latin1_folder(tmp_path):
    src = image_folder(tmp_path / "src", n=2)
    try:
        (src / "a" / os.fsdecode(b"caf\xe9.png")).write_bytes(pattern_png(7))  # a Latin-1 file name
        (src / "a" / os.fsdecode(b"notes-\xe9.txt")).write_text("not an image")
    except (OSError, UnicodeError):
        pytest.skip("this file system refuses file names that are not UTF-8")
    return src


def test_file_names_that_are_not_utf8_convert_to_tar(tmp_path):
    """Before: every shard written, then manifest.json failed with "'utf-8' codec can't encode
    character '\\udce9'", naming nothing; each rerun failed the same way."""
    import fastdata

    src = _latin1_folder(tmp_path)
    result = convert(src, tmp_path / "out", opts())
    assert result.manifest.num_samples == 3
    assert [s["source"] for s in Manifest.load(tmp_path / "out").skipped] == [os.fsdecode(b"a/notes-\xe9.txt")]
    assert verify(tmp_path / "out") == []
    keys = {s["__key__"] for s in fastdata.ShardedDataset(str(tmp_path / "out"))}
    assert os.fsdecode(b"a/caf\xe9") in keys
    assert convert(src, tmp_path / "out", opts()).complete  # the rerun recognises it


def test_file_names_that_are_not_utf8_are_refused_for_hdf5_naming_the_file(tmp_path):
    from fastdata.shards.hdf5 import write_hdf5_shard

    src = _latin1_folder(tmp_path)
    with pytest.raises(ConversionError, match=r"caf.*\.png: key .* is not valid UTF-8"):
        convert(src, tmp_path / "out", opts(format="hdf5"))
    key = os.fsdecode(b"caf\xe9")
    with pytest.raises(ValueError, match=r"key 'caf\\udce9' in shard .*x\.h5 is not valid UTF-8"):
        write_hdf5_shard(tmp_path / "x.h5", [{"__key__": key, "cls": 1}])
    assert not (tmp_path / "x.h5").exists() and not (tmp_path / "x.h5.tmp").exists()


def test_tar_folder_lists_what_it_does_not_read(tmp_path):
    """Subfolders (more shards?) and other files of a tar folder SRC were passed over silently."""
    wds = tmp_path / "wds"
    convert(image_folder(tmp_path / "imgs"), wds, opts(samples_per_shard=3))
    (wds / "manifest.json").unlink()  # a plain folder of tar shards (+ sidecars)
    (wds / "more").mkdir()
    (wds / "shard-000001.tar").rename(wds / "more" / "shard-000001.tar")
    (wds / "README.txt").write_text("about")
    manifest = convert(wds, tmp_path / "out", opts()).manifest
    assert manifest.num_samples == 3
    assert sorted(s["source"] for s in manifest.skipped) == ["README.txt", "more/", "shard-000001.tar.idx"]
    with pytest.raises(ConversionError, match=r"README\.txt.*--strict"):
        convert(wds, tmp_path / "strict", opts(strict=True))


def test_tar_folder_with_compressed_shards_beside_plain_ones_is_refused(tmp_path):
    """Only the plain .tar files were converted; the .tar.gz ones were left out silently."""
    import gzip

    wds = tmp_path / "wds"
    convert(image_folder(tmp_path / "imgs"), wds, opts(samples_per_shard=3))
    (wds / "manifest.json").unlink()
    (wds / "shard-000001.tar.gz").write_bytes(gzip.compress((wds / "shard-000001.tar").read_bytes()))
    (wds / "shard-000001.tar").unlink()
    with pytest.raises(SourceError, match=r"shard-000001\.tar\.gz.*decompress"):
        convert(wds, tmp_path / "out", opts())


def test_class_folder_without_images_is_listed_and_part_of_the_plan(tmp_path, monkeypatch):
    """An empty class folder (a macOS '__MACOSX' of hidden files, say) shifts every label after it.
    It was neither listed nor part of the plan: a resume kept shards labelled the old way beside
    new ones labelled the new way, and a finished conversion was reported complete."""
    from fastdata.shards.tar import TarShardReader

    src = image_folder(tmp_path / "src")
    interrupted_convert(monkeypatch, src, tmp_path / "out", opts(samples_per_shard=2), after=1)
    (src / "0-new").mkdir()  # sorts first: every class index moves up by one
    (src / "0-new" / ".hidden.png").write_bytes(pattern_png(9))
    with pytest.raises(ConversionError, match="different arguments or inputs"):
        convert(src, tmp_path / "out", opts(samples_per_shard=2))
    manifest = convert(src, tmp_path / "out", opts(samples_per_shard=2, overwrite=True)).manifest
    assert manifest.extra["source"]["classes"] == ["0-new", "a", "b"]
    assert {"source": "0-new/", "reason": "class folder without image files (its class index 0 is kept: "
            "classes are the sorted subfolders)"} in manifest.skipped
    labels = {int(bytes(s["cls"])) for shard in manifest.shards
              for s in TarShardReader(tmp_path / "out" / shard.name)}
    assert labels == {1, 2}
    (src / "0-new").rename(src / "z-new")  # a finished conversion: the same, not "complete"
    with pytest.raises(ConversionError, match="different arguments or inputs"):
        convert(src, tmp_path / "out", opts(samples_per_shard=2))


def test_hdf5_source_with_a_json_value_that_is_not_json_skips_that_sample_naming_it(tmp_path):
    """Before: the conversion failed with "'utf-8' codec can't decode byte 0xff in position 0",
    naming no file, sample or field."""
    import h5py

    from fastdata.shards.hdf5 import write_hdf5_shard

    src = tmp_path / "src"
    src.mkdir()
    write_hdf5_shard(src / "a.h5", [{"__key__": f"k{i}", "meta.json": {"i": i}} for i in range(3)])
    with h5py.File(src / "a.h5", "r+") as f:
        f["meta.json"][1] = np.frombuffer(b"\xff{not json", np.uint8)
    manifest = convert(src, tmp_path / "out", opts()).manifest
    assert manifest.num_samples == 2
    assert [s["source"] for s in manifest.skipped] == ["a.h5[1]"]
    assert "field 'meta.json' of sample 'k1' is not valid json" in manifest.skipped[0]["reason"]
    with pytest.raises(ConversionError, match=r"a\.h5\[1\]: field 'meta.json' of sample 'k1'.*--strict"):
        convert(src, tmp_path / "strict", opts(strict=True))


def _png() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (4, 3), (200, 10, 10)).save(buf, format="PNG")
    return buf.getvalue()


PNG = _png()


def test_npz_keys_that_are_not_utf8_are_a_source_error_naming_the_row(tmp_path):
    """A bytes `__key__` array with a non-UTF-8 entry failed with a bare UnicodeDecodeError."""
    src = tmp_path / "k.npz"
    np.savez(src, x=np.zeros((2, 3)), __key__=np.array([b"a", b"\xff"], dtype="S2"))
    with pytest.raises(SourceError, match=r"k\.npz: __key__\[1\] .*not UTF-8"):
        convert(src, tmp_path / "out", opts())


def test_hdf5_from_a_tar_mixing_image_types_is_refused_at_planning(tmp_path):
    """Tar samples holding a 'jpg' or a 'png' (either satisfies the sample's image) passed planning
    for --format hdf5, whose every sample needs every field; the first shard job then failed with
    a ValueError naming a DEST shard. Now refused before anything is written, naming SRC and the
    fields, as for an image folder. Tar output and samples holding both still convert."""
    from fastdata.shards.convert import plan_conversion

    def tar(path, members):
        with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as t:
            for name in members:
                info = tarfile.TarInfo(name)
                info.size = 1
                t.addfile(info, io.BytesIO(b"1"))
        return path

    mixed = tar(tmp_path / "mixed.tar", ["a.cls", "a.jpg", "b.cls", "b.png"])
    with pytest.raises(ConversionError, match=r"mixed\.tar.*\['jpg', 'png'\].*--format tar or --resize"):
        convert(mixed, tmp_path / "h5", opts(format="hdf5", check="header"))
    assert not (tmp_path / "h5").exists()
    both = tar(tmp_path / "both.tar", ["a.jpg", "a.png", "b.jpg", "b.png"])
    assert [f.name for f in plan_conversion(both, opts(format="hdf5")).fields] == ["jpg", "png"]
    # a second image field of its own (not an alternative) may be absent: those samples are skipped, listed
    seg = tar(tmp_path / "seg.tar", ["a.jpg", "a.seg.png", "b.jpg"])
    assert [f.name for f in plan_conversion(seg, opts(format="hdf5")).fields] == ["jpg", "seg.png"]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs mkfifo")
def test_a_fifo_named_like_an_image_is_skipped_not_opened(tmp_path):
    """A FIFO (or device) named `x.jpg` in an image folder was planned as an image, and reading it
    blocked the conversion forever. It is now skipped and listed at planning."""
    from fastdata.shards.convert import plan_conversion

    (tmp_path / "src" / "cat").mkdir(parents=True)
    (tmp_path / "src" / "cat" / "a.png").write_bytes(PNG)
    os.mkfifo(tmp_path / "src" / "cat" / "b.jpg")
    plan = plan_conversion(tmp_path / "src", opts())
    assert plan.listing.keys == ["cat/a"]
    assert plan.listing.skipped == [{"source": "cat/b.jpg", "reason": "not a regular file (a fifo)"}]


def test_tar_folder_lists_a_broken_symlink_and_a_fifo_it_does_not_read(tmp_path):
    """A folder of tar shards (here symlinks to them, one broken: its disk is not mounted) converted
    without the broken one and the fifo, and listed neither: samples lost without a word."""
    from fastdata.shards.convert import plan_conversion

    src = tmp_path / "src"
    src.mkdir()
    small_tar(tmp_path / "a.tar", ["a0", "a1"])
    (src / "a.tar").symlink_to(tmp_path / "a.tar")
    (src / "b.tar").symlink_to(tmp_path / "gone" / "b.tar")
    if hasattr(os, "mkfifo"):
        os.mkfifo(src / "c.tar")
    plan = plan_conversion(src, opts())
    assert plan.listing.keys == ["a0", "a1"]
    skipped = {s["source"]: s["reason"] for s in plan.listing.skipped}
    assert "b.tar" in skipped and "broken symlink" in skipped["b.tar"]
    assert not hasattr(os, "mkfifo") or "fifo" in skipped["c.tar"]
    with pytest.raises(ConversionError, match=r"b\.tar: .*broken symlink.*--strict"):
        convert(src, tmp_path / "out", opts(strict=True))


def test_a_broken_class_folder_symlink_is_an_error_not_a_label_shift(tmp_path):
    """`src/b -> /mnt/other/b` with that disk not mounted: class b was dropped without a word and
    class c took its label 1. Whether it is a class cannot be told: a SourceError naming it."""
    from fastdata.shards.convert import plan_conversion

    src = tmp_path / "src"
    for cls in ("a", "c"):
        (src / cls).mkdir(parents=True)
        (src / cls / "x.png").write_bytes(PNG)
    (src / "b").symlink_to(tmp_path / "unmounted" / "b")
    with pytest.raises(SourceError, match=r"src/b: .*broken symlink.*labels"):
        plan_conversion(src, opts())


def test_resharding_a_fastdata_folder_keeps_its_class_names(tmp_path):
    """The 'cls' labels' names live in manifest.json under extra.source.classes; converting the
    folder again (tar -> HDF5, other shard sizes) wrote a manifest without them."""
    from fastdata import Manifest

    src = tmp_path / "src"
    for cls in ("cat", "dog"):
        (src / cls).mkdir(parents=True)
        (src / cls / "x.png").write_bytes(PNG)
    convert(src, tmp_path / "a", opts())
    convert(tmp_path / "a", tmp_path / "b", opts(format="hdf5"))
    assert Manifest.load(tmp_path / "b").extra["source"]["classes"] == ["cat", "dog"]
