"""What ShardedDataset takes as its source: folders, tar lists, file URLs, HDF5 shards; errors naming
the source."""
from __future__ import annotations

import pytest

from fastdata.dataset import ShardedDataset


pytestmark = pytest.mark.filterwarnings("ignore:Unclosed:ResourceWarning")


def test_an_hdf5_shard_url_is_refused_naming_the_folder_url_to_pass():
    # A list of .h5 URLs was streamed as tar: "bad tar header checksum at byte offset 0 ...; the shard is
    # corrupt" (it is not: it is HDF5); one .h5 URL was taken for a folder (".../shard-000000.h5/manifest.json:
    # HTTP 404"). Refused before any request (the host does not exist).
    from fastdata.errors import SourceError

    url = "https://data.invalid/ds/shard-000000.h5?sig=SECRET"
    for source in (url, [url, url.replace("000000", "000001")]):
        with pytest.raises(SourceError, match=r"shard-000000\.h5.*HDF5.*'https://data\.invalid/ds/'") as err:
            ShardedDataset(source)
        assert "SECRET" not in str(err.value)


def test_a_local_hdf5_shard_path_names_its_folder(tmp_path):
    # "only uncompressed .tar shards can be read without a manifest (use a URL for streaming, ...)": an HDF5
    # shard cannot be streamed either; its folder (with manifest.json) is what to pass.
    import fastdata
    from fastdata.errors import SourceError

    with fastdata.ShardWriter(tmp_path / "h", format="hdf5") as w:
        w.write({"__key__": "k0", "cls": 0})
    with pytest.raises(SourceError, match=r"shard-000000\.h5: an HDF5 shard is read through its folder's "
                                          r"manifest\.json.*pass the folder"):
        ShardedDataset([str(tmp_path / "h" / "shard-000000.h5")])
    assert [s["cls"] for s in ShardedDataset(tmp_path / "h")] == [0]


def test_a_folder_inside_a_source_list_says_lists_hold_tar_files(tmp_path):
    # [folder] or [folder_a, folder_b] said "only uncompressed .tar shards can be read without a manifest":
    # the folder has one; a list names tar files, and folders are not combined.
    import fastdata
    from fastdata.errors import SourceError

    with fastdata.ShardWriter(tmp_path / "a") as w:
        w.write({"__key__": "k0", "cls": 0})
    with pytest.raises(SourceError, match=r"a\b.*is a folder: a list of sources names tar files.*pass the folder "
                                          r"itself"):
        ShardedDataset([str(tmp_path / "a"), str(tmp_path / "a")])


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


def test_a_file_url_of_a_folder_with_a_manifest_is_read(tmp_path) -> None:
    """``ShardedDataset("file:///folder")`` said "only uncompressed .tar shards can be read without a
    manifest" although the folder has one."""
    from fastdata import ShardedDataset
    from fastdata.errors import SourceNotFoundError
    from tests.helpers.shards import make_shards

    folder = make_shards(tmp_path / "ds", 7, 3, key="k/{i:05d}", txt=True)
    for url in (f"file://{folder}", f"file://{folder}/"):
        assert [s["cls"] for s in ShardedDataset(url)] == list(range(7))
    (tmp_path / "empty").mkdir()
    with pytest.raises(SourceNotFoundError, match="no manifest.json in this folder"):
        ShardedDataset(f"file://{tmp_path / 'empty'}")
