"""Field decoding (each kind, pickle refusal, npy and npz fields) and the deterministic transforms."""
from __future__ import annotations

import io
import json
import pickle

import numpy as np
import pytest
import torch
from PIL import Image

from fastdata.cli._synth import jpeg_bytes, synth_image
from fastdata.decode import ImageDecoder, SampleDecoder, is_image_field, suffix
from fastdata.errors import DecodeError


pytestmark = pytest.mark.filterwarnings("ignore:Unclosed:ResourceWarning")


def _png(arr: np.ndarray, mode: str | None = None) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr, mode=mode).save(buf, format="PNG")
    return buf.getvalue()


def _npy(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=True)
    return buf.getvalue()


def test_suffix_rules():
    assert suffix("seg.PNG") == "png"
    assert is_image_field("jpg") and is_image_field("left.webp") and not is_image_field("img.npy")


def test_default_decoders_each_kind():
    rgb = np.random.default_rng(0).integers(0, 256, (5, 7, 3), dtype=np.uint8)
    sample = {
        "__key__": "a/b",
        "png": _png(rgb),
        "img.npy": _npy(np.arange(6, dtype=np.int16).reshape(2, 3)),
        "cls": b"7",
        "txt": "héllo".encode(),
        "json": json.dumps({"x": [1, 2]}).encode(),
        "bin": b"\x00\x01",
    }
    out = SampleDecoder()(sample, shard="s.tar")
    assert out["__key__"] == "a/b"
    assert out["png"].dtype == torch.uint8 and out["png"].shape == (3, 5, 7)
    assert torch.equal(out["png"], torch.from_numpy(rgb).permute(2, 0, 1))
    assert out["png"].is_contiguous()
    np.testing.assert_array_equal(out["img.npy"], np.arange(6, dtype=np.int16).reshape(2, 3))
    assert out["cls"] == 7 and isinstance(out["cls"], int)
    assert out["txt"] == "héllo"
    assert out["json"] == {"x": [1, 2]}
    assert out["bin"] == b"\x00\x01"


def test_jpeg_and_webp_and_grayscale_to_rgb():
    img = synth_image(np.random.default_rng(1), 40, 30)
    buf = io.BytesIO()
    img.save(buf, format="WEBP")
    gray = _png(np.full((4, 4), 9, dtype=np.uint8))
    out = SampleDecoder()({"__key__": "k", "jpg": jpeg_bytes(img, 90), "webp": buf.getvalue(), "g.png": gray},
                          shard="s")
    assert out["jpg"].shape == (3, 30, 40) and out["webp"].shape == (3, 30, 40)
    assert out["g.png"].shape == (3, 4, 4)  # RGB by default, like torchvision's ImageFolder
    mask = SampleDecoder({"g.png": ImageDecoder(mode="L")})({"__key__": "k", "g.png": gray}, shard="s")
    assert mask["g.png"].shape == (1, 4, 4) and int(mask["g.png"][0, 0, 0]) == 9


def test_decode_false_and_mapping():
    sample = {"__key__": "k", "cls": b"3", "txt": b"x"}
    assert SampleDecoder(False)(sample, shard="s") is sample
    out = SampleDecoder({"cls": lambda b: int(b) * 10, "txt": None})(sample, shard="s")
    assert out == {"__key__": "k", "cls": 30, "txt": b"x"}
    with pytest.raises(TypeError, match=r"decode\['cls'\] must be callable"):
        SampleDecoder({"cls": 3})  # type: ignore[dict-item]


def test_non_bytes_values_pass_through():
    arr = np.zeros((3, 2, 2), dtype=np.uint8)
    out = SampleDecoder()({"__key__": "k", "img.npy": arr, "cls": np.int64(4)}, shard="s")
    assert out["img.npy"] is arr and out["cls"] == 4 and isinstance(out["cls"], int)


@pytest.mark.parametrize("field", ["pickle", "pyd", "pkl", "pth", "meta.pt"])
def test_pickle_members_are_refused(field):
    sample = {"__key__": "evil", field: pickle.dumps({"a": 1})}
    with pytest.raises(DecodeError, match=rf"shard-7\.tar: sample 'evil' field '{field}': refusing to unpickle"):
        SampleDecoder()(sample, shard="shard-7.tar")


def test_object_npy_is_refused():
    sample = {"__key__": "k", "npy": _npy(np.array([{"a": 1}], dtype=object))}
    with pytest.raises(DecodeError, match=r"s\.tar: sample 'k' field 'npy': ValueError"):
        SampleDecoder()(sample, shard="s.tar")


def test_allow_pickle():
    out = SampleDecoder(allow_pickle=True)({"__key__": "k", "pyd": pickle.dumps([1, 2])}, shard="s")
    assert out["pyd"] == [1, 2]
    buf = io.BytesIO()
    torch.save({"w": torch.arange(3)}, buf)
    out = SampleDecoder(allow_pickle=True)({"__key__": "k", "pth": buf.getvalue()}, shard="s")
    assert torch.equal(out["pth"]["w"], torch.arange(3))


def test_corrupt_image_names_shard_key_field():
    with pytest.raises(DecodeError, match=r"shard-1\.tar: sample 'cat/01' field 'jpg': UnidentifiedImageError"):
        SampleDecoder()({"__key__": "cat/01", "jpg": b"not a jpeg"}, shard="shard-1.tar")
    with pytest.raises(DecodeError, match=r"field 'cls': ValueError"):
        SampleDecoder()({"__key__": "k", "cls": b"seven"}, shard="s")


def test_draft_only_for_large_jpegs():
    data = jpeg_bytes(synth_image(np.random.default_rng(2), 640, 500), 85)
    assert ImageDecoder(draft_size=256).pil(data).size == (640, 500)  # shorter side < 2x: full decode
    assert ImageDecoder(draft_size=120).pil(data).size == (160, 125)  # 1/4 scale, still >= 120
    assert ImageDecoder(draft_size=128).pil(data).size == (320, 250)  # 1/4 would give 125 < 128
    assert ImageDecoder(draft_size=200).pil(data).size == (320, 250)


@pytest.mark.parametrize("value", ["false", "False", 0, None, np.bool_(False)])
def test_allow_pickle_must_be_a_bool_not_a_truthy_string(value, tmp_path):
    # SampleDecoder(allow_pickle="false") (a config file's string) was truthy: a shard's pickle ran its code
    import pickle

    from fastdata.dataset import ShardedDataset
    from fastdata.decode import SampleDecoder
    from fastdata.shards.writer import ShardWriter

    with pytest.raises(ValueError, match="allow_pickle must be True or False"):
        SampleDecoder(allow_pickle=value)
    with ShardWriter(tmp_path / "ds") as w:
        w.write({"__key__": "k0", "x.pkl": pickle.dumps([1, 2]), "cls": 0})
    with pytest.raises(ValueError, match="allow_pickle must be True or False"):
        ShardedDataset(tmp_path / "ds", allow_pickle=value)
    assert next(iter(ShardedDataset(tmp_path / "ds", allow_pickle=True)))["x.pkl"] == [1, 2]
    with pytest.raises(DecodeError, match="refusing to unpickle"):
        next(iter(ShardedDataset(tmp_path / "ds")))


def test_npy_fields_decode_in_several_threads_at_once() -> None:
    """NumPy parses .npy headers with ast.literal_eval, not thread-safe on CPython 3.11: a garbage collection
    running Python code mid-parse let another thread's parse fail with "SystemError: AST constructor recursion
    depth mismatch" (about 1 sample in 4,000 with decode_threads)."""
    import gc
    import io
    import sys
    import threading
    import weakref

    import numpy as np

    from fastdata.decode import SampleDecoder

    buf = io.BytesIO()
    np.save(buf, np.zeros((8, 40), np.float32))
    zbuf = io.BytesIO()
    np.savez(zbuf, a=np.ones(3), b=np.zeros((2, 2)))
    sample = {"__key__": "k", "x.npy": buf.getvalue(), "y.npz": zbuf.getvalue()}
    decoder = SampleDecoder()
    errors: list[str] = []

    class Obj:
        pass

    def callback(_: object) -> None:  # Python code the collector runs: the eval loop may switch threads
        sum(range(3))

    def work(depth: int) -> None:
        if depth:
            return work(depth - 1)
        keep = []
        for _ in range(400):
            o = Obj()
            o.self = o
            keep.append(weakref.ref(o, callback))
            del o
            if len(keep) > 100:
                keep.clear()
            try:
                decoder(dict(sample), shard="s")
            except Exception as e:  # noqa: BLE001 - every failure is the finding
                errors.append(f"{type(e).__name__}: {e}")
        return None

    interval, threshold = sys.getswitchinterval(), gc.get_threshold()
    sys.setswitchinterval(1e-6)
    gc.set_threshold(10, 1, 1)
    try:
        threads = [threading.Thread(target=work, args=(d,)) for d in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
        gc.set_threshold(*threshold)
    assert not errors, errors[:3]


@pytest.mark.parametrize("allow_pickle", [False, True])
def test_an_npz_field_that_is_no_zip_archive_says_so(allow_pickle):
    # np.load takes bytes that are neither a zip nor an .npy for a pickle: junk in an `npz` field was "pickled
    # (object) data ... load it unsafely using allow_pickle=" (advice to run a shard's bytes as code), and with
    # allow_pickle=True it was unpickled; an .npy in an `npz` field was a TypeError about context managers.
    import io
    import pickle

    import numpy as np

    from fastdata.decode import SampleDecoder
    from fastdata.errors import DecodeError

    npy = io.BytesIO()
    np.save(npy, np.arange(3))
    decoder = SampleDecoder(allow_pickle=allow_pickle)
    for data in (b"junk", npy.getvalue(), pickle.dumps({"a": 1})):
        with pytest.raises(DecodeError, match=r"'x\.npz'.*not an \.npz \(zip\) archive") as err:
            decoder.field("x.npz", data, shard="s.tar", key="k")
        assert "allow_pickle" not in str(err.value)
    z = io.BytesIO()
    np.savez(z, a=np.arange(3))
    assert decoder.field("x.npz", z.getvalue(), shard="s.tar", key="k")["a"].tolist() == [0, 1, 2]
