"""ShardedDataset's arguments: kinds and values refused naming the argument, decode= keys checked
against the fields."""
from __future__ import annotations

import pytest

from fastdata import ShardedDataset
from fastdata.decode import ImageDecoder
from tests.helpers.images import grey_png
from tests.helpers.loopback_server import LoopbackServer, make_shard_set
from tests.helpers.shards import make_shards


pytestmark = pytest.mark.filterwarnings("ignore:Unclosed:ResourceWarning")


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"seed": True}, "seed must be an int"), ({"shuffle": ""}, "shuffle must be"), ({"shuffle": []}, "shuffle must be"),
    ({"fields": [1]}, r"fields must be .*1"), ({"fields": 5}, "fields must be"), ({"fields": b"cls"}, "fields must be"),
    ({"fields": ["cls", None]}, r"fields must be .*None"),
    ({"image_decode": "device", "max_pixels": 10_000}, "DecodeImages"),
])
def test_dataset_arguments_of_the_wrong_kind_are_named(tmp_path, kwargs: dict, match: str) -> None:
    """Each was accepted (seed=True as 1, shuffle='' as off, max_pixels ignored with image_decode='device')
    or failed with an AttributeError from inside."""
    from fastdata import ShardedDataset
    from tests.helpers.shards import make_shards

    folder = make_shards(tmp_path / "ds", 4, 2, key="k/{i:05d}", txt=True)
    with pytest.raises((TypeError, ValueError), match=match):
        ShardedDataset(folder, **kwargs)
    assert [s["cls"] for s in ShardedDataset(folder, shuffle=None, fields=("cls",), seed=3)] == [0, 1, 2, 3]


@pytest.mark.parametrize("kwargs", [{"open_shards": True}, {"buffer_size": True}, {"within_shard": "no"},
                                    {"within_shard": 0}])
def test_shuffle_options_refuse_bools_for_counts_and_strings_for_flags(kwargs: dict) -> None:
    from fastdata import ShuffleOptions

    with pytest.raises(ValueError, match=next(iter(kwargs))):
        ShuffleOptions(**kwargs)


@pytest.mark.parametrize("key", [".png", "PNG", "mask.png", "seg"])
def test_decode_key_matching_no_field_is_refused_naming_it_and_the_fields(tmp_path, key):
    # {".png": ImageDecoder(None)} matched nothing: the mask came out as RGB (3, H, W), with no error
    make_shards(tmp_path / "ds", 2, key="k{i}", cls="int", extra={"seg.png": grey_png()})
    with pytest.raises(ValueError, match=rf"decode=.*'{key}'.*(?s:seg\.png)"):
        ShardedDataset(tmp_path / "ds", decode={key: ImageDecoder(None)})


def test_decode_keys_naming_a_field_or_its_suffix_still_work(tmp_path):
    make_shards(tmp_path / "ds", 2, key="k{i}", cls="int", extra={"seg.png": grey_png()})
    for key in ("png", "seg.png"):
        ds = ShardedDataset(tmp_path / "ds", decode={key: ImageDecoder(None)})
        assert tuple(next(iter(ds))["seg.png"].shape) == (1, 4, 5)  # as stored, not RGB
    assert next(iter(ShardedDataset(tmp_path / "ds", decode={"cls": None})))["cls"] == b"0"
    # a mapping shared with datasets of other formats names suffixes this one lacks: not a typo
    shared = {"jpg": ImageDecoder(None), "webp": ImageDecoder(None), "png": ImageDecoder(None), "npy": None}
    assert tuple(next(iter(ShardedDataset(tmp_path / "ds", decode=shared)))["seg.png"].shape) == (1, 4, 5)


def test_a_leading_dot_decode_key_is_refused_where_the_fields_are_unknown(tmp_path):
    # With a manifest (or tar indexes) a decode= key matching no field is refused (ed1b7b2, d501266); a streamed
    # tar URL has no field list, so decode={".png": f} matched nothing, silently: the mask came out RGB.
    make_shard_set(tmp_path / "www" / "ds", 4, 4, payload=10, seed=1)
    with LoopbackServer(tmp_path / "www", max_requests=10, lifetime=60) as srv:
        url = f"{srv.url}/ds/shard-000000.tar"
        with pytest.raises(ValueError, match=r"'\.bin'.*without the dot: 'bin'"):
            ShardedDataset(url, decode={".bin": len})
        ds = ShardedDataset(url, decode={"bin": len, "png": len})  # a key without the dot may match nothing
        assert [s["bin"] for s in ds] == [10] * 4
