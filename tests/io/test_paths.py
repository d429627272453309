"""Local path arguments everywhere: ``~`` expanded, ``file://`` URLs read as local paths, relative
paths that survive a chdir."""
from __future__ import annotations

import pytest

from fastdata.dataset import ShardedDataset
from tests.helpers.images import grey_png
from tests.helpers.shards import make_shards


pytestmark = pytest.mark.filterwarnings("ignore:Unclosed:ResourceWarning")


def test_relative_source_paths_survive_a_chdir(tmp_path, monkeypatch):
    # A dataset built from a relative folder or tar path read it relative to the current directory at each read:
    # a chdir after building it (Hydra's per-run directory, a script's os.chdir) failed every sample.
    import fastdata

    monkeypatch.chdir(tmp_path)
    with fastdata.ShardWriter("rel") as w:
        for i in range(3):
            w.write({"__key__": f"k{i}", "cls": i})
    folder, tars = ShardedDataset("rel"), ShardedDataset(["rel/shard-000000.tar"])
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert [s["cls"] for s in folder] == [s["cls"] for s in tars] == [0, 1, 2]


def test_shard_writer_to_a_relative_folder_survives_a_chdir(tmp_path, monkeypatch):
    # The shards after a chdir were written into another folder of the same relative name, and the manifest too.
    import fastdata

    monkeypatch.chdir(tmp_path)
    with fastdata.ShardWriter("out", max_samples=2) as w:
        for i in range(4):
            if i == 2:
                (tmp_path / "elsewhere").mkdir()
                monkeypatch.chdir(tmp_path / "elsewhere")
            w.write({"__key__": f"k{i}", "cls": i})
    assert [s["cls"] for s in ShardedDataset(tmp_path / "out")] == [0, 1, 2, 3]
    assert not (tmp_path / "elsewhere" / "out").exists()


def test_every_local_path_argument_reads_file_urls_and_the_home_folder(tmp_path, monkeypatch) -> None:
    """``~`` was expanded by Cache, ShardWriter and ShardedDataset only: ``convert(src, "~/conv")`` wrote into a
    folder named ``~``, and ``convert("~/imgs")``, ``Manifest.load("~/out")`` and ``fastdata verify ~/out``
    said it did not exist."""
    import io

    from PIL import Image

    from fastdata.cli._main import main
    from fastdata.manifest import Manifest
    from fastdata.shards.convert import ConvertOptions, convert

    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    for i in range(4):
        path = home / "imgs" / ("a" if i % 2 else "b") / f"{i}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        buf = io.BytesIO()
        Image.new("RGB", (6, 5), (i, 2 * i, 3 * i)).save(buf, "PNG")
        path.write_bytes(buf.getvalue())
    convert("~/imgs", "~/conv", ConvertOptions(workers=1))
    assert not (tmp_path / "~").exists() and (home / "conv" / "manifest.json").is_file()
    assert Manifest.load("~/conv").num_samples == 4
    assert main(["verify", "~/conv"]) == 0


def test_shard_writer_and_sharded_dataset_expand_the_home_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    make_shards("~/out", 2, key="k{i}", cls="int", extra={"seg.png": grey_png()})
    assert not (work / "~").exists()  # a folder literally named "~" was made in the current folder
    assert (tmp_path / "home" / "out" / "manifest.json").is_file()
    assert len(ShardedDataset("~/out")) == 2
    tar = min((tmp_path / "home" / "out").glob("*.tar")).name
    assert len(ShardedDataset(f"~/out/{tar}")) == 2
    assert len(ShardedDataset([f"~/out/{tar}"])) == 2


def test_cache_directory_takes_file_urls_and_refuses_other_urls(tmp_path, monkeypatch):
    import pytest

    from fastdata.cache import Cache

    monkeypatch.chdir(tmp_path)
    # file:///x/c made a folder named 'file:' in the current folder (the README's rule for local paths strips it)
    assert Cache(f"file://{tmp_path}/c").directory == tmp_path / "c"
    with pytest.raises(ValueError, match="local path"):
        Cache("s3://bucket/c")
