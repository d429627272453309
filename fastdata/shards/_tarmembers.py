"""From the header walker's members to samples: links resolved, names split, a sample's members consecutive.

Shared by the random-access index (:meth:`TarIndex.build`, which sees the whole member list) and the
stream reader (:func:`fastdata.shards.tar.iter_tar_stream`, which sees a bounded window of recent
members). A hardlink, and a symlink to a member of the archive, read their target's data under their
own name; a symlink that leaves the archive is refused (never read); members that give no sample
data are reported as skipped with the reason, one warning per shard.
"""
from __future__ import annotations

import posixpath
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

from fastdata.errors import ShardError
from fastdata.shards import _tarfmt
from fastdata.shards._keys import is_meta, split_member_name

__all__ = ["group_samples", "resolve_links"]

_LINK_HOPS = 16  # symlink chains longer than this are reported, not followed
_STREAM_LINK_BYTES = 64 << 20  # data of the latest regular members kept for hardlinks in a stream


def _link_target(member: _tarfmt.Member) -> str | None:
    """The archive path a link refers to (None: a symlink that leaves the archive)."""
    if member.kind == "hardlink":  # the target's member name as archived
        return _norm(member.link)
    if member.link.startswith("/"):
        return None
    target = posixpath.normpath(posixpath.join(posixpath.dirname(_norm(member.name)), member.link))
    return None if target == ".." or target.startswith("../") else _norm(target)


def _norm(name: str) -> str:
    while name.startswith("./"):
        name = name[2:]
    return name.rstrip("/")


def resolve_links(members: Iterable[_tarfmt.Member], skipped: list[tuple[str, str]], *, stream: bool = False,
                   ) -> Iterator[tuple[str, int, int, int, Any]]:
    """``(name, header_offset, data_offset, size, data)`` of every member that has data, in archive order.

    A hardlink (and a symlink to a member of the archive) gives its target's data under its own
    name. Members without data are appended to ``skipped`` as ``(name, reason)``: symlinks that
    leave the archive (refused: never read), links to a member that is not in the archive (in a
    stream: not among the recent members), devices and fifos; directories are structure, not data.
    Random access (``stream=False``) needs the whole member list (a symlink may point forward).
    """
    files: dict[str, tuple[int, int, Any]] = {}
    dirs: set[str] = set()
    kept = 0

    def resolve(m: _tarfmt.Member) -> tuple[int, int, Any] | str:
        seen = m
        for _ in range(_LINK_HOPS):
            target = _link_target(seen)
            if target is None:
                return f"symlink to {seen.link!r} points outside the archive (refused)"
            if target in files:
                return files[target]
            link = links.get(target)
            if link is None:
                if target in dirs:
                    return f"{m.kind} to {m.link!r} names a directory, not a file"
                if stream and m.kind == "hardlink":
                    return (f"hardlink to {m.link!r}: its target is not among the last "
                            f"{_STREAM_LINK_BYTES >> 20} MiB of members read from the stream")
                return f"{m.kind} to {m.link!r}: no such file in the archive"
            seen = link
        return f"{m.kind} to {m.link!r}: more than {_LINK_HOPS} links in a row (a cycle?)"

    links: dict[str, _tarfmt.Member] = {}
    if not stream:
        members = list(members)
        for m in members:
            if m.kind == "file":
                files[_norm(m.name)] = (m.data_offset, m.size, m.data)
            elif m.kind in ("hardlink", "symlink"):
                links[_norm(m.name)] = m
            elif m.kind == "directory":
                dirs.add(_norm(m.name))
    for m in members:
        if m.kind == "file":
            if stream:
                files[_norm(m.name)] = (m.data_offset, m.size, m.data)
                kept += m.size
                while kept > _STREAM_LINK_BYTES and len(files) > 1:
                    old = files.pop(next(iter(files)))
                    kept -= old[1]
            yield m.name, m.offset, m.data_offset, m.size, m.data
        elif m.kind in ("hardlink", "symlink"):
            if stream:
                links[_norm(m.name)] = m
            got = resolve(m)
            if isinstance(got, str):
                skipped.append((m.name, got))
                continue
            yield m.name, m.offset, got[0], got[1], got[2]
        elif m.kind == "directory":
            dirs.add(_norm(m.name))
        else:
            skipped.append((m.name, f"not a regular file ({m.kind})"))


def group_samples(members: Iterable[tuple[str, int, int, int, Any]], shard: str,
           skipped: list[tuple[str, str]] | None = None) -> Iterator[tuple[str, str, int, int, Any]]:
    """Split member names into (key, field) and enforce that a sample's members are consecutive.

    Members that are not ``<key>.<field>`` are left out and appended to ``skipped``; one warning
    per shard names the first of everything skipped (link problems included).
    """
    seen: set[str] = set()
    current: str | None = None
    fields: set[str] = set()
    skipped = [] if skipped is None else skipped
    for name, header_offset, offset, size, data in members:
        parts = split_member_name(name)
        if parts is None or is_meta(parts[1]) or name.startswith("__"):
            skipped.append((name, "tar member name is not '<key>.<field>'"))
            continue
        key, fld = parts
        if key != current:
            if key in seen:
                raise ShardError(f"{shard}: key {key!r} reappears at byte offset {header_offset} "
                                 "after other keys; members of one sample must be consecutive")
            seen.add(key)
            current, fields = key, set()
        if fld in fields:
            raise ShardError(f"{shard}: duplicate member {name!r} at byte offset {header_offset}")
        fields.add(fld)
        yield key, fld, offset, size, data
    if skipped:
        name, reason = skipped[0]
        warnings.warn(f"{shard}: skipped {len(skipped)} member(s), e.g. {name!r}: {reason}", stacklevel=3)
