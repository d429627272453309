"""The device-decoder choice behind fastdata.gpu._codec (torchvision or nvImageCodec), the host
decoders, and the decode stage's handling of images a device decoder returns undecoded (None)."""
from __future__ import annotations

import io
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

from fastdata import gpu
from fastdata.dataset import EncodedImage, PackedImages, collate
from fastdata.errors import DecodeError, FastdataError
from fastdata.gpu import _codec, _decode
from tests.helpers.decoders import unimportable
from tests.helpers.images import flat_png, jpeg, many_jpegs, packed, pillow_rgb, run_without_host_sync


ENV = _codec.DEVICE_DECODER_ENV
CPU = torch.device("cpu")
BAD = b"\xff\xd8\xff\xe0\x00\x10garbage-not-a-jpeg" + b"\x00" * 64


@pytest.fixture
def fresh_status(monkeypatch):
    """nvimgcodec_status() re-evaluated in this test and after it; its env default undone."""
    monkeypatch.delenv("PYNVIMGCODEC_VERBOSITY", raising=False)
    _codec.nvimgcodec_status.cache_clear()
    yield
    _codec.nvimgcodec_status.cache_clear()


def test_device_backend_resolves_and_validates(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert _codec.device_backend() == _codec.device_backend("auto") == _codec.host_backend("auto")
    assert _codec.device_backend("torchvision") == "torchvision"
    with pytest.raises(ValueError, match=r"device_decoder must be one of .*'nvimgcodec'.*got 'nvjpeg'"):
        _codec.device_backend("nvjpeg")
    with pytest.raises(ValueError, match="DecodeImages: device_decoder must be one of"):
        gpu.DecodeImages(device_decoder="dali")
    monkeypatch.setenv(ENV, "torchvision")
    assert _codec.device_backend("auto") == "torchvision"  # the variable names the decoder of "auto"
    monkeypatch.setenv(ENV, "magic")
    with pytest.raises(ValueError, match=f"{ENV}='magic'"):
        _codec.device_backend("auto")
    with pytest.raises(ValueError, match=f"{ENV}='magic'"):
        gpu.DecodeImages(device="cpu")
    assert _codec.device_backend("torchvision") == "torchvision"  # an explicit name ignores the variable
    monkeypatch.setenv(ENV, "auto")
    dec = gpu.DecodeImages(device="cpu", device_decoder="torchvision")
    assert dec.device_decoder == "torchvision" and "device_decoder='torchvision'" in repr(dec)


def test_missing_nvimgcodec_says_how_to_install(monkeypatch, fresh_status):
    unimportable(monkeypatch, "nvidia.nvimgcodec")  # the import fails as if not installed
    nv, reason = _codec.nvimgcodec_status()
    assert nv is None and ("ImportError" in reason or "ModuleNotFoundError" in reason)
    install = "pip install nvidia-nvimgcodec-cu13 nvidia-nvjpeg"
    with pytest.raises(_codec.DecoderUnavailableError, match=f"'nvimgcodec' requested but .*`{install}`") as e:
        _codec.device_backend("nvimgcodec")
    assert isinstance(e.value, FastdataError) and isinstance(e.value, RuntimeError)
    with pytest.raises(_codec.DecoderUnavailableError, match=install):
        gpu.DecodeImages(device="cpu", device_decoder="nvimgcodec")
    monkeypatch.setenv(ENV, "nvimgcodec")
    with pytest.raises(_codec.DecoderUnavailableError, match=install):
        _codec.decode_device([torch.frombuffer(bytearray(jpeg(0)), dtype=torch.uint8)], CPU)


class StubDevice:
    """A device decoder that decodes with Pillow but returns None for the rows in ``refuse`` and for
    bytes Pillow cannot read (as nvImageCodec does), counting calls and images."""

    def __init__(self, refuse: set[bytes]) -> None:
        self.refuse = refuse
        self.calls: list[int] = []

    def __call__(self, views, device, backend="auto", **kw):
        assert backend == "nvimgcodec" and device == CPU
        self.calls.append(len(views))
        out = []
        for v in views:
            data = bytes(v.numpy())
            try:
                out.append(None if data in self.refuse else pillow_rgb(data))
            except OSError:
                out.append(None)
        return out


def test_undecoded_device_results_go_to_the_host_one_by_one(monkeypatch):
    datas = [jpeg(i) for i in range(8)]
    datas[2] = datas[2][:-200]  # sniffs as a JPEG (device-routed), entropy data cut short: undecodable
    datas[6] = BAD  # no JPEG header: routed to the host from the start
    stub = StubDevice(refuse={datas[5]})  # a good JPEG the device decoder declines
    monkeypatch.setattr(_decode, "device_backend", lambda name="auto": "nvimgcodec")
    monkeypatch.setattr(_decode, "decode_device", stub)
    host_calls = []
    real_host = _decode.decode_host

    def counting_host(data, info, backend, max_pixels=None):
        host_calls.append(bytes(data.numpy()))
        return real_host(data, info, backend, max_pixels)

    monkeypatch.setattr(_decode, "decode_host", counting_host)
    dec = gpu.DecodeImages(device="cpu", device_decoder="nvimgcodec", chunk_size=3, on_error="skip",
                           host_decoder="pillow")
    out = dec({"jpg": packed(datas), "cls": torch.arange(8)})
    assert stub.calls == [3, 3, 1]  # the 7 JPEGs went to the device decoder, in chunks
    assert sorted(host_calls) == sorted([datas[2], datas[5], BAD])  # only the undecoded rows, not their chunks
    assert out["cls"].tolist() == [0, 1, 3, 4, 5, 7] and dec.num_skipped == 2
    assert sorted(r["key"] for r in dec.skipped) == ["k2", "k6"]
    ib = out["jpg"]
    assert ib.ids.tolist() == [100, 101, 103, 104, 105, 107]
    for i, img in zip([0, 1, 3, 4, 5, 7], ib.images):
        assert torch.equal(img, pillow_rgb(datas[i]))
    with pytest.raises(DecodeError, match=r"shard-0\.tar: sample 'k2' field 'jpg': cannot decode image \(jpeg\)"):
        gpu.DecodeImages(device="cpu", device_decoder="nvimgcodec")({"jpg": packed(datas[:6])})  # no BAD: k2 fails
    # a resampled batch: rendered rows of the decoded images, the bad ones dropped
    pipe = gpu.Compose(gpu.DecodeImages(device="cpu", device_decoder="nvimgcodec", chunk_size=2, on_error="skip",
                                        host_decoder="pillow"), gpu.RandomResizedCrop(16, seed=3))
    ref = gpu.Compose(gpu.DecodeImages(device="cpu", on_error="skip", host_decoder="pillow"),
                      gpu.RandomResizedCrop(16, seed=3))
    got, want = pipe({"jpg": packed(datas)})["jpg"], ref({"jpg": packed(datas)})["jpg"]
    assert got.shape == (6, 3, 16, 16) and torch.equal(got, want)


def test_default_cpu_stage_never_calls_the_device_decoder(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setattr(_decode, "decode_device", StubDevice(set()))
    dec = gpu.DecodeImages(device="cpu")
    ib = dec({"jpg": packed([jpeg(0), jpeg(1)])})["jpg"]
    assert _decode.decode_device.calls == [] and len(ib.images) == 2


def test_nvimgcodec_cpu_decode_matches_pillow():
    pytest.importorskip("nvidia.nvimgcodec")
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90": not applied, as every decoder of fastdata does not
    datas = [jpeg(0), jpeg(1, 80, 50, progressive=True), jpeg(2, 61, 47, mode="L"),
             jpeg(3, 50, 70, mode="L", progressive=True), jpeg(4, 64, 48, exif=exif.tobytes()),
             jpeg(5, 33, 17, subsampling=0), jpeg(6, 40, 30, subsampling=1)]
    p = packed(datas)
    out = _codec.decode_device(p.views(), CPU, backend="nvimgcodec")
    assert len(out) == len(datas)
    for d, img in zip(datas, out):
        ref = pillow_rgb(d)
        assert img.dtype == torch.uint8 and img.device == CPU and img.shape == ref.shape  # (3, H, W)
        assert (img.int() - ref.int()).abs().max() <= 1
    assert out[4].shape == (3, 48, 64)


def test_nvimgcodec_cpu_corrupt_image_is_none_at_its_position():
    pytest.importorskip("nvidia.nvimgcodec")
    datas = [jpeg(0), BAD, jpeg(2), jpeg(3)[:150], jpeg(4)]
    out = _codec.decode_device(packed(datas).views(), CPU, backend="nvimgcodec")
    assert [o is None for o in out] == [False, True, False, True, False]
    for i in (0, 2, 4):
        assert (out[i].int() - pillow_rgb(datas[i]).int()).abs().max() <= 1


def test_env_var_selects_nvimgcodec_for_auto(monkeypatch):
    pytest.importorskip("nvidia.nvimgcodec")
    monkeypatch.setenv(ENV, "nvimgcodec")
    assert _codec.device_backend("auto") == "nvimgcodec"
    out = _codec.decode_device(packed([jpeg(7)]).views(), CPU)  # backend "auto"
    assert (out[0].int() - pillow_rgb(jpeg(7)).int()).abs().max() <= 1
    dec = gpu.DecodeImages(device="cpu", chunk_size=2)
    ib = dec({"jpg": packed([jpeg(i) for i in range(5)])})["jpg"]
    assert len(ib.images) == 5


def test_nvimgcodec_cpu_stage_equals_host_stage(monkeypatch):
    pytest.importorskip("nvidia.nvimgcodec")
    decoded = []
    real = _decode.decode_device

    def spy(views, device, backend="auto", **kw):
        decoded.append(len(views))
        return real(views, device, backend, **kw)

    monkeypatch.setattr(_decode, "decode_device", spy)
    datas = [jpeg(i) for i in range(9)] + [jpeg(9, format="PNG"), jpeg(10, mode="CMYK"), BAD, jpeg(12, mode="L")]
    for chunk in (None, 4):
        dec = gpu.DecodeImages(device="cpu", device_decoder="nvimgcodec", chunk_size=chunk, on_error="skip")
        got = dec({"jpg": packed(datas), "cls": torch.arange(len(datas))})
        want = gpu.DecodeImages(device="cpu", on_error="skip")({"jpg": packed(datas), "cls": torch.arange(len(datas))})
        assert got["cls"].tolist() == want["cls"].tolist() == [i for i in range(len(datas)) if i != 11]
        assert dec.skipped[0]["key"] == "k11" and sum(decoded) == 10  # the RGB and grey JPEGs
        decoded.clear()
        for a, b in zip(got["jpg"].images, want["jpg"].images):
            assert a.shape == b.shape and (a.int() - b.int()).abs().max() <= 1


@pytest.mark.cuda
def test_cuda_nvimgcodec_matches_torchvision():
    pytest.importorskip("nvidia.nvimgcodec")
    if _codec.torchvision_status()[0] is None:
        pytest.skip("torchvision's image ops do not load here")
    datas = many_jpegs(120)
    views = packed(datas).pin_memory().views()
    dev = torch.device("cuda", torch.cuda.current_device())
    nv = _codec.decode_device(views, dev, backend="nvimgcodec")
    tv = _codec.decode_device(views, dev, backend="torchvision")
    assert all(im is not None for im in nv)
    means = []
    for i, (a, b) in enumerate(zip(nv, tv)):
        assert a.is_cuda and a.dtype == torch.uint8 and a.shape == b.shape and a.is_contiguous()
        d = (a.int() - b.int()).abs()
        if i % 10 == 9:
            assert int(d.max()) <= 1  # greyscale: no chroma upsampling to differ in
        means.append(float(d.float().mean()))
    # both are nvJPEG; they may pick different backends (hardware engine, GPU, hybrid) per image
    assert np.mean(means) < 1.5 and max(means) < 4.5


@pytest.mark.cuda
def test_cuda_nvimgcodec_stage_does_not_sync_the_host():
    pytest.importorskip("nvidia.nvimgcodec")
    datas = many_jpegs(40) + [jpeg(99, format="PNG"), BAD]
    p = packed(datas).pin_memory()
    pipe = gpu.Compose(gpu.DecodeImages(device="cuda", chunk_size=16, device_decoder="nvimgcodec", on_error="skip"),
                       gpu.RandomResizedCrop(64), gpu.RandomHorizontalFlip(),
                       gpu.Normalize(dtype=torch.bfloat16, channels_last=True))
    labels = torch.arange(len(datas), device="cuda")
    out = run_without_host_sync(pipe, {"jpg": p, "cls": labels})
    assert out["jpg"].shape == (41, 3, 64, 64) and out["jpg"].is_cuda
    assert out["cls"].tolist() == list(range(41))
    # the same crops as torchvision's stage within nvJPEG's decoder differences
    ref = gpu.Compose(gpu.DecodeImages(device="cuda", chunk_size=16, on_error="skip"), gpu.RandomResizedCrop(64),
                      gpu.RandomHorizontalFlip(), gpu.Normalize(dtype=torch.bfloat16, channels_last=True))
    if _codec.torchvision_status()[0] is not None:
        want = ref({"jpg": p, "cls": labels})["jpg"]
        assert float((out["jpg"].float() - want.float()).abs().mean()) < 0.05


def _failing_device_decode(stage, monkeypatch):
    """``stage``'s device decode (CUDA or nvImageCodec) replaced by one that fails as torchvision's batched call
    does: a RuntimeError for the whole chunk (here: every image of the field routed to it)."""
    from concurrent.futures import Future

    def start(packed, views, device, ahead):
        fut: Future = Future()
        fut.set_exception(RuntimeError("no CUDA image decoding in this torchvision build"))
        rows = list(range(len(packed)))
        return device, rows, [(rows, fut)]

    monkeypatch.setattr(stage, "_start", start)


def test_a_device_decoder_that_fails_on_good_images_is_reported(monkeypatch):
    """A device decoder failing on every call (torchvision without working CUDA image ops) sent every batch
    to the host, many times slower, with a debug log line only: a batched call's RuntimeError is taken for
    a corrupt image in the chunk. Now a RuntimeWarning, once, when the host finds no corrupt image."""
    from tests.helpers.images import jpeg, packed

    stage = gpu.DecodeImages(device="cpu", host_decoder="pillow")
    _failing_device_decode(stage, monkeypatch)
    with pytest.warns(RuntimeWarning, match=r"device decoder \(auto\) failed on 2 images that decode fine on the "
                                            r"host \(RuntimeError: no CUDA image decoding"):
        out = stage({"x": packed([jpeg(1), jpeg(2)])})
    assert len(out["x"]) == 2
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        stage({"x": packed([jpeg(3)])})  # once per stage
        # a corrupt image explains the failed call: no warning, the image skipped as asked
        skip = gpu.DecodeImages(device="cpu", host_decoder="pillow", on_error="skip")
        _failing_device_decode(skip, monkeypatch)
        assert len(skip({"x": packed([jpeg(4), b"\xff\xd8\xffjunk"])})["x"]) == 1 and skip.num_skipped == 1
    assert not [w for w in seen if "device decoder" in str(w.message)]


def test_host_decoder_torchvision_without_torchvision_fails_when_built(monkeypatch):
    """DecodeImages(host_decoder="torchvision") without a working torchvision failed at the first batch, in the
    prefetcher's thread, with a plain RuntimeError; device_decoder="nvimgcodec" already failed when built."""
    from fastdata.gpu import _codec
    from fastdata.gpu._codec import DecoderUnavailableError

    monkeypatch.setattr(_codec, "torchvision_status", lambda: (None, "torchvision image ops unavailable: (as here)"))
    with pytest.raises(DecoderUnavailableError, match="decoder 'torchvision' requested but torchvision"):
        gpu.DecodeImages(device="cpu", host_decoder="torchvision")


def test_host_decoding_leaves_the_warnings_filters_alone(monkeypatch):
    # each host decode ran warnings.catch_warnings() (not thread-safe, and it resets every once-only warning):
    # with DecodeImages decoding in the prefetcher's thread, a training loop's warning that Python shows once
    # was shown at every step (194 times in 200 steps)
    import warnings

    from fastdata.gpu import _codec

    shown = []
    batch = collate([{"png": EncodedImage(flat_png(), shard="s.tar", key=f"k{i}", index=i, epoch=0)} for i in range(2)])
    dec = gpu.DecodeImages(device="cpu", host_decoder="pillow")
    with warnings.catch_warnings():
        warnings.simplefilter("default")
        monkeypatch.setattr(warnings, "showwarning", lambda *a, **k: shown.append(a[0]))
        for _ in range(3):
            warnings.warn("the same warning at every step", UserWarning)
            dec(batch)
    assert len(shown) == 1
    # Pillow's limit still refuses a bomb on the host: before decoding, naming the limit (Image.open warns first)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 11)
    data = flat_png()
    with pytest.raises(ValueError, match="12 pixels exceeds max_pixels=11"), pytest.warns(Image.DecompressionBombWarning):
        _codec.decode_host(torch.frombuffer(bytearray(data), dtype=torch.uint8), batch["png"].info(0), "pillow")


def test_torchvision_host_path_checks_a_webps_size_before_decoding(monkeypatch):
    # torchvision's decode_image has no header peek: the WebP's size is read by Pillow first (no torchvision here:
    # a stand-in records the calls)
    from types import SimpleNamespace

    from fastdata.gpu import _codec

    calls = []
    fake = SimpleNamespace(ImageReadMode=SimpleNamespace(RGB="RGB"),
                           decode_image=lambda data, mode: calls.append(1) or torch.zeros((3, 80, 100), dtype=torch.uint8))
    monkeypatch.setattr(_codec, "torchvision_status", lambda: (fake, "stand-in"))
    buf = io.BytesIO()
    Image.new("RGB", (100, 80)).save(buf, format="WEBP")
    data = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
    info = PackedImages.pack([EncodedImage(buf.getvalue(), shard="s", key="k", index=0, epoch=0)]).info(0)
    with pytest.raises(ValueError, match="8000 pixels exceeds max_pixels=7999"):
        _codec.decode_host(data, info, "torchvision", 7999)
    assert not calls
    assert _codec.decode_host(data, info, "torchvision", 8000).shape == (3, 80, 100) and calls == [1]
