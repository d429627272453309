"""DecodeImages as a stage of a device transform: its arguments, the keys it looks in, skipped and
oversized images, chunks joined, state after a new iter()."""
from __future__ import annotations

import io
import struct

import pytest
import torch
from PIL import Image

import fastdata
import fastdata.gpu
import fastdata.train
from fastdata import gpu
from fastdata.dataset import EncodedImage, collate
from fastdata.errors import DecodeError, FastdataError, SkipBudgetError
from fastdata.gpu import CenterCrop, Compose, ImageBatch, Resize
from fastdata.prefetch import CUDAPrefetcher
from tests.helpers.batches import batch_cls
from tests.helpers.images import flat_png, jpeg, smooth


def _claiming(data: bytes, width: int, height: int) -> bytes:
    """A PNG whose IHDR claims another size (a corrupt header)."""
    out = bytearray(data)
    out[16:24] = struct.pack(">II", width, height)
    return bytes(out)


def test_a_header_claiming_a_side_of_2_to_the_31_pixels_is_a_bad_image_not_a_crash_of_the_collate():
    # a corrupt PNG header (height 0xFFFFFFFF) made the worker's collate raise a bare OverflowError
    # (no shard, no key), even under on_error="skip": the whole batch was lost
    datas = [flat_png(), _claiming(flat_png(), 5, 0xFFFFFFFF), _claiming(flat_png(), 0xFFFFFFFF, 0x80000000), flat_png()]
    batch = collate([{"png": EncodedImage(d, shard="s0.tar", key=f"k{i}", index=i, epoch=0), "cls": i}
                     for i, d in enumerate(datas)])
    sizes = batch["png"].sizes()
    assert sizes[0].tolist() == [3, 4] and (sizes[1:3] >= 2**31 - 1).any(axis=1).all()
    with pytest.raises(DecodeError, match=r"s0\.tar: sample 'k1' field 'png'.*max_pixels"):
        gpu.DecodeImages(device="cpu")(batch)
    dec = gpu.DecodeImages(device="cpu", on_error="skip")
    out = gpu.Compose(dec, gpu.CenterCrop(4))(batch)
    assert tuple(out["png"].shape) == (2, 3, 4, 4) and out["cls"].tolist() == [0, 3]
    assert [r["key"] for r in dec.skipped] == ["k1", "k2"]


@pytest.mark.parametrize("fmt", ["WEBP", "TIFF", "PPM"])
def test_max_pixels_refuses_images_whose_size_is_not_sniffed_too(fmt):
    # only JPEG/PNG/GIF/BMP sizes are sniffed in the worker; a WebP, TIFF or PNM over max_pixels was decoded
    # (the CPU path, SampleDecoder(max_pixels=), refuses them)
    buf = io.BytesIO()
    Image.new("RGB", (100, 80), (1, 2, 3)).save(buf, format=fmt)
    batch = collate([{"img": EncodedImage(d, shard="s.tar", key=f"k{i}", index=i, epoch=0)}
                     for i, d in enumerate([buf.getvalue(), flat_png(), buf.getvalue()])])
    with pytest.raises(DecodeError, match=r"s\.tar: sample 'k0' field 'img'.*8000 pixels exceeds max_pixels=1000"):
        gpu.DecodeImages(device="cpu", max_pixels=1000)(batch)
    dec = gpu.DecodeImages(device="cpu", max_pixels=1000, on_error="skip")
    assert tuple(dec(batch)["img"].images[0].shape) == (3, 3, 4) and [r["key"] for r in dec.skipped] == ["k0", "k2"]
    assert tuple(gpu.DecodeImages(device="cpu", max_pixels=8000)(batch)["img"].images[0].shape) == (3, 80, 100)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda", 1)], ids=["name", "index", "torch-device"])
def test_decode_images_on_cuda_without_cuda_fails_when_built(device):
    # it failed only at the first batch, in the prefetcher's thread, with a bare AssertionError ("Torch not
    # compiled with CUDA enabled"); CUDAPrefetcher(device="cuda") already refused when built
    with pytest.raises(ValueError, match="DecodeImages: device=.*cuda.* but CUDA is not available"):
        gpu.DecodeImages(device=device)


def test_an_os2_bmp_is_decoded_not_refused_as_a_bomb():
    # an OS/2 BMP (12-byte BITMAPCOREHEADER: 16-bit width and height) was sniffed with the 32-bit layout of later
    # headers: a 5x3 image "claimed 1572865x196613 pixels" and was refused as over max_pixels
    w, h = 5, 3
    row = bytes([10, 20, 30]) * w + b"\0"
    bmp = b"BM" + struct.pack("<IHHI", 26 + 3 * len(row), 0, 0, 26) + struct.pack("<IHHHH", 12, w, h, 1, 24) + row * h
    assert Image.open(io.BytesIO(bmp)).size == (w, h)
    batch = collate([{"img": EncodedImage(bmp, shard="s.tar", key="k0", index=0, epoch=0)}])
    assert batch["img"].sizes().tolist() == [[h, w]]
    out = gpu.DecodeImages(device="cpu")(batch)["img"].images[0]
    assert out.shape == (3, h, w) and out[:, 0, 0].tolist() == [30, 20, 10]


def test_gpu_decode_skip_of_a_whole_batch_keeps_the_batch_shape(tmp_path):
    # DecodeImages(on_error="skip") + RandomResizedCrop(8): a batch whose every image is corrupt came out
    # as an empty ImageBatch instead of a (0, 3, 8, 8) tensor like the others' (N, 3, 8, 8)
    import io

    from PIL import Image

    from fastdata import gpu
    def jpg(i):
        buf = io.BytesIO()
        Image.new("RGB", (20 + i, 30), (i, i, i)).save(buf, format="JPEG")
        return buf.getvalue()
    with fastdata.ShardWriter(tmp_path / "s") as w:
        for i in range(12):
            w.write({"__key__": f"k{i:02d}", "jpg": jpg(i) if not 4 <= i < 8 else b"\xff\xd8 corrupt", "cls": i})
    loader = fastdata.DataLoader(fastdata.ShardedDataset(tmp_path / "s", image_decode="device"), batch_size=4,
                                 num_workers=0)
    decode = gpu.DecodeImages(device="cpu", on_error="skip")
    stage = gpu.Compose(decode, gpu.RandomResizedCrop(8), gpu.Normalize())
    with fastdata.CUDAPrefetcher(loader, device="cpu", transform=stage) as batches:
        shapes = [(tuple(b["jpg"].shape), b["jpg"].dtype, len(b["__key__"])) for b in batches]
    assert shapes == [((4, 3, 8, 8), torch.float32, 4), ((0, 3, 8, 8), torch.float32, 0),
                      ((4, 3, 8, 8), torch.float32, 4)]
    assert decode.num_skipped == 4


def test_decode_images_bad_device_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match="DecodeImages: device must be .* got 'foo'"):  # was torch's RuntimeError
        fastdata.gpu.DecodeImages(device="foo")


def test_decode_images_finding_nothing_to_decode_says_so(tmp_path):
    # DecodeImages(keys=["image"]) on a batch packed under "jpg", or over a loader built without
    # image_decode="device", returned the batch as it was: PackedImages (or PIL-decoded images) went on,
    # and Compose(DecodeImages(...), CenterCrop(8)) dropped the crop without a word
    import io

    from PIL import Image

    from fastdata import gpu
    buf = io.BytesIO()
    Image.new("RGB", (16, 12)).save(buf, format="JPEG")
    with fastdata.ShardWriter(tmp_path / "s") as w:
        for i in range(4):
            w.write({"__key__": f"k{i}", "jpg": buf.getvalue(), "cls": i})
    packed = next(iter(fastdata.DataLoader(fastdata.ShardedDataset(tmp_path / "s", image_decode="device"),
                                           batch_size=4, num_workers=0)))
    with pytest.raises(ValueError, match=r"keys \['image'\] match none of the batch's packed image fields \['jpg'\]"):
        gpu.Compose(gpu.DecodeImages(device="cpu", keys=["image"]), gpu.CenterCrop(8))(packed)
    decoded = next(iter(fastdata.DataLoader(fastdata.ShardedDataset(tmp_path / "s"), batch_size=4, num_workers=0)))
    with pytest.raises(ValueError, match="holds no packed images for .*CenterCrop.*image_decode='device'"):
        gpu.Compose(gpu.DecodeImages(device="cpu"), gpu.CenterCrop(8))(decoded)
    assert gpu.DecodeImages(device="cpu")(decoded) is decoded  # alone, nothing to decode: unchanged, as before
    out = gpu.Compose(gpu.DecodeImages(device="cpu", keys=["jpg"]), gpu.CenterCrop(8))(packed)
    assert tuple(out["jpg"].shape) == (4, 3, 8, 8)


def test_decode_ahead_state_after_a_new_iter_is_the_new_epochs_start(loader_factory):
    """``DecodeImages.ahead(loader).state_dict()`` after ``iter()`` is the loader's (a new epoch's start), as
    without the wrapper. Before: the state of the batch last yielded by the abandoned iteration, which the
    prefetcher also took as the new epoch's start state (a resume from it skipped batches)."""
    from fastdata import gpu

    make = loader_factory
    full = [batch_cls(b) for b in make()]
    ahead = gpu.DecodeImages(device="cpu").ahead(make())
    it = iter(ahead)
    next(it), next(it)
    assert ahead.state_dict()["batches"] == 2
    it = iter(ahead)
    assert ahead.state_dict()["batches"] == 0
    assert [batch_cls(b) for b in it] == full
    with CUDAPrefetcher(gpu.DecodeImages(device="cpu").ahead(make()), device="cpu") as P:
        it = iter(P)
        next(it), next(it)
        it.close()
        it = iter(P)
        assert P.state_dict()["batches"] == 0
        assert [batch_cls(b) for b in it] == full


@pytest.mark.parametrize("keys", [5.0, [1.5], True, [], [None], object()])
def test_decode_images_keys_are_checked_when_built(keys):
    """Before: a float or an object failed with a bare ``TypeError: 'float' object is not iterable``, and
    ``[1.5]``, ``True`` (matching index 1), ``[]`` and ``[None]`` were accepted."""
    from fastdata import gpu

    with pytest.raises(ValueError, match="DecodeImages: keys must be"):
        gpu.DecodeImages(keys=keys, device="cpu")
    assert gpu.DecodeImages(keys="jpg", device="cpu").keys == frozenset({"jpg"})
    assert gpu.DecodeImages(keys=["jpg", 0], device="cpu").keys == frozenset({"jpg", 0})


def test_images_packed_in_a_dataclass_or_another_mapping_are_not_passed_on_undecoded():
    """Before: ``DecodeImages`` found packed images in dicts, lists and tuples only, so a dataclass batch
    (a typed collate_fn) or a UserDict went through ``Compose(DecodeImages(), Normalize())`` untouched: the
    model got the encoded PackedImages without a word."""
    import collections
    import dataclasses

    from tests.helpers.images import jpeg, packed

    from fastdata import gpu

    @dataclasses.dataclass
    class Batch:
        jpg: object
        cls: torch.Tensor

    pipe = gpu.Compose(gpu.DecodeImages(device="cpu"), gpu.Normalize())
    with pytest.raises(ValueError, match=r"packed images at 'jpg' sit in a Batch; .* dicts, lists and tuples"):
        pipe(Batch(packed([jpeg(0), jpeg(1)]), torch.arange(2)))
    with pytest.raises(ValueError, match=r"packed images at 'x.jpg' sit in a UserDict"):
        pipe({"x": collections.UserDict(jpg=packed([jpeg(0)]))})
    plain = Batch(torch.zeros(2, 3, 4, 4, dtype=torch.uint8), torch.arange(2))  # nothing packed: as before
    assert pipe(plain).jpg.dtype == torch.float32


def _batch(datas: list[bytes], *, epoch: int = 0, first: int = 0, shard: str = "bad.tar") -> dict:
    return collate([{"png": EncodedImage(d, shard=shard, key=f"k{first + i}", index=first + i, epoch=epoch),
                     "cls": first + i} for i, d in enumerate(datas)])


def test_decode_images_max_skips_caps_the_skips_of_an_epoch():
    # DecodeImages had no budget: a shard of bad images under on_error="skip" gave empty batches for a whole
    # epoch (each skip counted), whatever the dataset's max_skips said
    bad = b"\xff\xd8 not an image"
    dec = gpu.DecodeImages(device="cpu", on_error="skip", max_skips=2)
    out = dec(_batch([bad, jpeg(90, 4, 3, format="PNG"), bad]))  # 2 skips: within the budget
    assert out["cls"].tolist() == [1] and dec.num_skipped == 2
    assert dec.skipped[0]["epoch"] == 0
    with pytest.raises(SkipBudgetError, match=r"bad\.tar.*'k4'.*max_skips=2") as info:
        dec(_batch([jpeg(90, 4, 3, format="PNG"), bad], first=3))
    assert isinstance(info.value, FastdataError) and [r["key"] for r in info.value.skipped] == ["k0", "k2", "k4"]
    # another epoch counts from zero; a sample skipped again (a repeated pass over an epoch) counts once
    dec(_batch([bad, bad], epoch=1))
    dec(_batch([bad, bad], epoch=1))
    with pytest.raises(SkipBudgetError, match="epoch 1"):
        dec(_batch([bad], epoch=1, first=7))
    # a validation pipeline sharing the stage (its own epochs) does not reset the training epoch's count
    dec(_batch([bad, bad], epoch=2))
    dec(_batch([bad], epoch=7, shard="val.tar"))
    with pytest.raises(SkipBudgetError, match="epoch 2"):
        dec(_batch([bad], epoch=2, first=5))
    # "warn" is bounded too; None (default) has no limit
    warn = gpu.DecodeImages(device="cpu", on_error="warn", max_skips=0)
    with pytest.warns(Warning), pytest.raises(SkipBudgetError, match="'k0'"):
        warn(_batch([bad]))
    free = gpu.DecodeImages(device="cpu", on_error="skip")
    for e in range(3):
        free(_batch([bad] * 3, epoch=0, first=3 * e))
    assert free.num_skipped == 9


@pytest.mark.parametrize("value", [-1, True, 0.5, "3", 1.0])
def test_decode_images_max_skips_is_checked_when_built(value):
    with pytest.raises(ValueError, match=r"DecodeImages: max_skips"):
        gpu.DecodeImages(device="cpu", on_error="skip", max_skips=value)


def test_geometric_transforms_after_a_second_decode_stage_reach_the_first_stages_images():
    # Compose(DecodeImages(keys=["jpg"]), DecodeImages(keys=["png"]), CenterCrop(4)) cropped "png" only: the crop
    # was fused into the second stage, and the first stage's images were rendered before it, uncropped (8x10)
    batch = collate([{"jpg": EncodedImage(jpeg(i, 10 + 2 * i, 8, format="PNG"), shard="s.tar", key=f"k{i}", index=i, epoch=0),
                      "png": EncodedImage(jpeg(i, 6, 5, format="PNG"), shard="s.tar", key=f"k{i}", index=i, epoch=0), "cls": i}
                     for i in range(2)])
    first, second = gpu.DecodeImages(keys=["jpg"], device="cpu"), gpu.DecodeImages(keys=["png"], device="cpu")
    out = gpu.Compose(first, second, gpu.CenterCrop(4))(batch)
    assert tuple(out["jpg"].shape) == tuple(out["png"].shape) == (2, 3, 4, 4)
    out = gpu.Compose(first, gpu.Resize(4), second, gpu.CenterCrop(3))(batch)  # ragged after Resize: still pending
    assert tuple(out["jpg"].shape) == tuple(out["png"].shape) == (2, 3, 3, 3)
    one = gpu.Compose(gpu.DecodeImages(device="cpu"), gpu.CenterCrop(4))(batch)  # one stage: as before
    assert torch.equal(one["jpg"], gpu.Compose(first, second, gpu.CenterCrop(4))(batch)["jpg"])


def test_decode_chunks_joined_keep_their_padding():
    """DecodeImages joins per-chunk ImageBatches (CUDA, nvImageCodec) with ``_concat``: the padding frame
    and view window of each image go with it, so the joined batch renders as the parts do."""
    from fastdata.gpu._decode import _concat

    imgs = [smooth(20, 30, 1), smooth(9, 12, 2), smooth(25, 16, 3)]
    parts = [CenterCrop(22).apply(CenterCrop((6, 8)).apply(Resize(12).apply(ImageBatch(imgs[:2], [0, 1], 0)))),
             Resize((22, 22)).apply(CenterCrop(44).apply(ImageBatch(imgs[2:], [2], 0)))]
    joined = _concat(parts, [2, 0, 1])  # the first part's images were rows 2 and 0, the second's row 1
    want = torch.cat([p.render() for p in parts])[[1, 2, 0]]
    assert torch.equal(joined.render(), want)
    assert joined.ids.tolist() == [1, 2, 0]


def test_a_skipped_sample_leaves_the_other_image_fields_too():
    """DecodeImages(keys=["jpg"], on_error="skip") dropped a bad sample from the tensors and lists of the batch
    but not from its other image fields (packed, or decoded by an earlier stage): 3 png images, 2 labels."""
    from tests.helpers.images import jpeg, packed

    bad = b"\xff\xd8\xffjunk"
    batch = {"jpg": packed([jpeg(1), bad, jpeg(3)]), "png": packed([jpeg(k, format="PNG") for k in (4, 5, 6)]),
             "depth": ImageBatch([smooth(4 + k, 5, k) for k in range(3)], [100, 101, 102], 0), "cls": torch.arange(3)}
    skip = gpu.DecodeImages(keys=["jpg"], device="cpu", host_decoder="pillow", on_error="skip")
    out = Compose(skip, CenterCrop(8))(batch)
    assert out["jpg"].shape[0] == 2 and out["cls"].tolist() == [0, 2]
    assert out["png"].keys == ("k0", "k2") and out["png"].indices.tolist() == [100, 102]
    assert [out["png"].tobytes(i) for i in range(2)] == [batch["png"].tobytes(0), batch["png"].tobytes(2)]
    assert out["depth"].ids.tolist() == [100, 102]
    png = gpu.DecodeImages(keys=["png"], device="cpu", host_decoder="pillow")(out)["png"]
    assert len(png) == 2  # decoded later, still one image per label
    # every sample bad: the other fields are empty too
    none = Compose(skip, CenterCrop(8))({"jpg": packed([bad, bad]), "png": packed([jpeg(7), jpeg(8)])})
    assert none["jpg"].shape[0] == 0 and len(none["png"]) == 0


def _write_detection_set(dest, boxes_rows):
    import numpy as np

    import fastdata

    with fastdata.ShardWriter(dest) as w:
        for i in range(3):
            data = jpeg(i, 16, 16) if i != 1 else jpeg(i, 16, 16)[:200] + b"\0" * 50  # sample 1 corrupt
            w.write({"__key__": f"s{i}", "jpg": data, "boxes.npy": np.full((boxes_rows(i), 4), i, np.float32),
                     "cls": i})
    return fastdata.ShardedDataset(dest, image_decode="device")


def test_decode_skip_drops_the_skipped_samples_item_of_a_per_sample_list(tmp_path):
    import pytest
    import torch

    import fastdata
    from fastdata import gpu
    from fastdata.dataset import collate
    from fastdata.errors import DecodeError

    ds = _write_detection_set(tmp_path / "a", lambda i: i + 2)

    def detection(samples):  # images packed, boxes as a per-sample list (a custom collate)
        out = collate([{k: v for k, v in s.items() if k != "boxes.npy"} for s in samples])
        out["boxes"] = [torch.as_tensor(s["boxes.npy"]) for s in samples]
        out["targets"] = [{"labels": torch.as_tensor(s["boxes.npy"])[:, 0]} for s in samples]
        return out

    stage = gpu.Compose(gpu.DecodeImages(device="cpu", on_error="skip"), gpu.CenterCrop(8))
    (b,) = [stage(b) for b in fastdata.DataLoader(ds, batch_size=3, num_workers=0, collate_fn=detection)]
    # the skipped sample s1's boxes stayed, paired with s2's image, and s1's boxes (3 rows = n) lost a row
    assert b["__key__"] == ["s0", "s2"] and b["jpg"].shape[0] == 2
    assert [t.shape[0] for t in b["boxes"]] == [2, 4] and [int(t[0, 0]) for t in b["boxes"]] == [0, 2]
    assert [len(t["labels"]) for t in b["targets"]] == [2, 4]
    # every sample with 3 boxes in a batch of 3: a list field of 3 batched tensors looks the same: refused
    stage = gpu.Compose(gpu.DecodeImages(device="cpu", on_error="skip"))
    ds = _write_detection_set(tmp_path / "b", lambda i: 3)
    loader = fastdata.DataLoader(ds, batch_size=3, num_workers=0,
                                 collate_fn=lambda s: {k: v for k, v in detection(s).items() if k != "targets"})
    with pytest.raises(DecodeError, match=r"\['boxes'\] is a list of 3 items of 3 rows"):
        for b in loader:
            stage(b)
