"""manifest.json: round trip, fingerprint, validation errors naming the JSON path."""
from __future__ import annotations

import json

import pytest

from fastdata.errors import ManifestError
from fastdata.manifest import MANIFEST_NAME, FieldInfo, Manifest, ShardInfo, sha256_file

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
