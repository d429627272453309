"""The deterministic CPU transforms: ResizeCenterCrop and Deterministic, their arguments and outputs."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from fastdata.cli._synth import synth_image
from fastdata.dataset import ShardedDataset
from fastdata.decode import image_to_tensor
from fastdata.transforms import Deterministic, ResizeCenterCrop


pytestmark = pytest.mark.filterwarnings("ignore:Unclosed:ResourceWarning")


def _reference_resize_crop(img: Image.Image, size: int, resize: int) -> np.ndarray:
    w, h = img.size
    nw, nh = (resize, int(resize * h / w)) if w <= h else (int(resize * w / h), resize)
    big = img.resize((nw, nh), Image.Resampling.BILINEAR)
    left, top = int(round((nw - size) / 2)), int(round((nh - size) / 2))
    return np.asarray(big.crop((left, top, left + size, top + size))).transpose(2, 0, 1)


@pytest.mark.parametrize("wh", [(640, 480), (300, 517), (256, 256), (225, 400)])
def test_resize_center_crop_matches_resize_then_crop(wh):
    img = synth_image(np.random.default_rng(3), *wh)
    t = ResizeCenterCrop(224)
    out = t(img)
    assert out.shape == (3, 224, 224) and out.dtype == torch.uint8 and out.is_contiguous()
    ref = _reference_resize_crop(img, 224, 256)
    diff = np.abs(out.numpy().astype(int) - ref.astype(int))
    assert diff.max() <= 2 and diff.mean() < 0.5
    # tensors are accepted too and give the same result
    assert torch.equal(t(image_to_tensor(img)), out)


def test_resize_center_crop_params_and_fingerprint():
    t = ResizeCenterCrop(224)
    assert t.resize == 256 and t.target_size == 256
    assert ResizeCenterCrop((100, 120), resize=150)(synth_image(np.random.default_rng(0), 300, 200)).shape == (3, 100, 120)
    assert t.fingerprint != ResizeCenterCrop(224, resize=240).fingerprint
    assert t.fingerprint == ResizeCenterCrop(224).fingerprint and "v1" in t.fingerprint
    with pytest.raises(ValueError, match=r"resize must be an int >= max\(size\)=224, got 200"):
        ResizeCenterCrop(224, resize=200)
    with pytest.raises(ValueError, match="size must be"):
        ResizeCenterCrop(0)
    with pytest.raises(ValueError, match="interpolation must be one of"):
        ResizeCenterCrop(10, interpolation="cubic")
    with pytest.raises(TypeError, match=r"uint8 \(C, H, W\)"):
        t(torch.zeros(3, 4, 4))


def test_deterministic_wrapper():
    d = Deterministic(lambda x: x * 2, version="2", name="double")
    assert d(3) == 6 and d.fingerprint == "Deterministic(name=double,version=2)"
    assert Deterministic(abs, version="1").name == "abs"
    with pytest.raises(ValueError, match="version must be a non-empty string, got ''"):
        Deterministic(abs, version="")
    with pytest.raises(ValueError, match="version must be a non-empty string"):
        Deterministic(abs, version=None)  # type: ignore[arg-type]


def test_resize_center_crop_default_resize_fits_a_non_square_crop():
    """ResizeCenterCrop((100, 120)) failed with "resize must be an int >= max(size)=120, got 114", an
    argument the user had not given; True was taken as a size of 1."""
    from fastdata.transforms import ResizeCenterCrop

    t = ResizeCenterCrop((100, 120))
    assert t.resize == 120
    tall = Image.fromarray(np.random.default_rng(0).integers(0, 256, (300, 200, 3), dtype=np.uint8))
    assert t(tall).shape == (3, 100, 120)
    assert ResizeCenterCrop((200, 224)).resize == 229 and ResizeCenterCrop(224).resize == 256  # as before
    for bad in (True, (True, 4)):
        with pytest.raises(ValueError, match="size must be an int >= 1"):
            ResizeCenterCrop(bad)
    with pytest.raises(ValueError, match="resize must be an int"):
        ResizeCenterCrop(1, resize=True)


def test_sizes_given_as_bools_are_refused():
    """draft_size=True / target_size=True were taken as 1: JPEGs decoded at 1/8 scale for a cache."""
    from fastdata.decode import ImageDecoder, SampleDecoder
    from fastdata.transforms import Deterministic

    with pytest.raises(ValueError, match="draft_size must be an int >= 1 or None, got True"):
        ImageDecoder(draft_size=True)
    with pytest.raises(ValueError, match="draft_size must be an int >= 1 or None, got True"):
        SampleDecoder(draft_size=True)
    with pytest.raises(ValueError, match="target_size must be an int >= 1 or None, got True"):
        Deterministic(lambda x: x, version="1", target_size=True)


@pytest.mark.parametrize("kw", [{"name": 5}, {"name": ""}, {"name": b"f"}, {"accepts_pil": "no"},
                                {"accepts_pil": 1}, {"accepts_pil": None}])
def test_deterministic_refuses_a_non_string_name_and_a_non_bool_accepts_pil(kw):
    # accepts_pil="no" is truthy: PIL images were passed, and the cache key said ",accepts_pil"
    with pytest.raises(ValueError, match=next(iter(kw))):
        Deterministic(lambda x: x, version="1", **kw)
    d = Deterministic(lambda x: x, version="1", name="f", accepts_pil=True)
    assert d.fingerprint == "Deterministic(name=f,version=1,accepts_pil)"


def test_a_palette_mask_decoded_as_pil_keeps_its_class_ids_through_resize_center_crop(tmp_path):
    # The README's way to keep a label mask's ids through preprocess= (which resamples every image field).
    import io

    import numpy as np
    from PIL import Image

    import fastdata
    from fastdata.decode import ImageDecoder

    ids = np.zeros((16, 16), np.uint8)
    ids[:, 8:] = 5
    mask = Image.fromarray(ids, "L").convert("P")
    mask.putpalette([0, 0, 0] * 5 + [255, 0, 0] + [0, 0, 0] * 250)
    seg, photo = io.BytesIO(), io.BytesIO()
    mask.save(seg, "PNG")
    Image.new("RGB", (16, 16), (9, 9, 9)).save(photo, "PNG")
    with fastdata.ShardWriter(tmp_path / "ds") as w:
        w.write({"__key__": "k0", "png": photo.getvalue(), "seg.png": seg.getvalue()})
    resize = fastdata.ResizeCenterCrop(5)
    sample = next(iter(ShardedDataset(tmp_path / "ds", decode={"seg.png": ImageDecoder(None).pil}, preprocess=resize)))
    assert sample["seg.png"].shape == (1, 5, 5) and sorted(sample["seg.png"].unique().tolist()) == [0, 5]
    assert sample["png"].shape == (3, 5, 5)
    plain = next(iter(ShardedDataset(tmp_path / "ds", preprocess=resize)))
    assert plain["seg.png"].shape == (3, 5, 5)  # the default: RGB, resampled like a photo
