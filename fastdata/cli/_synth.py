"""Synthetic, photo-like image corpora for the demo, tests and benchmarks (no downloads).

Images are smooth random colour fields with fine-grained noise, so that JPEG sizes and
decode costs resemble real photos far better than flat or pure-noise images do.
"""
from __future__ import annotations

import io
import json
import os
import re
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image


def _class_colour(cls: int) -> np.ndarray:
    """A fixed, well-separated mean colour per class, so small models can learn the labels."""
    hue = (cls * 0.381966) % 1.0  # golden-ratio steps around the colour wheel
    angles = 2 * np.pi * (hue + np.array([0.0, 1 / 3, 2 / 3]))
    return 128 + 90 * np.cos(angles)


def synth_image(rng: np.random.Generator, width: int, height: int, cls: int | None = None) -> Image.Image:
    """One photo-like RGB image of the given size; ``cls`` tints it with that class's colour."""
    coarse = rng.integers(0, 256, size=(int(rng.integers(4, 12)), int(rng.integers(4, 12)), 3), dtype=np.uint8)
    if cls is not None:
        coarse = (0.5 * coarse + 0.5 * _class_colour(cls)).astype(np.uint8)
    base = np.asarray(Image.fromarray(coarse).resize((width, height), Image.BICUBIC), dtype=np.int16)
    detail = rng.normal(0.0, 10.0, size=(height, width, 1)).astype(np.int16)
    return Image.fromarray(np.clip(base + detail, 0, 255).astype(np.uint8))


def jpeg_bytes(img: Image.Image, quality: int) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def _write_images(root: Path, jobs: list[tuple[int, int, int, int, int]], num_classes: int, seed: int) -> int:
    for i, cls, w, h, q in jobs:
        path = root / f"class_{cls:02d}" / f"img_{i:06d}.jpg"
        if path.exists():
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # an interrupted write leaves no truncated JPEG
        tmp.write_bytes(jpeg_bytes(synth_image(np.random.default_rng([seed, i]), w, h, cls), q))
        os.replace(tmp, path)
    return len(jobs)


_STAMP = ".fastdata-synth.json"  # the arguments the folder's images were generated with
_GENERATED = re.compile(r"(class_\d{2,}/img_\d{6,}\.jpg|class_\d{2,}/\.img_\d{6,}\.jpg\.\d+\.tmp)")


def _keep_only(root: Path, wanted: set[str], settings: dict[str, object]) -> None:
    """Remove the generated files of ``root`` that are not ``wanted`` (all of them when an earlier run used
    other ``settings``); refuse a folder holding anything else but hidden files, which the demo would train on
    too."""
    stamp = root / _STAMP
    try:
        same = json.loads(stamp.read_text()) == settings
    except (OSError, ValueError):
        same = False
    stamp.unlink(missing_ok=True)  # rewritten once the folder holds what ``settings`` describe
    if not root.is_dir():
        return
    foreign = []
    for cls_dir in sorted(root.iterdir()):
        if cls_dir.name.startswith("."):  # the stamp, .DS_Store: no class (readers skip hidden entries)
            continue
        if not cls_dir.is_dir() or not re.fullmatch(r"class_\d{2,}", cls_dir.name):
            foreign.append(cls_dir.name)
            continue
        for f in sorted(cls_dir.iterdir()):
            rel = f"{cls_dir.name}/{f.name}"
            if not _GENERATED.fullmatch(rel) or not f.is_file():
                if not f.name.startswith("."):
                    foreign.append(rel)
            elif not same or rel not in wanted:
                f.unlink()
    if foreign:
        from fastdata.errors import FastdataError

        raise FastdataError(f"{root}: holds {', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}, which "
                            "were not generated here; use an empty or new folder for the generated images")


def make_image_folder(
    dest: str | os.PathLike[str],
    num_images: int,
    *,
    num_classes: int = 10,
    min_side: int = 300,
    max_side: int = 640,
    quality: tuple[int, int] = (75, 95),
    seed: int = 0,
    workers: int = 1,
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Write ``num_images`` JPEGs into ``dest/class_XX/img_XXXXXX.jpg`` (ImageFolder layout).

    Sizes are drawn uniformly in [min_side, max_side] per side and quality in ``quality``;
    the same arguments always give byte-identical files, whatever ``workers`` (processes) is.
    Afterwards ``dest`` holds exactly these images: files an earlier call with the same arguments
    wrote are kept (not generated again), other generated ones (a larger ``num_images``, other
    sizes or seed) are removed, and a file this function did not write is refused
    (:class:`~fastdata.errors.FastdataError`). ``progress(done, total)`` is called as images are written.
    """
    root = Path(dest)
    rng = np.random.default_rng(seed)
    jobs = []
    for i in range(num_images):
        w, h = (int(v) for v in rng.integers(min_side, max_side + 1, size=2))
        jobs.append((i, i % num_classes, w, h, int(rng.integers(quality[0], quality[1] + 1))))
    settings: dict[str, object] = {"num_classes": num_classes, "min_side": min_side, "max_side": max_side,
                                   "quality": list(quality), "seed": seed}
    _keep_only(root, {f"class_{cls:02d}/img_{i:06d}.jpg" for i, cls, *_ in jobs}, settings)
    _write_all(root, jobs, num_images, num_classes, seed, workers, progress)
    (root / _STAMP).write_text(json.dumps(settings))
    return root


def _write_all(root: Path, jobs: list[tuple[int, int, int, int, int]], num_images: int, num_classes: int,
               seed: int, workers: int, progress: Callable[[int, int], None] | None) -> None:
    chunks = [jobs[i:i + 32] for i in range(0, len(jobs), 32)]
    done = 0
    if workers <= 1 or len(chunks) <= 1:
        for chunk in chunks:
            done += _write_images(root, chunk, num_classes, seed)
            if progress is not None:
                progress(done, num_images)
        return
    with ProcessPoolExecutor(max_workers=workers) as pool:
        for n in pool.map(_write_images, [root] * len(chunks), chunks, [num_classes] * len(chunks),
                          [seed] * len(chunks)):
            done += n
            if progress is not None:
                progress(done, num_images)
