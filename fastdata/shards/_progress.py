"""Resumable conversions: the progress folder ``DEST/.fastdata-progress/``.

``plan.json`` holds the plan fingerprint; ``shard-NNNNNN.json`` is written (atomically) after
shard NNNNNN was renamed into place and records its ShardInfo and skipped inputs. A rerun with
the same fingerprint keeps the recorded shards whose size and sha256 still match and redoes the
rest; ``manifest.json`` is written last and the progress folder removed after it.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from collections.abc import Callable
from typing import Any

from fastdata.errors import ConversionError, ShardError
from fastdata.manifest import MANIFEST_NAME, Manifest, ShardInfo, sha256_file
from fastdata.shards._formats import SHARD_FORMATS
from fastdata.shards._plan import FINGERPRINT_KEY, PLAN_KEY, Plan, ShardResult
from fastdata.shards._listing import NEWEST_KEPT, PROGRESS_DIR


log = logging.getLogger("fastdata.convert")

_PLAN_FILE = "plan.json"


_FLAGS = {"format": "--format", "samples_per_shard": "--samples-per-shard", "shard_size": "--shard-size",
          "shuffle": "--shuffle", "seed": "--seed", "resize": "--resize", "check": "--check"}


def remove_outputs(dest: Path) -> None:
    """Remove what a conversion writes into ``dest`` (shards, indexes, manifest, progress folder).

    The manifest goes first: interrupted half way, the folder is never taken for a complete dataset.
    """
    for name in (MANIFEST_NAME, MANIFEST_NAME + ".tmp"):
        (dest / name).unlink(missing_ok=True)
    for entry in os.scandir(dest):
        name = entry.name
        if name == PROGRESS_DIR and entry.is_dir():
            shutil.rmtree(entry.path)
        elif is_output(name):
            os.unlink(entry.path)


_OUTPUT_SUFFIXES = (*(s for fmt in SHARD_FORMATS.values() for s in (fmt.suffix, fmt.index_suffix) if s), ".tmp")


def is_output(name: str) -> bool:
    """Whether a file called ``name`` in DEST is one a conversion writes (and ``--overwrite`` removes)."""
    return name in (MANIFEST_NAME, MANIFEST_NAME + ".tmp") or (
        name.startswith("shard-") and name.endswith(_OUTPUT_SUFFIXES))


def _write_json(path: Path, data: Any) -> None:
    # No fsync: a record lost or garbled by a power cut only makes the rerun redo that shard.
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, sort_keys=True), encoding="utf-8")
    os.replace(tmp, path)


def plan_changes(old_extra: Any, plan: Plan) -> str:
    """``": <what differs>"`` between the plan recorded in ``old_extra`` (a manifest's or ``plan.json``'s
    ``extra``) and ``plan``: arguments with their old and new values, SRC, the fastdata version, inputs
    added, removed or changed (a few named); ``""`` when the record says nothing (an older fastdata)."""
    old = old_extra.get(PLAN_KEY) if isinstance(old_extra, dict) else None
    new = plan.extra.get(PLAN_KEY)
    if not isinstance(old, dict) or not isinstance(new, dict):
        return ""

    def shown(key: str, value: Any) -> str:
        if value is None:
            return "unset"
        if key == "shuffle":
            return "on" if value else "off"
        return str(value)

    changes = [f"{flag} was {shown(key, old.get(key))}, now {shown(key, new.get(key))}"
               for key, flag in _FLAGS.items() if old.get(key) != new.get(key)]
    old_src, new_src = old_extra.get("source"), plan.extra.get("source")
    if isinstance(old_src, dict) and isinstance(new_src, dict):
        if old_src.get("path") != new_src.get("path"):
            changes.append(f"SRC was {old_src.get('path')}, now {new_src.get('path')}")
        elif old_src.get("kind") != new_src.get("kind"):
            changes.append(f"SRC was read as {old_src.get('kind')}, now as {new_src.get('kind')}")
        old_cls, new_cls = old_src.get("classes"), new_src.get("classes")
        if isinstance(old_cls, list) and isinstance(new_cls, list) and old_cls != new_cls:
            added, gone = [c for c in new_cls if c not in old_cls], [c for c in old_cls if c not in new_cls]
            changes.append("class folders " + ", ".join(
                ([f"added {_few(added)}"] if added else []) + ([f"removed {_few(gone)}"] if gone else [])
                or ["reordered"]))
    if old.get("fastdata") != new.get("fastdata"):
        changes.append(f"fastdata was {old.get('fastdata')}, now {new.get('fastdata')}")
    was, now = old.get("inputs"), new.get("inputs")
    if isinstance(was, dict) and isinstance(now, dict) and was != now:
        count, before = now.get("count"), was.get("count")
        if count != before:
            changes.append(f"SRC has {count} input files, was {before}")
        newer = [name for mtime, name in plan.listing.newest if mtime > int(was.get("newest_mtime_ns") or 0)]
        if newer:
            many = len(newer) == len(plan.listing.newest) == NEWEST_KEPT  # maybe more than the few kept
            changes.append(f"input files modified or added since: {_few(newer, 3, more=many)}")
        elif count == before:
            changes.append("input files renamed or replaced" if was.get("names") != now.get("names") else
                           "input files' sizes changed" if was.get("bytes") != now.get("bytes") else
                           "input files' modification times changed")
    return ": " + ", ".join(changes) if changes else ""


def _few(names: list[str], n: int = 3, *, more: bool = False) -> str:
    return ", ".join(names[:n]) + (", ..." if more or len(names) > n else "")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


class ProgressState:
    """Finished shards of one plan in one DEST; ``record`` each new one, then ``finish``."""

    def __init__(self, dest: Path, plan: Plan, done: dict[int, ShardResult]):
        self.dest = dest
        self.plan = plan
        self.done = done
        self.folder = dest / PROGRESS_DIR

    def record(self, result: ShardResult) -> None:
        """Note a shard that has been renamed into place."""
        self.done[result.number] = result
        _write_json(self.folder / f"shard-{result.number:06d}.json", {
            "plan": self.plan.fingerprint,
            "number": result.number,
            "shard": None if result.shard is None else result.shard.to_json(),
            "skipped": list(result.skipped),
            "num_planned": result.num_planned,
        })

    def finish(self) -> Manifest:
        """Write ``manifest.json`` (last) and remove the progress folder."""
        missing = [job.name for job in self.plan.jobs if job.number not in self.done]
        if missing:
            raise ConversionError(f"DEST {self.dest}: shards {missing[:3]} were not written")
        results = [self.done[job.number] for job in self.plan.jobs]
        skipped = list(self.plan.listing.skipped)
        for result in results:
            skipped.extend(result.skipped)
        manifest = Manifest(format=self.plan.options.format,
                            shards=tuple(r.shard for r in results if r.shard is not None),
                            fields=self.plan.fields, skipped=tuple(skipped), extra=self.plan.extra)
        manifest.save(self.dest)
        shutil.rmtree(self.folder, ignore_errors=True)
        return manifest


def finished(dest: Path, plan: Plan) -> Manifest | None:
    """DEST's manifest when DEST holds this plan's finished conversion, else None.

    Finished: ``manifest.json`` records the same plan fingerprint (same arguments, same inputs by
    name, size and mtime, same fastdata version), no progress folder is left, and every shard and
    index file is present with the recorded size. Checksums are ``verify``'s job.
    """
    if not (dest / MANIFEST_NAME).is_file() or (dest / PROGRESS_DIR).exists():
        return None
    try:
        manifest = Manifest.load(dest)
    except (OSError, ValueError):
        return None
    if manifest.extra.get(FINGERPRINT_KEY) != plan.fingerprint:
        return None
    for shard in manifest.shards:
        try:
            if (dest / shard.name).stat().st_size != shard.bytes:
                return None
        except OSError:
            return None
        if shard.index is not None and not (dest / shard.index).is_file():
            return None
    return manifest


def _converted(dest: Path) -> bool:
    """Whether DEST's manifest was written by a conversion (it records a plan fingerprint)."""
    saved = _read_json(dest / MANIFEST_NAME)
    extra = saved.get("extra") if isinstance(saved, dict) else None
    return isinstance(extra, dict) and FINGERPRINT_KEY in extra


def prepare(dest: Path, plan: Plan, *, overwrite: bool,
            present: Callable[[ShardInfo], bool] | None = None) -> ProgressState:
    """Make DEST ready: fresh, overwritten, or resumed (same plan fingerprint).

    ``present(shard)``: whether a recorded shard is intact where it went when it is not in
    ``dest`` (a URL DEST: ``dest`` is the local staging folder and shards are uploaded).
    """
    if dest.exists() and not dest.is_dir():
        raise ConversionError(f"DEST {dest} exists and is not a folder")
    dest.mkdir(parents=True, exist_ok=True)
    folder = dest / PROGRESS_DIR
    saved = _read_json(folder / _PLAN_FILE)
    resumable = isinstance(saved, dict) and saved.get("fingerprint") == plan.fingerprint
    if overwrite or not resumable:
        # hidden entries (.DS_Store, .Trash, ...) are ignored, as in SRC; the progress folder is not
        existing = sorted(n for n in os.listdir(dest) if not n.startswith(".") or n == PROGRESS_DIR)
        if existing and not overwrite:
            shown = ", ".join(existing[:3]) + (", ..." if len(existing) > 3 else "")
            if folder.is_dir():
                record = saved.get("extra") if isinstance(saved, dict) else None
                hint = f"an interrupted conversion with different arguments or inputs{plan_changes(record, plan)}; "
            elif _converted(dest):
                record = (_read_json(dest / MANIFEST_NAME) or {}).get("extra")
                hint = f"a finished conversion with different arguments or inputs{plan_changes(record, plan)}; "
            else:
                hint = ""
            raise ConversionError(f"DEST {dest} is not empty ({hint}holds {shown}); pass --overwrite to replace "
                                  "its shards or choose an empty folder")
        if existing:
            remove_outputs(dest)
            left = sorted(os.listdir(dest))
            if left:
                log.info("--overwrite: kept %d unrelated entries in %s (e.g. %s)", len(left), dest, left[0])
        folder.mkdir()
        _write_json(folder / _PLAN_FILE, {"fingerprint": plan.fingerprint, "num_shards": len(plan.jobs),
                                          "source": plan.listing.root, "extra": plan.extra})
        return ProgressState(dest, plan, {})
    for entry in os.scandir(dest):  # partial shards of the interrupted run
        if entry.name.startswith("shard-") and entry.name.endswith(".tmp"):
            os.unlink(entry.path)
    done = {}
    for job in plan.jobs:
        result = _kept(dest, plan, job.number, present)
        if result is not None:
            done[job.number] = result
    return ProgressState(dest, plan, done)


def _kept(dest: Path, plan: Plan, number: int,
          present: Callable[[ShardInfo], bool] | None = None) -> ShardResult | None:
    """The recorded result of shard ``number`` if its files are intact, else None (redo it)."""
    rec = _read_json(dest / PROGRESS_DIR / f"shard-{number:06d}.json")
    if not isinstance(rec, dict) or rec.get("plan") != plan.fingerprint or rec.get("number") != number:
        return None
    try:
        shard = None if rec["shard"] is None else ShardInfo(**rec["shard"])
        skipped = tuple({"source": str(s["source"]), "reason": str(s["reason"])} for s in rec["skipped"])
        result = ShardResult(number, shard, skipped, int(rec["num_planned"]))
    except (KeyError, TypeError, ValueError):
        return None
    if shard is None:
        return result
    path = dest / shard.name
    if present is not None and not path.exists():
        return result if present(shard) else None
    try:
        intact = path.stat().st_size == shard.bytes and sha256_file(path) == shard.sha256
    except OSError:
        return None
    if not intact or (shard.index is not None and not _index_intact(dest / shard.index, shard)):
        log.info("redoing %s: it changed since it was written", shard.name)
        return None
    return result


def _index_intact(path: Path, shard: ShardInfo) -> bool:
    """Whether the sidecar index at ``path`` loads and was written for ``shard`` (size, count, sha256)."""
    from fastdata.shards.tar import TarIndex

    try:
        index = TarIndex.load(path)
    except ShardError:  # missing, truncated or garbled (its records' crc32)
        return False
    return (index.tar_size == shard.bytes and len(index) == shard.num_samples
            and index.sha256 in (None, shard.sha256))
