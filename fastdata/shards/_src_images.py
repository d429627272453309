"""SRC kind ``images``: a folder with one subfolder per class (or a folder of unlabelled images).

Classes are the sorted subfolder names and ``cls`` is the class's index; folders are searched
recursively, symlinks followed (each real folder once). Key = ``<class>/<path below the class
without extension>`` with dots in the file name as ``_``; field = the lower-cased extension. Hidden
entries are ignored; other files, and images beside class folders, are listed as skipped.
Design note: ``docs/design/conversion.md``.
"""
from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

from fastdata.errors import SourceError
from fastdata.manifest import FieldInfo
from fastdata.shards._images import IMAGE_EXTENSIONS
from fastdata.shards._keys import check_key
from fastdata.shards._listing import Listing, file_kind, not_a_file, set_stamp
from fastdata.shards._tarfmt import member_bytes

__all__ = ["list_images"]


def _walk_files(top: Path, prefix: str = "", _seen: set[tuple[int, int]] | None = None,
                ) -> Iterator[tuple[str, os.stat_result | OSError]]:
    """``(path relative to top, stat or the error)`` of non-hidden files below ``top``, sorted.

    Symlinks are followed (each real folder once, so link cycles end); a broken one yields its
    OSError (the input is then skipped).
    """
    seen = set() if _seen is None else _seen
    try:
        st_top = top.stat()
        if (st_top.st_dev, st_top.st_ino) in seen:
            return
        seen.add((st_top.st_dev, st_top.st_ino))
        entries = sorted(os.scandir(top), key=lambda e: e.name)
    except OSError as e:
        raise SourceError(f"SRC {top}: cannot list folder: {e.strerror}") from None
    for entry in entries:
        if entry.name.startswith("."):
            continue
        rel = prefix + entry.name
        try:
            if entry.is_dir():
                yield from _walk_files(Path(entry.path), rel + "/", seen)
                continue
            st: os.stat_result | OSError = entry.stat()
        except OSError as e:
            st = e
        yield rel, st


def _image_key(rel: str) -> tuple[str, str]:
    """``(key, field)`` for an image file path relative to SRC."""
    directory, _, base = rel.rpartition("/")
    stem, dot, ext = base.rpartition(".")
    if not dot:  # no extension
        stem, ext = base, ""
    key_base = stem.replace(".", "_")
    return (f"{directory}/{key_base}" if directory else key_base), ext.lower()


def list_images(root: Path) -> Listing:
    entries = sorted(os.scandir(root), key=lambda e: e.name)
    classes = [e.name for e in entries if e.is_dir() and not e.name.startswith(".")]
    top_files = [e.name for e in entries if e.is_file() and not e.name.startswith(".")]
    if classes:  # a class folder that cannot be read would shift the labels of the classes after it
        for e in entries:
            if not (e.name.startswith(".") or e.is_dir() or e.is_file()):
                reason = not_a_file(e)
                if reason.startswith("cannot read"):
                    raise SourceError(f"{root / e.name}: {reason}; it may be a class folder, and leaving it out "
                                      "would shift the labels (cls) of the classes after it: fix or remove it")
                top_files.append(e.name)
        top_files.sort()
    listing = Listing(kind="images", root=str(root))
    stamps: list[tuple[str, int, int]] = []
    exts: set[str] = set()
    candidates: list[tuple[str, int | None, os.stat_result | OSError]] = []
    if classes:
        listing.extra["classes"] = classes
        for name in top_files:
            listing.skipped.append({"source": name, "reason": "file beside the class folders (not in a class)"})
        for cls, cname in enumerate(classes):
            found = [(rel, cls, st) for rel, st in _walk_files(root / cname, cname + "/")]
            if not any(_image_key(rel)[1] in IMAGE_EXTENSIONS for rel, _, _ in found):
                listing.skipped.append({"source": cname + "/", "reason": f"class folder without image files "
                                        f"(its class index {cls} is kept: classes are the sorted subfolders)"})
            candidates.extend(found)
    else:
        candidates = [(rel, None, st) for rel, st in _walk_files(root)]
    for rel, cls, st in candidates:
        key, ext = _image_key(rel)
        if ext not in IMAGE_EXTENSIONS:
            listing.skipped.append({"source": rel, "reason": f"not an image file (extension {ext or 'none'!r})"})
            continue
        if isinstance(st, OSError):
            listing.skipped.append({"source": rel, "reason": f"cannot read file: {st.strerror}"})
            continue
        if not stat.S_ISREG(st.st_mode):  # a fifo would block the reader forever
            listing.skipped.append({"source": rel, "reason": f"not a regular file ({file_kind(st.st_mode)})"})
            continue
        try:
            check_key(key)
        except ValueError as e:
            raise SourceError(f"{root / rel}: {e}") from None
        stamps.append((rel, st.st_size, st.st_mtime_ns))
        exts.add(ext)
        listing.keys.append(key)
        listing.refs.append((rel, cls, ext))
        image = member_bytes(f"{key}.{ext}", st.st_size)
        listing.image_sizes.append(image)
        listing.sizes.append(image + (member_bytes(f"{key}.cls", len(str(cls))) if cls is not None else 0))
        listing.image_data_sizes.append(st.st_size)
        listing.data_sizes.append(st.st_size + (8 if cls is not None else 0))
    if not listing.keys:
        what = "is empty" if not candidates and not top_files else "holds no image files"
        raise SourceError(f"SRC {root}: {what} (expected class subfolders of images "
                          f"with extensions {', '.join(sorted(IMAGE_EXTENSIONS))})")
    fields = [FieldInfo(ext, "bytes") for ext in sorted(exts)]
    if classes:
        fields.append(FieldInfo("cls", "int"))
    listing.fields = tuple(sorted(fields, key=lambda f: f.name))
    set_stamp(listing, stamps)
    return listing
