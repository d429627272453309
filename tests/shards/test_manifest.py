"""manifest.json: round trip, fingerprint, validation errors naming the JSON path, FieldInfo, and
Manifest.load's messages."""
from __future__ import annotations

import json

import numpy as np
import pytest

import fastdata
from fastdata import ShardedDataset, ShardWriter
from fastdata.cli import main
from fastdata.errors import ManifestError
from fastdata.manifest import FieldInfo, Manifest, MANIFEST_NAME, ShardInfo, sha256_file
from fastdata.shards.convert import convert
from fastdata.shards.reader import verify
from tests.helpers.sources import image_folder, opts


SHA = "ab" * 32


def make_manifest() -> Manifest:
    return Manifest(
        format="tar",
        shards=(ShardInfo("shard-000000.tar", 3, 30720, SHA, "shard-000000.tar.idx"),
                ShardInfo("shard-000001.tar", 2, 20480, "cd" * 32, "shard-000001.tar.idx")),
        fields=(FieldInfo("cls", "int"), FieldInfo("img.npy", "array", "uint8", (3, 8, 8))),
        skipped=({"source": "a/b.jpg", "reason": "truncated"},),
        extra={"source": "folder"},
    )


def test_round_trip(tmp_path):
    m = make_manifest()
    path = m.save(tmp_path)
    assert path.name == MANIFEST_NAME
    data = json.loads(path.read_text())
    assert data["num_samples"] == 5 and list(data) == sorted(data)
    assert Manifest.load(tmp_path) == m
    assert Manifest.load(path) == m
    assert Manifest.load(tmp_path).field("img.npy").shape == (3, 8, 8)


def test_fingerprint_tracks_content():
    m = make_manifest()
    assert m.fingerprint() == make_manifest().fingerprint()
    other = Manifest(format="tar", shards=(m.shards[0],), fields=m.fields)
    assert other.fingerprint() != m.fingerprint()


def test_sha256_file(tmp_path):
    p = tmp_path / "f"
    p.write_bytes(b"abc")
    assert sha256_file(p, bufsize=2) == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"


def _broken(tmp_path, edit) -> str:
    data = make_manifest().to_json()
    edit(data)
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(data))
    return str(tmp_path)


@pytest.mark.parametrize("edit, match", [
    (lambda d: d["shards"][1].update(sha256="xyz"), r"shards\[1\]\.sha256: must be 64 lowercase hex"),
    (lambda d: d["shards"][0].pop("bytes"), r"shards\[0\]\.bytes: missing"),
    (lambda d: d["shards"][0].update(num_samples=-1), r"shards\[0\]\.num_samples: must be >= 0"),
    (lambda d: d["shards"][0].update(name="../x.tar"), r"shards\[0\]\.name: .*relative"),
    (lambda d: d["fields"][1].update(kind="blob"), r"fields\[1\]\.kind: must be one of"),
    (lambda d: d["fields"][1].update(shape=[3, "a"]), r"fields\[1\]\.shape"),
    (lambda d: d.update(format="zip"), r"format: must be one of"),
    (lambda d: d.update(format_version=9), r"format_version: unsupported version 9"),
    (lambda d: d.update(num_samples=4), r"num_samples: is 4 but the shards add up to 5"),
    (lambda d: d.pop("shards"), r"shards: missing"),
    (lambda d: d["skipped"][0].pop("reason"), r"skipped\[0\]\.reason: missing"),
    (lambda d: d["shards"].append(dict(d["shards"][0])), r"shard 'shard-000000.tar' more than once"),
])
def test_validation_names_json_path(tmp_path, edit, match):
    folder = _broken(tmp_path, edit)
    with pytest.raises(ManifestError, match=match) as info:
        Manifest.load(folder)
    assert MANIFEST_NAME in str(info.value)


def test_missing_and_invalid_json(tmp_path):
    with pytest.raises(ManifestError, match="no manifest found"):
        Manifest.load(tmp_path)
    (tmp_path / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(ManifestError, match="not valid JSON"):
        Manifest.load(tmp_path)


def test_dataclass_validation():
    with pytest.raises(ValueError, match="kind of field 'x' must be one of"):
        FieldInfo("x", "blob")
    with pytest.raises(ValueError, match="sha256 of shard 's.tar'"):
        ShardInfo("s.tar", 1, 1, "nope")


@pytest.mark.parametrize("shape", [b"ab", "", 3])
def test_field_info_shape_must_be_a_sequence_of_ints(shape):
    with pytest.raises(ValueError, match="FieldInfo.shape of field 'x' must be a tuple or list"):
        fastdata.FieldInfo("x", "array", dtype="uint8", shape=shape)  # b'ab' was the shape (97, 98)


def test_manifest_that_is_not_text_says_so(one_array_shard):
    with pytest.raises(fastdata.ManifestError, match=r"shard-000000.tar: not a manifest.json \(not UTF-8 text"):
        fastdata.Manifest.load(one_array_shard / "shard-000000.tar")


def test_manifest_load_names_a_url_as_given(one_array_shard, capsys):
    with pytest.raises(fastdata.ManifestError, match=r"^s3://bucket/ds: a URL; Manifest.load reads a local folder"):
        fastdata.Manifest.load("s3://bucket/ds")  # "s3:/bucket/ds: no manifest found"
    assert fastdata.Manifest.load(f"file://{one_array_shard}").num_samples == 8
    assert main(["doctor", "https://host/ds/", "--step-ms", "5"]) == 1
    assert "https://host/ds/: a URL" in capsys.readouterr().err


@pytest.mark.parametrize("kwargs, match", [
    (dict(format_version=2), "Manifest.format_version must be an int in 1..1, got 2"),
    (dict(format_version=True), "Manifest.format_version must be an int in 1..1, got True"),
    (dict(extra=[1]), "Manifest.extra must be a dict, got list"),
    (dict(skipped=[{"file": "a.jpg"}]), r"Manifest.skipped\[0\] must have str 'source' and 'reason'"),
    (dict(shards=["shard-000000.tar"]), "Manifest.shards must hold ShardInfos, got 'shard-000000.tar'"),
    (dict(fields=["jpg"]), "Manifest.fields must hold FieldInfos, got 'jpg'"),  # an AttributeError
])
def test_manifest_refuses_what_it_could_not_load_back(kwargs, match, tmp_path):
    # each was saved, and Manifest.load of the folder then failed: a shard folder nothing could open
    with pytest.raises(ValueError, match=match):
        fastdata.Manifest(**{"format": "tar", "shards": (), "fields": (), **kwargs})


@pytest.mark.parametrize("alias", ["./shard-000000.tar", ".//shard-000000.tar", "shard-000000.tar/"])
def test_manifest_listing_one_shard_under_two_names_is_refused(tmp_path, alias):
    """'shard-000000.tar' and './shard-000000.tar' are one file: every sample of it was served twice
    and ``verify`` said ok."""
    import json

    from fastdata.errors import ManifestError

    out = tmp_path / "out"
    convert(image_folder(tmp_path / "src"), out, opts(samples_per_shard=2))
    data = json.loads((out / "manifest.json").read_text())
    twin = dict(data["shards"][0], name=alias)
    data["shards"].append(twin)
    data["num_samples"] += twin["num_samples"]
    (out / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ManifestError, match=r"lists shard .* more than once \(as 'shard-000000.tar' and "):
        Manifest.load(out)
    assert verify(out) != []


def test_a_manifest_with_the_old_unparsable_dtype_names_still_reads(tmp_path):
    dest = tmp_path / "ds"
    with ShardWriter(dest) as w:
        w.write({"__key__": "a", "u.npy": np.array(["ab"]), "s.npy": np.zeros(1, dtype="i4,f8")})
    m = json.loads((dest / "manifest.json").read_text())
    for f in m["fields"]:
        f["dtype"] = {"u.npy": "str64", "s.npy": "void96"}[f["name"]]
    (dest / "manifest.json").write_text(json.dumps(m))
    (s,) = list(ShardedDataset(dest))
    assert s["u.npy"].tolist() == ["ab"]


def test_a_shard_given_for_the_manifest_is_named_as_such(jpeg_shards, tmp_path, capsys):
    # `fastdata inspect shards/shard-000000.tar` said "cannot read manifest: 'utf-8' codec can't decode byte 0xff"
    # (later "not UTF-8 text: 'utf-8' codec ..."), and a tar of text members "not valid JSON": what the file is,
    # and what to pass instead, went unsaid
    import numpy as np

    import fastdata
    from fastdata.cli._main import main

    with fastdata.ShardWriter(tmp_path / "text", max_samples=8) as w:  # a tar that is valid UTF-8
        for i in range(3):
            w.write({"__key__": f"k{i}", "txt": "hello", "cls": i})
    with fastdata.ShardWriter(tmp_path / "h5", format="hdf5", max_samples=8) as w:
        w.write({"__key__": "k0", "x.npy": np.zeros(3), "cls": 0})
    for shard, what in ((jpeg_shards / "shard-000000.tar", "a tar shard"),
                        (tmp_path / "text" / "shard-000000.tar", "a tar shard"),
                        (tmp_path / "h5" / "shard-000000.h5", "an HDF5 shard")):
        with pytest.raises(fastdata.ManifestError, match=rf"shard-000000\.\w+: not a manifest\.json \(.*{what}\); "
                                                         rf"pass the folder that holds manifest\.json \(.*{shard.parent.name}\)"):
            fastdata.Manifest.load(shard)
    assert main(["inspect", str(jpeg_shards / "shard-000000.tar")]) != 0
    err = capsys.readouterr().err
    assert "a tar shard" in err and "utf-8" not in err
