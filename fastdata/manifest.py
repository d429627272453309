"""``manifest.json``: what a shard folder contains, validated on load.

Layout (JSON object, keys sorted, written last and atomically)::

    {
     "extra": {...},                       # free-form (source description, resize, ...)
     "fields": [{"dtype": "uint8", "kind": "array", "name": "img.npy", "shape": [3, 224, 224]}, ...],
     "format": "tar",                      # "tar" | "hdf5"
     "format_version": 1,
     "num_samples": 1234,                  # sum over shards
     "shards": [{"bytes": 268435456, "index": "shard-000000.tar.idx", "name": "shard-000000.tar",
                 "num_samples": 617, "sha256": "<64 hex>"}, ...],
     "skipped": [{"reason": "cannot identify image file", "source": "cat/003.jpg"}, ...]
    }
"""
from __future__ import annotations

import hashlib
import json
import os
import posixpath
import re
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastdata.errors import ManifestError
from fastdata.io import is_url, local_path

__all__ = ["FORMATS", "FORMAT_VERSION", "KINDS", "MANIFEST_NAME", "FieldInfo", "Manifest", "ShardInfo", "sha256_file"]

MANIFEST_NAME = "manifest.json"
FORMAT_VERSION = 1
FORMATS = ("tar", "hdf5")
# "float" extends the plan's list: scalar floats (tar: str(value); HDF5: float64 dataset).
KINDS = ("bytes", "array", "int", "float", "text", "json")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def _check_name(name: object, what: str) -> str | None:
    if not isinstance(name, str) or not name:
        return f"{what} must be a non-empty string, got {name!r}"
    if name.startswith("/") or ".." in name.split("/") or "\\" in name or "\x00" in name:
        return f"{what} must be a relative file name inside the folder, got {name!r}"
    return None


@dataclass(frozen=True)
class FieldInfo:
    """One sample field: its name (the tar extension), kind and, for arrays, dtype/shape when fixed."""

    name: str
    kind: str
    dtype: str | None = None
    shape: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"FieldInfo.name must be a non-empty str, got {self.name!r}")
        if self.kind not in KINDS:
            raise ValueError(f"FieldInfo.kind of field {self.name!r} must be one of {KINDS}, got {self.kind!r}")
        if self.dtype is not None and not isinstance(self.dtype, str):
            raise ValueError(f"FieldInfo.dtype of field {self.name!r} must be a str or None, got {self.dtype!r}")
        if self.shape is not None:
            if not isinstance(self.shape, (tuple, list)):  # b'ab' was the shape (97, 98), '' the shape ()
                raise ValueError(f"FieldInfo.shape of field {self.name!r} must be a tuple or list of ints, "
                                 f"got {self.shape!r}")
            shape = tuple(self.shape)
            if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
                raise ValueError(
                    f"FieldInfo.shape of field {self.name!r} must be non-negative ints, got {self.shape!r}")
            object.__setattr__(self, "shape", shape)

    def to_json(self) -> dict[str, Any]:
        """This field as a ``manifest.json`` object."""
        return {"name": self.name, "kind": self.kind, "dtype": self.dtype,
                "shape": None if self.shape is None else list(self.shape)}


@dataclass(frozen=True)
class ShardInfo:
    """One shard file: name relative to the manifest folder, sample count, byte size, sha256."""

    name: str
    num_samples: int
    bytes: int
    sha256: str
    index: str | None = None  # sidecar index file name (tar), or None

    def __post_init__(self) -> None:
        problem = _check_name(self.name, "ShardInfo.name")
        if problem:
            raise ValueError(problem)
        for attr in ("num_samples", "bytes"):
            value = getattr(self, attr)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"ShardInfo.{attr} of shard {self.name!r} must be an int >= 0, got {value!r}")
        if not isinstance(self.sha256, str) or not _HEX64.match(self.sha256):
            raise ValueError(
                f"ShardInfo.sha256 of shard {self.name!r} must be 64 lowercase hex chars, got {self.sha256!r}")
        if self.index is not None:
            problem = _check_name(self.index, f"ShardInfo.index of shard {self.name!r}")
            if problem:
                raise ValueError(problem)

    def to_json(self) -> dict[str, Any]:
        """This shard as a ``manifest.json`` object."""
        return {"name": self.name, "num_samples": self.num_samples, "bytes": self.bytes,
                "sha256": self.sha256, "index": self.index}


@dataclass(frozen=True)
class Manifest:
    """Contents of ``manifest.json``: format, fields, shards, skipped inputs."""

    format: str
    shards: tuple[ShardInfo, ...]
    fields: tuple[FieldInfo, ...]
    skipped: tuple[dict, ...] = ()
    format_version: int = FORMAT_VERSION
    extra: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"Manifest.format must be one of {FORMATS}, got {self.format!r}")
        object.__setattr__(self, "shards", tuple(self.shards))
        object.__setattr__(self, "fields", tuple(self.fields))
        object.__setattr__(self, "skipped", tuple(dict(s) for s in self.skipped))
        # what load() refuses is refused here too: save() must never write a manifest that cannot be read back
        for name, items, cls in (("shards", self.shards, ShardInfo), ("fields", self.fields, FieldInfo)):
            bad = next((x for x in items if not isinstance(x, cls)), None)
            if bad is not None:
                raise ValueError(f"Manifest.{name} must hold {cls.__name__}s, got {bad!r}")
        version = self.format_version
        if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= FORMAT_VERSION:
            raise ValueError(f"Manifest.format_version must be an int in 1..{FORMAT_VERSION}, got {version!r}")
        if not isinstance(self.extra, dict):
            raise ValueError(f"Manifest.extra must be a dict, got {type(self.extra).__name__}")
        for i, s in enumerate(self.skipped):
            if not (isinstance(s.get("source"), str) and isinstance(s.get("reason"), str)):
                raise ValueError(f"Manifest.skipped[{i}] must have str 'source' and 'reason', got {s!r}")
        first: dict[str, int] = {}
        for i, s in enumerate(self.shards):  # 'a.tar', './a.tar', './/a.tar': one file, read twice
            j = first.setdefault(posixpath.normpath(s.name), i)
            if j != i:
                other = self.shards[j].name
                same = "" if other == s.name else f" (as {other!r} and {s.name!r}: the same file)"
                raise ValueError(f"Manifest lists shard {s.name!r} more than once{same}")
        fnames = [f.name for f in self.fields]
        if len(set(fnames)) != len(fnames):
            dup = next(n for n in fnames if fnames.count(n) > 1)
            raise ValueError(f"Manifest lists field {dup!r} more than once")

    @property
    def num_samples(self) -> int:
        """Total number of samples over all shards."""
        return sum(s.num_samples for s in self.shards)

    def field(self, name: str) -> FieldInfo:
        """The field called ``name`` (KeyError naming it otherwise)."""
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(f"manifest has no field {name!r}; fields: {[f.name for f in self.fields]}")

    def to_json(self) -> dict[str, Any]:
        """The ``manifest.json`` object (with ``num_samples`` summed over shards)."""
        return {
            "format": self.format,
            "format_version": self.format_version,
            "num_samples": self.num_samples,
            "fields": [f.to_json() for f in self.fields],
            "shards": [s.to_json() for s in self.shards],
            "skipped": [dict(s) for s in self.skipped],
            "extra": self.extra,
        }

    def save(self, folder: str | os.PathLike[str]) -> Path:
        """Write ``folder/manifest.json`` atomically (temporary file, then rename)."""
        path = Path(folder) / MANIFEST_NAME
        tmp = path.with_name(path.name + ".tmp")
        data = self.to_json()
        try:
            text = (json.dumps(data, sort_keys=True, indent=1, ensure_ascii=False) + "\n").encode("utf-8")
        except UnicodeEncodeError:  # a file name with bytes that are not UTF-8 (surrogate escapes):
            text = (json.dumps(data, sort_keys=True, indent=1) + "\n").encode("ascii")  # \udcXX, read back as is
        with open(tmp, "wb") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return path

    def fingerprint(self) -> str:
        """sha256 over format, version, fields and the (name, sha256) list of shards."""
        payload = {
            "format": self.format,
            "format_version": self.format_version,
            "fields": [f.to_json() for f in self.fields],
            "shards": [[s.name, s.sha256] for s in self.shards],
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode("utf-8")).hexdigest()

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Manifest:
        """Load and validate ``manifest.json`` (``path`` is the file or its folder).

        Raises ``ManifestError`` naming the file and the JSON path of the problem,
        e.g. ``shards[3].sha256: ...``.
        """
        text_path = os.fspath(path)
        if isinstance(text_path, str):
            if is_url(text_path):  # Path() would make 's3:/bucket/ds'
                raise ManifestError(f"{text_path}: a URL; Manifest.load reads a local folder or manifest.json "
                                    "(ShardedDataset and RemoteShards read folder URLs)")
            text_path = local_path(text_path)  # file://, ~
        p = Path(text_path)
        if p.is_dir():
            p = p / MANIFEST_NAME
        try:
            text = p.read_text(encoding="utf-8")
        except FileNotFoundError as e:
            raise ManifestError(f"{p}: no manifest found") from e
        except UnicodeDecodeError as e:  # a shard or an image given for the manifest
            what = _file_kind(e.object[:512]) or f"{e.reason} at byte {e.start}"
            raise ManifestError(f"{p}: not a manifest.json (not UTF-8 text: {what}); {_pass_instead(p)}") from e
        except OSError as e:
            raise ManifestError(f"{p}: cannot read manifest: {e}") from e
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            what = _file_kind(text[:512].encode("utf-8"))  # a tar of text members is valid UTF-8
            if what:
                raise ManifestError(f"{p}: not a manifest.json ({what}); {_pass_instead(p)}") from e
            raise ManifestError(f"{p}: not valid JSON: {e}") from e
        return _parse(data, str(p))


def _file_kind(head: bytes) -> str | None:
    """What a file given for a manifest is, from its first bytes: a shard or a compressed file, else None."""
    if head[257:262] == b"ustar":
        return "a tar shard"
    if head.startswith(b"\x89HDF\r\n\x1a\n"):
        return "an HDF5 shard"
    if head.startswith(b"\x1f\x8b"):
        return "a gzip-compressed file"
    return None


def _pass_instead(p: Path) -> str:
    beside = f" ({p.parent})" if (p.parent / MANIFEST_NAME).is_file() else ""
    return f"pass the folder that holds manifest.json{beside} or that manifest.json"


def _parse(data: Any, where: str) -> Manifest:
    def fail(jpath: str, msg: str) -> ManifestError:
        return ManifestError(f"{where}: {jpath}: {msg}" if jpath else f"{where}: {msg}")

    if not isinstance(data, dict):
        raise fail("", f"top level must be a JSON object, got {type(data).__name__}")
    for key in ("format", "format_version", "fields", "shards"):
        if key not in data:
            raise fail(key, "missing")
    fmt = data["format"]
    if fmt not in FORMATS:
        raise fail("format", f"must be one of {list(FORMATS)}, got {fmt!r}")
    version = data["format_version"]
    if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= FORMAT_VERSION:
        raise fail("format_version", f"unsupported version {version!r} (this fastdata reads 1..{FORMAT_VERSION})")
    fields = _parse_list(data, "fields", _parse_field, fail)
    shards = _parse_list(data, "shards", _parse_shard, fail)
    skipped = _parse_list(data, "skipped", _parse_skipped, fail) if "skipped" in data else []
    extra = data.get("extra", {})
    if not isinstance(extra, dict):
        raise fail("extra", f"must be an object, got {type(extra).__name__}")
    try:
        manifest = Manifest(format=fmt, shards=tuple(shards), fields=tuple(fields), skipped=tuple(skipped),
                            format_version=version, extra=extra)
    except ValueError as e:
        raise fail("", str(e)) from e
    if "num_samples" in data and data["num_samples"] != manifest.num_samples:
        raise fail("num_samples", f"is {data['num_samples']!r} but the shards add up to {manifest.num_samples}")
    return manifest


def _parse_list(data: dict, key: str, parse: Any, fail: Any) -> list:
    items = data[key]
    if not isinstance(items, list):
        raise fail(key, f"must be a list, got {type(items).__name__}")
    out = []
    for i, item in enumerate(items):
        jpath = f"{key}[{i}]"
        if not isinstance(item, dict):
            raise fail(jpath, f"must be an object, got {type(item).__name__}")
        out.append(parse(item, jpath, fail))
    return out


def _get(item: dict, name: str, types: tuple[type, ...], jpath: str, fail: Any, *, optional: bool = False) -> Any:
    if name not in item:
        if optional:
            return None
        raise fail(f"{jpath}.{name}", "missing")
    value = item[name]
    if value is None and optional:
        return None
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        want = " or ".join(t.__name__ for t in types)
        raise fail(f"{jpath}.{name}", f"must be {want}, got {value!r}")
    return value


def _parse_field(item: dict, jpath: str, fail: Any) -> FieldInfo:
    name = _get(item, "name", (str,), jpath, fail)
    kind = _get(item, "kind", (str,), jpath, fail)
    if kind not in KINDS:
        raise fail(f"{jpath}.kind", f"must be one of {list(KINDS)}, got {kind!r}")
    dtype = _get(item, "dtype", (str,), jpath, fail, optional=True)
    shape = _get(item, "shape", (list,), jpath, fail, optional=True)
    if shape is not None and not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise fail(f"{jpath}.shape", f"must be a list of non-negative ints, got {shape!r}")
    try:
        return FieldInfo(name=name, kind=kind, dtype=dtype, shape=None if shape is None else tuple(shape))
    except ValueError as e:
        raise fail(jpath, str(e)) from e


def _parse_shard(item: dict, jpath: str, fail: Any) -> ShardInfo:
    name = _get(item, "name", (str,), jpath, fail)
    problem = _check_name(name, "shard name")
    if problem:
        raise fail(f"{jpath}.name", problem)
    num = _get(item, "num_samples", (int,), jpath, fail)
    size = _get(item, "bytes", (int,), jpath, fail)
    for key, value in (("num_samples", num), ("bytes", size)):
        if value < 0:
            raise fail(f"{jpath}.{key}", f"must be >= 0, got {value!r}")
    sha = _get(item, "sha256", (str,), jpath, fail)
    if not _HEX64.match(sha):
        raise fail(f"{jpath}.sha256", f"must be 64 lowercase hex characters, got {sha!r}")
    index = _get(item, "index", (str,), jpath, fail, optional=True)
    if index is not None:
        problem = _check_name(index, "index name")
        if problem:
            raise fail(f"{jpath}.index", problem)
    return ShardInfo(name=name, num_samples=num, bytes=size, sha256=sha, index=index)


def _parse_skipped(item: dict, jpath: str, fail: Any) -> dict:
    source = _get(item, "source", (str,), jpath, fail)
    reason = _get(item, "reason", (str,), jpath, fail)
    return {**item, "source": source, "reason": reason}


def sha256_file(path: str | os.PathLike[str], bufsize: int = 8 << 20) -> str:
    """Hex sha256 of a file's contents, read in ``bufsize`` chunks."""
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(bufsize)
        view = memoryview(buf)
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
    return h.hexdigest()
