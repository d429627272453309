"""The registry of shard formats: every place that differs by format looks the format up there."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest

from fastdata.manifest import Manifest, ShardInfo
from fastdata.shards import SHARD_FORMATS, shard_format
from fastdata.shards.convert import ConvertOptions, convert
from fastdata.shards.reader import open_shard, verify, verify_shard
from fastdata.shards.writer import ShardWriter, shard_name

FORMATS = sorted(SHARD_FORMATS)


def _samples(n: int) -> list[dict]:
    return [{"__key__": f"k{i:03d}", "cls": i, "x.npy": np.full((2, 3), i, np.int16)} for i in range(n)]


def test_tar_and_hdf5_are_registered_with_their_suffixes():
    assert FORMATS == ["hdf5", "tar"]
    assert (shard_format("tar").suffix, shard_format("hdf5").suffix) == (".tar", ".h5")
    assert shard_name(7, "hdf5") == "shard-000007.h5" and shard_name(7, "tar") == "shard-000007.tar"


@pytest.mark.parametrize("name", ["zip", "", "TAR", None, ["tar"]])
def test_an_unknown_format_is_a_value_error_naming_the_formats(name, tmp_path):
    message = rf"format must be 'tar' or 'hdf5', got {name!r}".replace("[", r"\[").replace("]", r"\]")
    with pytest.raises(ValueError, match=message):
        shard_format(name)
    with pytest.raises(ValueError, match=message):
        ShardWriter(tmp_path / "out", format=name)
    with pytest.raises(ValueError, match=message):
        ConvertOptions(format=name)


@pytest.mark.parametrize("name", FORMATS)
def test_each_format_writes_opens_and_verifies_through_its_entry(name, tmp_path):
    if name == "hdf5":
        pytest.importorskip("h5py")
    fmt = shard_format(name)
    with ShardWriter(tmp_path / "ds", format=name, max_samples=3) as writer:
        for sample in _samples(5):
            writer.write(sample)
    manifest = Manifest.load(tmp_path / "ds")
    assert manifest.format == name and [s.name for s in manifest.shards] == [shard_name(0, name), shard_name(1, name)]
    assert all((s.index is not None) == (fmt.index_suffix is not None) for s in manifest.shards)
    with open_shard(tmp_path / "ds", manifest.shards[1], format=name, fields=manifest.fields) as reader:
        got = reader.read(1)
    assert got["__key__"] == "k004" and np.array_equal(_array(got["x.npy"]), np.full((2, 3), 4, np.int16))
    assert verify(tmp_path / "ds") == []

    path = tmp_path / "one" / shard_name(0, name)
    path.parent.mkdir()
    info = fmt.write(path, _samples(4), fields=manifest.fields)
    one = dataclasses.replace(manifest, shards=(info,))
    problems: list[str] = []
    assert fmt.verify(path.parent, one, info, problems) == {"cls", "x.npy"} and problems == []
    problems = verify_shard(path.parent, one, dataclasses.replace(info, num_samples=5))
    assert len(problems) == 1 and re.match(rf"{info.name}: .*has 4 samples,? (but the )?manifest says 5", problems[0])


def _array(value) -> np.ndarray:
    """An ``.npy`` field as a tar shard holds it (bytes) or as HDF5 returns it (an array)."""
    if isinstance(value, np.ndarray):
        return value
    import io

    return np.load(io.BytesIO(bytes(value)))


@pytest.mark.parametrize("name", FORMATS)
def test_a_conversion_writes_each_format_through_its_entry(name, tmp_path, monkeypatch):
    if name == "hdf5":
        pytest.importorskip("h5py")
    with ShardWriter(tmp_path / "src") as writer:
        for sample in _samples(6):
            writer.write(sample)
    written: list[str] = []
    fmt = shard_format(name)

    def write(path, samples, *, fields=None):
        written.append(Path(path).name)
        return fmt.write(path, samples, fields=fields)

    monkeypatch.setitem(SHARD_FORMATS, name, dataclasses.replace(fmt, write=write))
    result = convert(tmp_path / "src", tmp_path / "out", ConvertOptions(format=name, samples_per_shard=4, workers=1,
                                                                       progress=False))
    assert written == [shard_name(0, name), shard_name(1, name)]
    assert result.manifest.format == name and verify(tmp_path / "out") == []


def test_a_registered_format_is_opened_and_named_without_other_changes(tmp_path, monkeypatch):
    """A new format is one registry entry: open_shard, shard_name and ConvertOptions find it."""
    opened: list[tuple] = []

    def fake_open(path, *, index=None, expect=None, fields=None, **options):
        opened.append((Path(path).name, index, expect, options))
        return "reader"

    fake = dataclasses.replace(shard_format("tar"), name="fake", suffix=".fk", index_suffix=None, open=fake_open)
    monkeypatch.setitem(SHARD_FORMATS, "fake", fake)
    shard = ShardInfo(name=shard_name(2, "fake"), num_samples=1, bytes=1, sha256="0" * 64)
    assert open_shard(tmp_path, shard, format="fake", chunk=3) == "reader"
    assert opened == [("shard-000002.fk", None, shard, {"chunk": 3})]
    assert ConvertOptions(format="fake").format == "fake"
