"""Sample keys, field names and value encoding (WebDataset conventions).

Key splitting rule
------------------
A tar member name is ``<key>.<field>``. The *key* is the directory part plus the basename up to
its FIRST dot; the *field* is the rest of the basename, which may itself contain dots
(``seg.png``, ``img.npy``). This is exactly webdataset's ``base_plus_ext`` rule, so fastdata and
webdataset group members identically::

    train/n0144.x/img001.jpg      -> key "train/n0144.x/img001", field "jpg"
    train/n0144.x/img001.seg.png  -> key "train/n0144.x/img001", field "seg.png"

Keys may contain ``/`` and dots in their directory parts, never a dot in their last component
(``img.001`` would be read back as key ``img`` with field ``001.jpg``): writers reject such keys
with a ``ValueError`` naming the key, instead of letting every reader mis-group them. Also rejected:
empty keys, a leading ``/``, empty, ``.`` or ``..`` components, NUL characters, keys starting with
``__``. Field names must be non-empty, contain no ``/`` or NUL and not start with ``__``; sample
entries whose name starts with ``__`` (``__key__``, ``__url__``, ...) are metadata, not fields.
"""
from __future__ import annotations

import io
import json
import re
from typing import Any

import numpy as np

__all__ = [
    "check_field",
    "check_key",
    "encode_value",
    "is_meta",
    "member_name",
    "split_member_name",
]

# webdataset.tariterators.base_plus_ext
_MEMBER_RE = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")


def split_member_name(name: str) -> tuple[str, str] | None:
    """Split a tar member name into ``(key, field)``; None when it has no ``key.field`` form."""
    match = _MEMBER_RE.match(name)
    if match is None:
        return None
    return match.group(1), match.group(2)


def is_meta(name: str) -> bool:
    """True for sample entries that are metadata (``__key__``, ``__url__``), not stored fields."""
    return name.startswith("__")


def check_key(key: object) -> str:
    """Return ``key`` if it is a valid sample key, else raise ``ValueError`` naming it."""
    if not isinstance(key, str):
        raise ValueError(f"sample key must be a str, got {type(key).__name__} {key!r}")
    problem = _key_problem(key)
    if problem:
        raise ValueError(f"invalid sample key {key!r}: {problem}")
    return key


def _key_problem(key: str) -> str:
    if not key:
        return "empty"
    if "\x00" in key:
        return "contains NUL"
    if key.startswith("/"):
        return "starts with '/'"
    if key.startswith("__"):
        return "starts with '__' (reserved for metadata)"
    parts = key.split("/")
    for part in parts:
        if part in ("", ".", ".."):
            return f"has an empty, '.' or '..' path component {part!r}"
    if "." in parts[-1]:
        return (
            f"its last component {parts[-1]!r} contains a dot, so readers would split it as "
            f"key {parts[-1].split('.', 1)[0]!r} (tar members are '<key>.<field>', split at the "
            "first dot of the basename); use dots only in directory parts"
        )
    return ""


def check_field(field: object, key: str = "") -> str:
    """Return ``field`` if it is a valid field name, else raise ``ValueError`` naming it."""
    where = f" of sample {key!r}" if key else ""
    if not isinstance(field, str) or not field:
        raise ValueError(f"field name{where} must be a non-empty str, got {field!r}")
    if "/" in field or "\x00" in field:
        raise ValueError(f"field name {field!r}{where} must not contain '/' or NUL")
    if field.startswith("__"):
        raise ValueError(f"field name {field!r}{where} must not start with '__' (metadata)")
    return field


def member_name(key: str, field: str) -> str:
    """The tar member name ``<key>.<field>`` after validating both parts."""
    check_key(key)
    check_field(field, key)
    name = f"{key}.{field}"
    if split_member_name(name) != (key, field):  # pragma: no cover - guaranteed by the checks
        raise ValueError(f"member name {name!r} would not split back into key {key!r}")
    return name


def encode_value(field: str, value: Any, *, key: str = "") -> bytes:
    """Encode one field value to the bytes stored in a tar member.

    bytes-like as is; str as UTF-8; int/float as ``str(value)``, bool as ``1``/``0`` (an int, the kind
    the manifest records for it, so that ``cls`` decoders read it); ``np.ndarray`` as ``.npy``
    when the field's last suffix is ``npy``; dict/list as JSON when it is ``json``.
    """
    if isinstance(value, bytes):
        return value
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (bool, np.bool_)):
        return b"1" if value else b"0"
    if isinstance(value, (int, float, np.integer, np.floating)):
        return str(value).encode("utf-8")
    suffix = field.rsplit(".", 1)[-1]
    if isinstance(value, np.ndarray) and suffix == "npy":
        return npy_bytes(value, field=field, key=key)
    if isinstance(value, (dict, list)) and suffix == "json":
        try:
            return json.dumps(value, sort_keys=True, ensure_ascii=False).encode("utf-8")
        except (TypeError, ValueError) as e:
            raise TypeError(f"field {field!r} of sample {key!r} is not JSON-serialisable: {e}") from e
    raise TypeError(
        f"cannot encode field {field!r} of sample {key!r}: {type(value).__name__} values need "
        "bytes/str/int/float, an np.ndarray in a '.npy' field or a dict/list in a '.json' field"
    )


def npy_bytes(value: np.ndarray, *, field: str = "", key: str = "") -> bytes:
    """``.npy`` encoding of an array (no pickles)."""
    buf = io.BytesIO()
    try:
        np.lib.format.write_array(buf, np.asanyarray(value), allow_pickle=False)
    except ValueError as e:
        raise TypeError(f"field {field!r} of sample {key!r}: cannot store {value.dtype} array: {e}") from e
    return buf.getvalue()
