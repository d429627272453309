"""Collating samples into batches: samples that do not fit one batch (other image sizes, jpg beside
png) are errors naming the field, the position and the samples."""
from __future__ import annotations

import pytest

from fastdata.dataset import ShardedDataset


pytestmark = pytest.mark.filterwarnings("ignore:Unclosed:ResourceWarning")


def _images_of_two_sizes(dest) -> str:
    import io

    from PIL import Image

    from fastdata import ShardWriter

    with ShardWriter(dest) as w:
        for i in range(4):
            buf = io.BytesIO()
            Image.new("RGB", (8 + (i == 2), 8), (i, i, i)).save(buf, "PNG")
            w.write({"__key__": f"k{i}", "png": buf.getvalue(), "cls": i})
    return str(dest)


@pytest.mark.parametrize("path", ["in-process", "workers", "threads"])
def test_a_batch_of_images_of_other_sizes_names_the_field_and_samples(tmp_path, path):
    # Images of different sizes without preprocess= (the most common first mistake): the collate failed with
    # torch's bare "stack expects each tensor to be equal size, but got [3, 8, 8] at entry 0 and [3, 8, 9] at
    # entry 2": no field, no sample, no remedy.
    from fastdata import DataLoader

    ds = ShardedDataset(_images_of_two_sizes(tmp_path / "ds"))
    loader = DataLoader(ds, batch_size=4, num_workers=0 if path == "in-process" else 1,
                        decode_threads=1 if path == "threads" else 0)
    with pytest.raises(RuntimeError, match=r"field 'png'.*'k0': \(3, 8, 8\).*'k2': \(3, 8, 9\).*preprocess="):
        list(loader)


def test_a_batch_of_tuples_with_images_of_other_sizes_names_the_position(tmp_path):
    # sample_transform=lambda s: (s["png"], s["cls"]), the usual tuple form: the bare torch message again.
    from fastdata import DataLoader

    ds = ShardedDataset(_images_of_two_sizes(tmp_path / "ds"), sample_transform=lambda s: (s["png"], s["cls"]))
    with pytest.raises(RuntimeError, match=r"element 0 of each sample in different shapes \(sample 0 of the batch: "
                                           r"\(3, 8, 8\); sample 2 of the batch: \(3, 8, 9\)\)"):
        list(DataLoader(ds, batch_size=4))


@pytest.mark.parametrize(("num_workers", "decode_threads", "image_decode"),
                         [(0, 0, "cpu"), (2, 0, "cpu"), (1, 2, "cpu"), (0, 0, "device")])
def test_a_batch_of_jpg_and_png_samples_is_a_clear_error(tmp_path, num_workers, decode_threads, image_decode) -> None:
    """Image fields sharing a base name are alternatives, so an image folder of .jpg and .png files gives
    samples with either: the collate failed with a bare KeyError: 'png'."""
    import io
    import multiprocessing as mp

    from PIL import Image

    from fastdata import DataLoader, ShardedDataset
    from fastdata.errors import MissingFieldError
    from fastdata.shards.writer import ShardWriter

    def image(fmt: str) -> bytes:
        buf = io.BytesIO()
        Image.new("RGB", (12, 10), (9, 99, 199)).save(buf, fmt)
        return buf.getvalue()

    with ShardWriter(tmp_path / "ds", max_samples=5) as w:
        for i in range(6):
            w.write({"__key__": f"s{i:03d}", **({"jpg": image("JPEG")} if i % 2 else {"png": image("PNG")}), "cls": i})
    ds = ShardedDataset(tmp_path / "ds", image_decode=image_decode)
    kw = {"multiprocessing_context": mp.get_context("fork")} if num_workers else {}
    loader = DataLoader(ds, batch_size=3, num_workers=num_workers, decode_threads=decode_threads, **kw)
    with pytest.raises(MissingFieldError, match=r"different fields .*s00\d: \['cls', 'png'\]; s00\d: \['cls', 'jpg'\]"):
        list(loader)
