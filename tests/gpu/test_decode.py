"""Images kept encoded through the workers (image_decode="device"), packed per batch, decoded by
fastdata.gpu.DecodeImages: packing, decoding, fallbacks, errors, reproducibility, resume; CUDA at the end."""
from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from fastdata import gpu
from fastdata.dataset import (EncodedImage, ImageInfo, PackedImages, ShardedDataset, SkippedSampleWarning, collate,
                              key_index)
from fastdata.errors import DecodeError
from fastdata.gpu import _codec
from fastdata.loader import DataLoader
from fastdata.prefetch import CUDAPrefetcher
from fastdata.shards.writer import ShardWriter
from tests.helpers.decoders import DEVICE_DECODERS, HOST_DECODERS
from tests.helpers.images import flat_png, jpeg, many_jpegs, packed, pillow_rgb, run_without_host_sync


pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


def write(tmp_path, datas: list[bytes], per_shard: int = 8):
    with ShardWriter(tmp_path / "ds", max_samples=per_shard) as w:
        for i, d in enumerate(datas):
            w.write({"__key__": f"s{i:03d}", "jpg": d, "cls": i})
    return tmp_path / "ds"


def test_packed_collate_round_trips_byte_exactly():
    rng = np.random.default_rng(0)
    datas = [rng.integers(0, 256, int(n), dtype=np.uint8).tobytes() for n in (1, 5000, 17, 300, 0, 64)]
    datas[1] = jpeg(1)
    samples = [{"__key__": f"k{i}", "img.jpg": EncodedImage(memoryview(d), shard=f"sh{i % 2}", key=f"k{i}",
                                                           index=7 * i, epoch=3), "cls": i}
               for i, d in enumerate(datas)]
    batch = collate(samples)
    p = batch["img.jpg"]
    assert isinstance(p, PackedImages) and len(p) == 6 and batch["cls"].tolist() == list(range(6))
    assert p.data.numel() == sum(map(len, datas)) and p.offsets.tolist() == list(np.cumsum([0, *map(len, datas)]))
    assert [p.tobytes(i) for i in range(6)] == datas and [bytes(v.numpy()) for v in p.views()] == datas
    assert p.indices.tolist() == [0, 7, 14, 21, 28, 35] and p.keys == tuple(f"k{i}" for i in range(6))
    assert p.shards == ("sh0", "sh1") * 3 and p.epoch == 3
    assert p.info(1) == ("jpeg", 0, 3, 8, None) and p.info(0).format == "unknown"
    assert p.where(2) == "sh0: sample 'k2'"
    q = pickle.loads(pickle.dumps(p))
    assert q == p and q is not p
    with pytest.raises(ValueError, match="several epochs"):
        PackedImages.pack([EncodedImage(b"x", shard="a", key="a", index=0, epoch=e) for e in (0, 1)])


def test_sniff_routes_what_the_device_decoder_takes():
    cases = {
        "baseline": (jpeg(1), ("jpeg", 0, 3, 8, None), True),
        "progressive": (jpeg(2, progressive=True), ("jpeg", 2, 3, 8, None), True),
        "gray": (jpeg(3, mode="L"), ("jpeg", 0, 1, 8, None), True),
        "cmyk": (jpeg(4, mode="CMYK"), ("jpeg", 0, 4, 8, 0), False),
        "png": (jpeg(5, format="PNG"), ("png", None, 0, 0, None), False),
        "truncated header": (jpeg(6)[:40], ("jpeg", None, 0, 0, None), False),
    }
    p = packed([d for d, _, _ in cases.values()])
    for i, (name, (_, info, gpu_ok)) in enumerate(cases.items()):
        assert p.info(i) == info, name
        assert _codec.device_decodable(p.info(i)) is gpu_ok, name
    assert ImageInfo(p.codes()[0]).sof == 0
    assert _codec.device_decodable_codes(p.codes()).tolist() == [ok for _, _, ok in cases.values()]


def test_header_sizes_and_max_pixels():
    datas = [jpeg(1, 50, 40), jpeg(2, 33, 44, format="PNG"), jpeg(3, 20, 10, progressive=True),
             jpeg(5, 30, 31, format="BMP"), jpeg(6)[:40]]
    p = packed(datas)
    assert p.sizes().tolist() == [[40, 50], [44, 33], [10, 20], [31, 30], [0, 0]]
    batch = {"jpg": p, "cls": torch.arange(5)}
    with pytest.raises(DecodeError, match=r"sample 'k0' field 'jpg': .*header claims 40x50 = 2000 pixels, "
                                          r"over max_pixels=1500"):
        gpu.DecodeImages(device="cpu", max_pixels=1500)(batch)
    out = gpu.DecodeImages(device="cpu", max_pixels=1000, on_error="skip")({"jpg": packed(datas[1:4]),
                                                                               "cls": torch.arange(3)})
    assert out["cls"].tolist() == [1, 2] and [im.shape[1:] for im in out["jpg"].images] == [(10, 20), (31, 30)]
    with pytest.raises(ValueError, match="max_pixels must be an int >= 1 or None"):
        gpu.DecodeImages(max_pixels=0)


def test_dataset_keeps_images_encoded_and_loader_packs_them(tmp_path):
    datas = [jpeg(i) for i in range(10)]
    root = write(tmp_path, datas, per_shard=4)
    ds = ShardedDataset(root, image_decode="device")
    sample = next(iter(ds))
    enc = sample["jpg"]
    assert isinstance(enc, EncodedImage) and bytes(enc.data) == datas[0] and isinstance(sample["cls"], int)
    assert (enc.key, enc.index, enc.epoch) == ("s000", 0, 0) and enc.shard.endswith(".tar")
    dl = DataLoader(ds, batch_size=4, num_workers=2)
    seen = {}
    for b in dl:
        p = b["jpg"]
        assert isinstance(p, PackedImages) and b["cls"].tolist() == p.indices.tolist()
        seen.update({int(g): p.tobytes(k) for k, g in enumerate(p.indices)})
    assert seen == dict(enumerate(datas))
    with pytest.raises(ValueError, match="image_decode must be one of"):
        ShardedDataset(root, image_decode="gpu")
    with pytest.raises(ValueError, match="excludes preprocess="):
        ShardedDataset(root, image_decode="device", transform=lambda x: x)
    # an explicit decoder for the image field wins: that field is decoded in the worker
    explicit = ShardedDataset(root, image_decode="device", decode={"jpg": lambda b: len(b)})
    assert next(iter(explicit))["jpg"] == len(datas[0])
    assert 0 <= key_index("a.tar", "k") < 2**63 and key_index("a.tar", "k") != key_index("a.tar", "k2")


def test_streaming_source_identity_is_a_hash_of_shard_and_key(tmp_path):
    fsspec = pytest.importorskip("fsspec")
    root = write(tmp_path, [jpeg(i) for i in range(6)], per_shard=3)
    fs = fsspec.filesystem("memory")
    urls = []
    for p in sorted(root.glob("*.tar")):
        fs.pipe(f"/fastdata-gpu-decode/{p.name}", p.read_bytes())
        urls.append(f"memory://fastdata-gpu-decode/{p.name}")
    samples = list(ShardedDataset(urls, image_decode="device"))
    assert len(samples) == 6
    for s in samples:
        enc = s["jpg"]
        assert isinstance(enc, EncodedImage) and enc.index == key_index(enc.shard, enc.key) and enc.key == s["__key__"]
    assert len({s["jpg"].index for s in samples}) == 6


@pytest.mark.parametrize("host_decoder", HOST_DECODERS)
def test_cpu_device_path_equals_pillow(host_decoder):
    datas = [jpeg(i, quality=q) for i, q in zip(range(12), [60, 75, 90, 95] * 3)]
    datas += [jpeg(20, mode="L"), jpeg(21, progressive=True)]
    ib = gpu.DecodeImages(device="cpu", host_decoder=host_decoder)({"jpg": packed(datas)})["jpg"]
    assert isinstance(ib, gpu.ImageBatch) and ib.ids.tolist() == list(range(100, 114)) and ib.epoch == 0
    for d, img in zip(datas, ib.images):
        ref = pillow_rgb(d)
        assert img.shape == ref.shape and img.dtype == torch.uint8
        assert (img.int() - ref.int()).abs().max() <= 1


@pytest.mark.parametrize("host_decoder", HOST_DECODERS)
def test_png_cmyk_and_gray_among_jpegs_decode_on_the_host_path(host_decoder):
    datas = [jpeg(0), jpeg(1, format="PNG"), jpeg(2), jpeg(3, mode="CMYK"), jpeg(4, mode="L"),
             jpeg(5, mode="RGBA", format="PNG")]
    ib = gpu.DecodeImages(device="cpu", host_decoder=host_decoder)({"jpg": packed(datas)})["jpg"]
    assert len(ib) == 6 and all(im.shape[0] == 3 for im in ib.images)
    for d, img in zip(datas, ib.images):
        assert (img.int() - pillow_rgb(d).int()).abs().max() <= 1


def corrupt_batch():
    good = [jpeg(i) for i in range(5)]
    bad = b"\xff\xd8\xff\xe0\x00\x10garbage-not-a-jpeg" + b"\x00" * 64
    return good[:2] + [bad] + good[2:], 2


@pytest.mark.parametrize("host_decoder", HOST_DECODERS)
def test_corrupt_jpeg_raises_naming_shard_key_and_field(host_decoder):
    datas, _ = corrupt_batch()
    batch = {"__key__": [f"k{i}" for i in range(6)], "jpg": packed(datas), "cls": torch.arange(6)}
    with pytest.raises(DecodeError, match=r"shard-0\.tar: sample 'k2' field 'jpg': cannot decode image \(jpeg\)"):
        gpu.DecodeImages(device="cpu", host_decoder=host_decoder)(batch)
    truncated = [jpeg(0), jpeg(1)[:-200]]  # entropy data cut short: every decoder refuses a truncated file
    with pytest.raises(DecodeError, match="sample 'k1'"):
        gpu.DecodeImages(device="cpu", host_decoder=host_decoder)({"jpg": packed(truncated)})


@pytest.mark.parametrize("on_error", ["skip", "warn"])
def test_corrupt_jpeg_is_skipped_and_shapes_stay_consistent(on_error):
    datas, _ = corrupt_batch()
    batch = {"__key__": [f"k{i}" for i in range(6)], "jpg": packed(datas), "cls": torch.arange(6),
             "meta": {"w": torch.ones(6, 2)}, "scalar": torch.tensor(5.0)}
    dec = gpu.DecodeImages(device="cpu", on_error=on_error)
    pipe = gpu.Compose(dec, gpu.RandomResizedCrop(16), gpu.Normalize())
    if on_error == "warn":
        with pytest.warns(SkippedSampleWarning, match="k2"):
            out = pipe(batch)
    else:
        out = pipe(batch)
    assert out["jpg"].shape == (5, 3, 16, 16) and out["cls"].tolist() == [0, 1, 3, 4, 5]
    assert out["__key__"] == ["k0", "k1", "k3", "k4", "k5"] and out["meta"]["w"].shape == (5, 2)
    assert out["scalar"].item() == 5.0
    assert dec.num_skipped == 1 and dec.skipped[0]["key"] == "k2" and dec.skipped[0]["index"] == 102
    # without geometric transforms the field stays an ImageBatch of the kept samples
    ib = gpu.DecodeImages(device="cpu", on_error="skip")(batch)["jpg"]
    assert ib.ids.tolist() == [100, 101, 103, 104, 105]


def pipeline(seed: int = 0):
    return gpu.Compose(gpu.DecodeImages(device="cpu", chunk_size=3), gpu.RandomResizedCrop(24, seed=seed),
                       gpu.RandomHorizontalFlip(seed=seed), gpu.Normalize(dtype=torch.bfloat16, channels_last=True))


def run_epoch(loader, *, seed=0, ahead=False):
    pipe = pipeline(seed)
    src = pipe.transforms[0].ahead(loader) if ahead else loader
    return [(b["cls"].tolist(), b["jpg"].clone()) for b in CUDAPrefetcher(src, device="cpu", transform=pipe)]


def test_same_seed_same_batches_other_epoch_other_crops(tmp_path):
    root = write(tmp_path, [jpeg(i) for i in range(24)])
    make = lambda: DataLoader(ShardedDataset(root, image_decode="device", shuffle=True, seed=1),
                              batch_size=5, num_workers=2)
    a, b = run_epoch(make()), run_epoch(make())
    assert [x[0] for x in a] == [x[0] for x in b] and all(torch.equal(x[1], y[1]) for x, y in zip(a, b))
    assert a[0][1].shape == (5, 3, 24, 24) and a[0][1].dtype == torch.bfloat16
    loader = make()
    loader.set_epoch(1)
    c = run_epoch(loader)
    by_sample = lambda run: {s: img for ids, imgs in run for s, img in zip(ids, imgs)}
    ea, ec = by_sample(a), by_sample(c)
    assert sorted(ea) == sorted(ec) == list(range(24))
    assert sum(not torch.equal(ea[s], ec[s]) for s in ea) >= 20  # other epoch: other crops for (almost) all
    assert not torch.equal(run_epoch(make(), seed=5)[0][1], a[0][1])  # another augmentation seed


@pytest.mark.parametrize("ahead", [False, True])
def test_resume_mid_epoch_gives_the_uninterrupted_batches_bit_for_bit(tmp_path, ahead):
    root = write(tmp_path, [jpeg(i) for i in range(30)])
    make = lambda: DataLoader(ShardedDataset(root, image_decode="device", shuffle=True, seed=3),
                              batch_size=4, num_workers=2)
    full = run_epoch(make(), ahead=ahead)
    first = make()
    pipe = pipeline()
    pf = CUDAPrefetcher(pipe.transforms[0].ahead(first) if ahead else first, device="cpu", transform=pipe)
    head = []
    for b in pf:
        head.append((b["cls"].tolist(), b["jpg"].clone()))
        if len(head) == 3:
            state = pf.state_dict()
            break
    pf.close()
    resumed = make()
    resumed.load_state_dict(state)
    rest = run_epoch(resumed, ahead=ahead)
    got = head + rest
    assert [x[0] for x in got] == [x[0] for x in full]
    assert all(torch.equal(x[1], y[1]) for x, y in zip(got, full))


def test_thread_decoder_packs_the_same_batches(tmp_path):
    root = write(tmp_path, [jpeg(i) for i in range(14)])
    run = lambda **kw: [(b["cls"].tolist(), [b["jpg"].tobytes(k) for k in range(len(b["jpg"]))])
                        for b in DataLoader(ShardedDataset(root, image_decode="device", shuffle=True),
                                            batch_size=4, num_workers=2, **kw)]
    assert run(decode_threads=2) == run()


def test_decode_images_validation_and_passthrough():
    with pytest.raises(ValueError, match="on_error must be one of"):
        gpu.DecodeImages(on_error="ignore")
    with pytest.raises(ValueError, match="host_decoder must be one of"):
        gpu.DecodeImages(host_decoder="magic")
    with pytest.raises(ValueError, match="chunk_size must be None or an int >= 1"):
        gpu.DecodeImages(chunk_size=0)
    with pytest.raises(ValueError, match="device must be 'cpu' or CUDA"):
        gpu.DecodeImages(device="meta")
    batch = {"x": torch.ones(2)}
    assert gpu.DecodeImages(device="cpu")(batch) is batch  # nothing packed: unchanged
    both = {"a": packed([jpeg(0), jpeg(1)]), "b": packed([jpeg(2)])}
    with pytest.raises(ValueError, match="different image counts"):
        gpu.DecodeImages(device="cpu")(both)
    only_a = gpu.DecodeImages(keys="a", device="cpu")({"a": both["a"], "b": both["b"]})
    assert isinstance(only_a["a"], gpu.ImageBatch) and isinstance(only_a["b"], PackedImages)


@pytest.mark.cuda
@pytest.mark.parametrize("device_decoder", DEVICE_DECODERS)
def test_cuda_decode_matches_host_decode(device_decoder):
    datas = many_jpegs(200)
    p = packed(datas).pin_memory()
    ib = gpu.DecodeImages(device="cuda", device_decoder=device_decoder)({"jpg": p})["jpg"]
    assert ib.images[0].is_cuda
    diffs = []
    for d, img in zip(datas, ib.images):
        ref = pillow_rgb(d)
        assert img.shape == ref.shape
        diffs.append((img.cpu().int() - ref.int()).abs())
    gray = [d for i, d in enumerate(diffs) if i % 10 == 9]
    colour = [d for i, d in enumerate(diffs) if i % 10 != 9]
    assert max(int(d.max()) for d in gray) <= 1  # no chroma: the decoders agree exactly (H100: 0)
    # colour: nvJPEG's hardware engine upsamples chroma differently from libjpeg-turbo's "fancy"
    # upsampling (H100, 200 images: mean 0.9, worst image mean 3.0, max 21, <= 5% of values off by > 8)
    means = [float(d.float().mean()) for d in colour]
    assert np.mean(means) < 1.5 and max(means) < 4.5 and max(int(d.max()) for d in colour) <= 40
    assert max(float((d > 8).float().mean()) for d in colour) < 0.1


@pytest.mark.cuda
def test_cuda_decode_stream_takes_the_callers_priority():
    """Under CUDAPrefetcher(stream_priority="high") the stage runs on the high-priority side stream;
    its own decode stream then has that priority too."""
    _, high = torch.cuda.Stream.priority_range()
    p = packed(many_jpegs(4)).pin_memory()
    stage = gpu.DecodeImages(device="cuda")
    with torch.cuda.stream(torch.cuda.Stream(priority=high)):
        ib = stage({"jpg": p})["jpg"]
    torch.cuda.synchronize()
    assert len(ib.images) == 4
    assert [s.priority for s in stage._streams.values()] == [high]


@pytest.mark.cuda
@pytest.mark.parametrize("device_decoder", DEVICE_DECODERS)
def test_cuda_stage_does_not_sync_the_host(device_decoder):
    datas = many_jpegs(40) + [jpeg(99, format="PNG")]
    p = packed(datas).pin_memory()
    pipe = gpu.Compose(gpu.DecodeImages(device="cuda", chunk_size=16, device_decoder=device_decoder),
                       gpu.RandomResizedCrop(64),
                       gpu.RandomHorizontalFlip(), gpu.Normalize(dtype=torch.bfloat16, channels_last=True))
    labels = torch.arange(len(datas), device="cuda")
    out = run_without_host_sync(pipe, {"jpg": p, "cls": labels})
    assert out["jpg"].shape == (41, 3, 64, 64) and out["jpg"].is_cuda


@pytest.mark.cuda
def test_cuda_memory_is_flat_over_30_epochs():
    datas = many_jpegs(48)
    batches = [packed(datas[k : k + 16]).pin_memory() for k in range(0, 48, 16)]
    pipe = gpu.Compose(gpu.DecodeImages(device="cuda"), gpu.RandomResizedCrop(64), gpu.RandomHorizontalFlip(),
                       gpu.Normalize(dtype=torch.bfloat16))
    allocated = []
    for epoch in range(30):
        for b in batches:
            b.epoch = epoch
            out = pipe({"jpg": b})
        del out
        torch.cuda.synchronize()
        allocated.append(torch.cuda.memory_allocated())
    assert max(allocated[2:]) - min(allocated[2:]) <= 1 << 20


@pytest.mark.cuda
@pytest.mark.parametrize("device_decoder", DEVICE_DECODERS)
def test_cuda_resampling_matches_cpu_and_skips_corrupt_images(device_decoder):
    datas, bad = corrupt_batch()
    datas = datas + many_jpegs(20)
    p = packed(datas).pin_memory()
    with pytest.raises(DecodeError, match="sample 'k2'"):
        gpu.DecodeImages(device="cuda", device_decoder=device_decoder)({"jpg": p})
    geo = lambda dev: gpu.Compose(gpu.DecodeImages(device=dev, on_error="skip", device_decoder=device_decoder),
                                  gpu.RandomResizedCrop(48), gpu.RandomHorizontalFlip())
    on_gpu = geo("cuda")({"jpg": p, "cls": torch.arange(len(datas))})
    on_cpu = geo("cpu")({"jpg": packed(datas), "cls": torch.arange(len(datas))})
    assert on_gpu["cls"].tolist() == on_cpu["cls"].tolist() == [i for i in range(len(datas)) if i != bad]
    # same geometry from the host-decoded images: fp16 canvas on the GPU vs fp32 on the CPU
    ib = gpu.DecodeImages(device="cpu")({"jpg": packed(datas[:2] + datas[3:])})["jpg"]
    lazy = gpu.RandomHorizontalFlip().apply(gpu.RandomResizedCrop(48).apply(ib))
    cpu_px = lazy.render()
    lazy.images = [im.cuda() for im in lazy.images]
    assert (lazy.render().cpu().int() - cpu_px.int()).abs().max() <= 1


@pytest.mark.cuda
def test_cuda_prefetcher_ahead_end_to_end(tmp_path):
    root = write(tmp_path, many_jpegs(40))
    loader = DataLoader(ShardedDataset(root, image_decode="device", shuffle=True), batch_size=8, num_workers=2,
                        pin_memory=True)
    pipe = gpu.Compose(gpu.DecodeImages(device="cuda"), gpu.RandomResizedCrop(32), gpu.RandomHorizontalFlip(),
                       gpu.Normalize(dtype=torch.bfloat16, channels_last=True))
    seen = []
    for b in CUDAPrefetcher(pipe.transforms[0].ahead(loader), device="cuda", transform=pipe):
        assert b["jpg"].is_cuda and b["jpg"].shape[1:] == (3, 32, 32)
        seen += b["cls"].tolist()
    assert sorted(seen) == list(range(40))


@pytest.mark.cuda
def test_cuda_max_pixels_refuses_before_decoding():
    datas = [jpeg(1, 50, 40), jpeg(2, 20, 10)]
    dec = gpu.DecodeImages(device="cuda", max_pixels=1000, on_error="skip")
    out = dec({"jpg": packed(datas).pin_memory(), "cls": torch.arange(2)})
    assert out["cls"].tolist() == [1] and out["jpg"].images[0].is_cuda and dec.num_skipped == 1
    assert "header claims 40x50" in dec.skipped[0]["reason"] and dec.host_decoded == 0


def test_packed_images_index_like_a_sequence():
    # info(-1) read the last sample index as a header code and info(n) a size (garbage, silently);
    # tobytes(-1) / tobytes(n) failed with "not enough values to unpack"
    datas = [flat_png(), b"abc", flat_png(5, 2)]
    p = PackedImages.pack([EncodedImage(d, shard="s.tar", key=f"k{i}", index=10 + i, epoch=0)
                           for i, d in enumerate(datas)])
    assert p.info(-1) == p.info(2) and p.info(-1).format == "png" and p.info(-2).format == "unknown"
    assert p.tobytes(-1) == datas[2] and p.tobytes(-3) == datas[0] and p.where(-1) == p.where(2)
    for i in (3, -4):
        for method in (p.info, p.tobytes, p.where):
            with pytest.raises(IndexError, match=f"image {i} of 3"):
                method(i)
