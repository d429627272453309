"""Conversion inputs shared by the shard and CLI tests: options, image folders, tars written by Python's tarfile."""
from __future__ import annotations

import io
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fastdata.cli._synth import make_image_folder
from fastdata.manifest import Manifest
from fastdata.shards.convert import ConvertOptions, convert


def pattern_png(i: int) -> bytes:
    """An 8 x 6 RGB PNG whose pixels derive from ``i``."""
    arr = (np.arange(8 * 6 * 3).reshape(6, 8, 3) * (i + 1)) % 256
    buf = io.BytesIO()
    Image.fromarray(arr.astype(np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def image_folder(root, n=6):
    """``n`` PNGs in two class folders, a and b."""
    for i in range(n):
        path = root / ("a" if i % 2 == 0 else "b") / f"{i:03d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(pattern_png(i))
    return root


def opts(**kw):
    """ConvertOptions for a test: one worker, no progress bar."""
    return ConvertOptions(workers=1, progress=False, **kw)


def interrupted_convert(monkeypatch, src, dest, options, after):
    """``convert`` stopped by a KeyboardInterrupt once ``after`` shard jobs have been written."""
    import fastdata.shards.convert as convert_mod

    real, done = convert_mod._write_job, []

    def crash_after(task, tick):
        if len(done) == after:
            raise KeyboardInterrupt
        done.append(task.job.name)
        return real(task, tick)

    monkeypatch.setattr(convert_mod, "_write_job", crash_after)
    with pytest.raises(KeyboardInterrupt):
        convert(src, dest, options)
    monkeypatch.setattr(convert_mod, "_write_job", real)


def h5_folder(tmp_path):
    """An image folder converted to HDF5 shards: the folder and its manifest."""
    out = tmp_path / "h5"
    convert(image_folder(tmp_path / "src"), out, opts(format="hdf5"))
    return out, Manifest.load(out)


def flip_bytes(path, start, n=8):
    """Flip ``n`` bytes of the file from ``start`` on."""
    data = bytearray(path.read_bytes())
    for k in range(start, min(start + n, len(data))):
        data[k] ^= 0xA5
    path.write_bytes(bytes(data))


H5_METADATA = range(0, 2560, 48)  # where a small shard keeps its superblock, object headers and heaps


def small_tar(path, keys, fields=("cls", "txt")):
    """A tar written by Python's tarfile (GNU format), one member per field, samples in order."""
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        for i, key in enumerate(keys):
            for field in fields:
                data = str(i).encode()
                info = tarfile.TarInfo(f"{key}.{field}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return path


def synth_folder(root: Path, n: int = 6, **kw) -> Path:
    """An image folder of ``n`` small generated images in 2 classes."""
    return make_image_folder(root, n, num_classes=2, min_side=16, max_side=20, **kw)
