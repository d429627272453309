"""GPU decode + augment stage of fastdata (issue 9): throughput, correctness, sync freedom, memory, backend.

    python3 benchmarks/gpu/decode_gpu.py --out DIR [--budget 120] [--images 1024] [--device-decoder nvimgcodec]

Runs from the repository root on a CUDA machine (no webdataset needed). Every part is guarded: a
failing part is reported in the table and the JSON, and the rest still runs. Parts, in order:

  decode       the device decoder alone (fastdata.gpu._codec.decode_device; --device-decoder, default
               torchvision.io.decode_jpeg(list, device="cuda"), or nvImageCodec), batches 128/256
  stage        DecodeImages + RandomResizedCrop(224) + RandomHorizontalFlip + Normalize(bf16, channels_last)
               from pinned PackedImages, batches 128/256 (target: > 15,900 images/s)
  augment      the same without decoding (pre-decoded ImageBatch): resampling cost alone
  naive        a naive reference in the same run: per-image paste into a padded canvas +
               torchvision.ops.roi_align + flip + normalise, batch 128
  correctness  GPU decode vs host decode (max/mean abs difference), GPU vs CPU resampling of the same geometry
  sync         the stage under torch.cuda.set_sync_debug_mode("error") on a side stream
  memory       30 epochs of the stage: allocated/reserved memory per epoch
  backend      baseline vs progressive decode rate (torchvision sends baseline JPEGs to nvJPEG's hardware
               backend when the GPU has JPEG engines, progressive ones to the hybrid path); NVML JPEG-engine
               utilisation during decode when NVML reports it; a bf16 matmul stream's slowdown while decoding
  roi          whether decode-time ROI/reduced-scale decoding is available (nvImageCodec) and what it could save
  resnet18     training step rate on resident batches vs fed through CUDAPrefetcher(transform=stage) from
               in-memory packed batches (does decoding overlap training instead of stealing the GPU?)
  loader       end to end: tar shards -> ShardedDataset(image_decode="device") -> DataLoader(4 workers)
               -> CUDAPrefetcher(transform=stage) -> resnet18

Writes DIR/decode_gpu.json and prints a short table.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import io
import json
import os
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fastdata.cli._synth import jpeg_bytes, synth_image
from fastdata.dataset import EncodedImage, PackedImages

T0 = time.perf_counter()
RESULTS: dict = {}
ROWS: list[tuple[str, str]] = []


OUT_JSON: Path | None = None  # DIR/decode_gpu.json, rewritten after every part


def row(name: str, text: str) -> None:
    """One line of the final table (printed now too: a run stopped by its time limit keeps it in the log)."""
    ROWS.append((name, text))
    print(f"  {name}  {text}", flush=True)


def save() -> None:
    """Write what was measured so far: a time limit that kills the script keeps the finished parts."""
    if OUT_JSON is not None:
        RESULTS["total_seconds"] = round(elapsed(), 1)
        OUT_JSON.write_text(json.dumps(RESULTS, indent=1, default=str))


def elapsed() -> float:
    return time.perf_counter() - T0


def part(name: str, budget_left: float, need: float):
    """Decorator: run a part if time allows; record errors instead of crashing."""
    def wrap(fn):
        if budget_left - elapsed() < need:
            RESULTS[name] = {"skipped": f"not enough time left ({budget_left - elapsed():.0f}s < {need}s)"}
            row(name, "skipped (time)")
            return fn
        t = time.perf_counter()
        try:
            out = fn()
            RESULTS[name] = out
        except Exception as e:  # noqa: BLE001 - one failing part must not stop the run
            RESULTS[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
            row(name, f"ERROR {type(e).__name__}: {str(e)[:120]}")
        RESULTS.setdefault(name, {})
        if isinstance(RESULTS[name], dict):
            RESULTS[name]["seconds"] = round(time.perf_counter() - t, 2)
        save()
        return fn
    return wrap


def _one(args):
    i, seed, progressive = args
    rng = np.random.default_rng([seed, i])
    w, h = (int(v) for v in rng.integers(300, 641, size=2))
    q = int(rng.integers(75, 96))
    img = synth_image(rng, w, h, i % 10)
    if progressive:
        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=q, progressive=True)
        return buf.getvalue()
    return jpeg_bytes(img, q)


def corpus(n: int, seed: int, progressive: bool = False) -> list[bytes]:
    with cf.ProcessPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as ex:
        return list(ex.map(_one, [(i, seed, progressive) for i in range(n)], chunksize=16))


def packed(datas: list[bytes], bs: int, epoch: int = 0, base: int = 0) -> list[PackedImages]:
    out = []
    for k in range(0, len(datas) - bs + 1, bs):
        ims = [EncodedImage(d, shard="synthetic", key=f"{base + k + j}", index=base + k + j, epoch=epoch)
               for j, d in enumerate(datas[k : k + bs])]
        out.append(PackedImages.pack(ims).pin_memory())
    return out


def rate(fn, batches, *, reps: int = 3, warm: int = 1, count=len) -> dict:
    """Images/s of fn over all batches, median of reps (after warm-up), with a device sync at the ends."""
    for b in batches[:warm]:
        fn(b)
    torch.cuda.synchronize()
    rates = []
    for _ in range(reps):
        t = time.perf_counter()
        n = 0
        for b in batches:
            fn(b)
            n += count(b)
        torch.cuda.synchronize()
        rates.append(n / (time.perf_counter() - t))
    return {"images_per_s": round(float(np.median(rates))), "reps": [round(r) for r in rates]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget", type=float, default=120.0, help="seconds for the whole run")
    ap.add_argument("--images", type=int, default=1024)
    ap.add_argument("--device-decoder", default="auto", choices=("auto", "torchvision", "nvimgcodec"),
                    help="device JPEG decoder of every part (auto: torchvision unless FASTDATA_DEVICE_DECODER names another)")
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    budget = args.budget
    if not torch.cuda.is_available():
        print("decode_gpu: no CUDA device; nothing to measure")
        (out_dir / "decode_gpu.json").write_text(json.dumps({"error": "no CUDA"}))
        return
    dev = torch.device("cuda", 0)
    global OUT_JSON
    OUT_JSON = out_dir / "decode_gpu.json"
    import torchvision

    from fastdata import gpu
    from fastdata.gpu import _codec

    RESULTS["env"] = {"torch": torch.__version__, "torchvision": torchvision.__version__, "cuda": torch.version.cuda,
                      "gpu": torch.cuda.get_device_name(0), "cpus": len(os.sched_getaffinity(0)),
                      "python": sys.version.split()[0], "codec": _codec.torchvision_status()[1]}
    dd = _codec.device_backend(args.device_decoder)  # the device decoder of every part
    RESULTS["env"]["device_decoder"] = dd
    if dd == "nvimgcodec":
        RESULTS["env"]["nvimgcodec"] = _codec.nvimgcodec_status()[1]
    t = time.perf_counter()
    datas = corpus(args.images, 0)
    RESULTS["corpus"] = {"images": len(datas), "mean_kB": round(float(np.mean([len(d) for d in datas])) / 1e3, 1),
                         "sides_px": [300, 640], "quality": [75, 95], "seconds": round(time.perf_counter() - t, 1),
                         "kind": "synthetic photo-like JPEGs (fastdata.cli._synth), baseline, 4:2:0"}
    row("corpus", f"{len(datas)} JPEGs, mean {RESULTS['corpus']['mean_kB']} kB")
    batches = {bs: packed(datas, bs) for bs in (128, 256)}
    stream = torch.cuda.Stream()

    def stage_fn(chunk: int | None = None):
        return gpu.Compose(gpu.DecodeImages(device=dev, chunk_size=chunk, device_decoder=dd), gpu.RandomResizedCrop(224),
                           gpu.RandomHorizontalFlip(), gpu.Normalize(dtype=torch.bfloat16, channels_last=True))

    @part("decode", budget, 10)
    def _decode():
        res = {}
        for bs, bl in batches.items():
            res[f"bs{bs}"] = rate(lambda p: _codec.decode_device(p.views(), dev, dd), bl)
            row(f"decode bs{bs}", f"{res[f'bs{bs}']['images_per_s']:,} img/s ({dd} decode_device)")
        return res

    @part("stage", budget, 15)
    def _stage():
        res = {}
        for bs, bl in batches.items():
            fn = stage_fn()
            with torch.cuda.stream(stream):
                r = rate(lambda p, fn=fn: fn({"jpg": p}), bl)
            res[f"bs{bs}"] = r
            row(f"stage bs{bs}", f"{r['images_per_s']:,} img/s decode+RRC224+flip+norm bf16 CL "
                                 f"(naive ref 15,900; x{r['images_per_s'] / 15900:.2f})")
        for bs, bl, chunk in ((128, batches[128], None), (256, batches[256], None), (256, batches[256], 128)):
            # DecodeImages.ahead: batch i+1 decodes while batch i is resampled
            fn = stage_fn(chunk)
            dec = fn.transforms[0]
            key = f"ahead_bs{bs}" + ("" if chunk is None else f"_chunk{chunk}")

            def run_ahead(fn=fn, dec=dec, bl=bl * 3):  # 3 passes: a pipeline needs a few batches to fill
                with torch.cuda.stream(stream):
                    for p in dec.ahead(bl):
                        fn({"jpg": p})
            run_ahead()
            torch.cuda.synchronize()
            rates = []
            for _ in range(3):
                t = time.perf_counter()
                run_ahead()
                torch.cuda.synchronize()
                rates.append(3 * sum(len(p) for p in bl) / (time.perf_counter() - t))
            res[key] = {"images_per_s": round(float(np.median(rates))), "reps": [round(r) for r in rates]}
            row(f"stage+ahead bs{bs} chunk{chunk or 'all'}", f"{res[key]['images_per_s']:,} img/s with "
                f"DecodeImages.ahead (x{res[key]['images_per_s'] / 15900:.2f} of 15,900)")
        for chunk in (64, 256):  # default (halves) above; 256 = no overlap of decode and resampling
            fn = stage_fn(chunk)
            with torch.cuda.stream(stream):
                res[f"bs256_chunk{chunk}"] = rate(lambda p, fn=fn: fn({"jpg": p}), batches[256], reps=2)
        row("stage bs256 chunks", ", ".join(f"{c}: {res[f'bs256_chunk{c}']['images_per_s']:,}"
                                             for c in (64, 256)) + " img/s (halves: above)")
        return res

    @part("augment", budget, 10)
    def _augment():
        res = {}
        aug = gpu.Compose(gpu.RandomResizedCrop(224), gpu.RandomHorizontalFlip(),
                          gpu.Normalize(dtype=torch.bfloat16, channels_last=True))
        dec = gpu.DecodeImages(device=dev, device_decoder=dd)
        for bs, bl in batches.items():
            decoded = [dec({"jpg": p}) for p in bl]
            res[f"bs{bs}"] = rate(aug, decoded, count=lambda b: len(b["jpg"]))
            ib = decoded[0]["jpg"]
            rrc = gpu.RandomResizedCrop(224).lazy(ib)
            from fastdata.gpu._augment import _groups

            ry, rx = rrc.clip[:, 1] - rrc.clip[:, 0], rrc.clip[:, 3] - rrc.clip[:, 2]
            hw = np.array([im.shape[1:] for im in rrc.images])
            res[f"bs{bs}"]["groups"] = len(_groups(hw[:, 0], hw[:, 1], 3, 1 << 27))
            full = hw[:, 0] * hw[:, 1]
            res[f"bs{bs}"]["mean_crop_area_fraction"] = round(float(np.mean(ry * rx / full)), 3)
            row(f"augment bs{bs}", f"{res[f'bs{bs}']['images_per_s']:,} img/s RRC+flip+norm on decoded "
                                   f"({res[f'bs{bs}']['groups']} groups)")
        return res

    @part("naive", budget, 10)
    def _naive():
        from torchvision.ops import roi_align

        rrc = gpu.RandomResizedCrop(224)
        mean = torch.tensor([0.485, 0.456, 0.406], device=dev).view(1, 3, 1, 1) * 255
        std = torch.tensor([0.229, 0.224, 0.225], device=dev).view(1, 3, 1, 1) * 255

        def naive(p):
            imgs = _codec.decode_device(p.views(), dev, dd)
            hs = np.array([im.shape[1] for im in imgs])
            ws = np.array([im.shape[2] for im in imgs])
            canvas = torch.zeros((len(imgs), 3, int(hs.max()), int(ws.max())), device=dev)
            for k, im in enumerate(imgs):
                canvas[k, :, : im.shape[1], : im.shape[2]] = im
            top, left, h, w = rrc.params(hs, ws, p.indices.numpy(), 0)
            boxes = np.stack([np.arange(len(imgs)), left, top, left + w, top + h], 1).astype(np.float32)
            out = roi_align(canvas, torch.from_numpy(boxes).to(dev, non_blocking=True), (224, 224), aligned=True)
            flip = torch.from_numpy(gpu.RandomHorizontalFlip().flips(p.indices.numpy(), 0)).to(dev, non_blocking=True)
            out = torch.where(flip.view(-1, 1, 1, 1), out.flip(-1), out)
            return ((out - mean) / std).to(torch.bfloat16).contiguous(memory_format=torch.channels_last)

        r = rate(naive, batches[128])
        row("naive bs128", f"{r['images_per_s']:,} img/s (padded canvas + roi_align, same run)")
        return r

    @part("correctness", budget, 10)
    def _correct():
        bl = batches[128][:2]
        worst, means, undecoded = 0, [], 0
        for p in bl:
            g = _codec.decode_device(p.views(), dev, dd)
            for k, v in enumerate(p.views()):
                if g[k] is None:  # nvImageCodec could not decode it (the stage would host-decode it)
                    undecoded += 1
                    continue
                c = _codec.decode_host(v, p.info(k), _codec.host_backend("auto"))
                d = (g[k].cpu().int() - c.int()).abs()
                worst, means = max(worst, int(d.max())), means + [float(d.float().mean())]
        ib = gpu.DecodeImages(device="cpu")({"jpg": bl[0]})["jpg"]
        lazy = gpu.Compose(gpu.RandomResizedCrop(224), gpu.RandomHorizontalFlip()).transforms
        geo = lazy[1].apply(lazy[0].apply(ib))
        cpu_out = geo.render()
        geo.images = [im.to(dev) for im in geo.images]
        gpu_out = geo.render().cpu()
        dr = (cpu_out.int() - gpu_out.int()).abs()
        res = {"decode_gpu_vs_host_max_abs": worst, "decode_gpu_vs_host_mean_abs": round(float(np.mean(means)), 4),
               "images_compared": sum(len(p) for p in bl) - undecoded, "device_undecoded": undecoded,
               "host_decoder": _codec.host_backend("auto"),
               "render_gpu_fp16_vs_cpu_fp32_max_abs": int(dr.max()),
               "render_frac_pixels_differing": round(float((dr > 0).float().mean()), 5)}
        row("correctness", f"decode max|gpu-host| {worst}, mean {res['decode_gpu_vs_host_mean_abs']}; "
                           f"render max|gpu-cpu| {int(dr.max())}")
        return res

    @part("sync", budget, 5)
    def _sync():
        fn = stage_fn()
        p = batches[128][0]
        fn({"jpg": p})  # warm (first calls allocate)
        torch.cuda.synchronize()
        try:
            torch.cuda.set_sync_debug_mode("error")
            with torch.cuda.stream(stream):
                fn({"jpg": p})
            res = {"sync_free": True}
        except RuntimeError as e:
            res = {"sync_free": False, "error": str(e)[:500]}
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
        row("sync", "no host sync in the stage" if res["sync_free"] else f"SYNC: {res['error'][:100]}")
        return res

    @part("memory", budget, 15)
    def _memory():
        fn = stage_fn()
        alloc, reserved = [], []
        bl = batches[128][:3]
        for epoch in range(30):
            with torch.cuda.stream(stream):
                for p in bl:
                    p.epoch = epoch
                    y = fn({"jpg": p})
            del y
            torch.cuda.synchronize()
            alloc.append(torch.cuda.memory_allocated(dev))
            reserved.append(torch.cuda.memory_reserved(dev))
        for p in bl:
            p.epoch = 0
        res = {"allocated_MB": [round(a / 2**20, 1) for a in alloc], "reserved_MB": [round(r / 2**20, 1) for r in reserved],
               "allocated_growth_MB_epoch2_to_30": round((alloc[-1] - alloc[1]) / 2**20, 2),
               "reserved_growth_MB_epoch2_to_30": round((reserved[-1] - reserved[1]) / 2**20, 2)}
        row("memory", f"30 epochs: allocated growth {res['allocated_growth_MB_epoch2_to_30']} MB, "
                      f"reserved growth {res['reserved_growth_MB_epoch2_to_30']} MB")
        return res

    @part("backend", budget, 20)
    def _backend():
        res = {"torchvision_source": "decode_jpegs_cuda.cpp: nvjpegCreateEx(NVJPEG_BACKEND_HARDWARE) first, "
                                     "default backend on NVJPEG_STATUS_ARCH_MISMATCH; baseline JPEGs accepted by "
                                     "nvjpegDecodeBatchedSupported go to nvjpegDecodeBatched (hardware engines), "
                                     "others one by one through the hybrid decoder"}
        prog = corpus(256, 1, progressive=True)
        base = datas[:256]
        pb, bb = packed(prog, 128), packed(base, 128)
        res["baseline_bs128"] = rate(lambda p: _codec.decode_device(p.views(), dev, dd), bb)
        res["progressive_bs128"] = rate(lambda p: _codec.decode_device(p.views(), dev, dd), pb, reps=1)
        try:
            import pynvml

            from fastdata.monitor import nvml_handle

            pynvml.nvmlInit()
            h = nvml_handle(pynvml, dev.index)[0]  # by UUID: NVML's index 0 is not CUDA's under CUDA_VISIBLE_DEVICES
            samples, stop = [], threading.Event()

            def poll():
                while not stop.is_set():
                    try:
                        samples.append(pynvml.nvmlDeviceGetJpgUtilization(h)[0])
                    except Exception as e:  # noqa: BLE001
                        samples.append(f"{type(e).__name__}: {e}")
                        return
                    time.sleep(0.02)

            th = threading.Thread(target=poll, daemon=True)
            th.start()
            t = time.perf_counter()
            while time.perf_counter() - t < 1.5:
                for p in bb:
                    _codec.decode_device(p.views(), dev, dd)
            torch.cuda.synchronize()
            stop.set()
            th.join()
            nums = [s for s in samples if isinstance(s, (int, float))]
            res["nvml_jpg_utilization_percent"] = {"max": max(nums) if nums else None,
                                                   "mean": round(float(np.mean(nums)), 1) if nums else None,
                                                   "samples": len(nums), "note": [s for s in samples if isinstance(s, str)][:1]}
        except Exception as e:  # noqa: BLE001
            res["nvml_jpg_utilization_percent"] = {"error": f"{type(e).__name__}: {e}"}
        # a bf16 matmul stream alone vs while the stage decodes in another thread
        a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
        mm_stream = torch.cuda.Stream()

        def mm_rate(seconds: float) -> float:
            with torch.cuda.stream(mm_stream):
                torch.cuda.synchronize()
                t, n = time.perf_counter(), 0
                while time.perf_counter() - t < seconds:
                    for _ in range(4):
                        a @ a
                    n += 4
                    mm_stream.synchronize()
                return n / (time.perf_counter() - t)

        mm_rate(0.3)
        alone = mm_rate(1.5)
        stop = threading.Event()
        fn = stage_fn()
        decoded = [0]

        def decode_loop():
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                while not stop.is_set():
                    for p in batches[128]:
                        fn({"jpg": p})
                        decoded[0] += len(p)
                        if stop.is_set():
                            break
                s.synchronize()

        th = threading.Thread(target=decode_loop, daemon=True)
        th.start()
        time.sleep(0.3)
        d0, t0 = decoded[0], time.perf_counter()
        busy = mm_rate(1.5)
        d1, t1 = decoded[0], time.perf_counter()
        stop.set()
        th.join()
        res["matmul_8192_bf16_per_s_alone"] = round(alone, 2)
        res["matmul_per_s_while_stage_runs"] = round(busy, 2)
        res["matmul_slowdown"] = round(alone / busy, 3)
        res["stage_images_per_s_while_matmul"] = round((d1 - d0) / (t1 - t0))
        row("backend", f"baseline {res['baseline_bs128']['images_per_s']:,} vs progressive "
                       f"{res['progressive_bs128']['images_per_s']:,} img/s; matmul slowdown x{res['matmul_slowdown']} "
                       f"while stage runs ({res['stage_images_per_s_while_matmul']:,} img/s); NVML JPG util "
                       f"{res['nvml_jpg_utilization_percent']}")
        return res

    @part("roi", budget, 3)
    def _roi():
        res = {"torchvision": "torchvision.io.decode_jpeg has no region-of-interest or reduced-scale option"}
        try:
            import importlib

            importlib.import_module("nvidia.nvimgcodec")

            res["nvimgcodec"] = "importable (not measured by this script)"
        except Exception as e:  # noqa: BLE001
            res["nvimgcodec"] = f"not available: {type(e).__name__}: {e}"
        rrc = gpu.RandomResizedCrop(224)
        hs = np.array([int(np.random.default_rng([0, i]).integers(300, 641, size=2)[1]) for i in range(len(datas))])
        ws = np.array([int(np.random.default_rng([0, i]).integers(300, 641, size=2)[0]) for i in range(len(datas))])
        _, _, h, w = rrc.params(hs, ws, np.arange(len(datas)), 0)
        frac = h * w / (hs * ws)
        res["rrc_mean_crop_area_fraction"] = round(float(frac.mean()), 3)
        res["rrc_mean_shrink_factor"] = round(float(np.mean(np.sqrt(h * w) / 224)), 3)
        row("roi", f"no ROI/scale decode in torchvision; nvImageCodec: {res['nvimgcodec'][:40]}; RRC keeps "
                   f"{res['rrc_mean_crop_area_fraction']:.0%} of the pixels on average")
        return res

    def resnet_setup(bs: int):
        import torchvision.models as tvm

        model = tvm.resnet18(num_classes=1000).to(dev).to(memory_format=torch.channels_last)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

        def step(x, y):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        return step

    @part("resnet18", budget, 40)
    def _resnet():
        from fastdata.prefetch import CUDAPrefetcher

        bs = 256
        step = resnet_setup(bs)
        x = torch.randn(bs, 3, 224, 224, device=dev).to(torch.bfloat16).contiguous(memory_format=torch.channels_last)
        y = torch.randint(0, 1000, (bs,), device=dev)
        for _ in range(5):
            step(x, y)
        torch.cuda.synchronize()
        t, n = time.perf_counter(), 0
        while time.perf_counter() - t < 3:
            step(x, y)
            n += bs
        torch.cuda.synchronize()
        alone = n / (time.perf_counter() - t)
        bl = batches[256]
        feed = [{"jpg": p, "cls": torch.randint(0, 1000, (len(p),))} for p in bl]

        class Cycle:
            def __init__(self, steps):
                self.steps = steps

            def __iter__(self):
                for k in range(self.steps):
                    yield feed[k % len(feed)]

        steps = max(10, int(alone * 4 / bs))

        def fed_rate(priority: str) -> float:
            # seamless=False and close(): a seamless prefetcher starts the next pass of its iterable as soon
            # as the last batch is pulled, decoding more batches with the same stage in its thread: inside
            # the timed window, and (the warm-up one) beside the timed prefetcher's thread
            fn = stage_fn()  # a fresh stage: its decode stream takes the side stream's priority
            with CUDAPrefetcher(fn.transforms[0].ahead(Cycle(10)), device=dev, transform=fn,
                                stream_priority=priority, seamless=False) as pf:
                for b in pf:  # warm-up
                    step(b["jpg"], b["cls"])
            torch.cuda.synchronize()
            with CUDAPrefetcher(fn.transforms[0].ahead(Cycle(steps)), device=dev, transform=fn,
                                stream_priority=priority, seamless=False) as pf:
                t = time.perf_counter()
                for b in pf:
                    step(b["jpg"], b["cls"])
                torch.cuda.synchronize()
                return steps * bs / (time.perf_counter() - t)

        # normal, high, normal, high: the order's drift shows in the repeats
        rates = {"normal": [], "high": []}
        for priority in ("normal", "high", "normal", "high"):
            rates[priority].append(fed_rate(priority))
        fed, fed_hi = float(np.median(rates["normal"])), float(np.median(rates["high"]))
        res = {"batch": bs, "resident_images_per_s": round(alone), "fed_images_per_s": round(fed),
               "fed_share_of_resident": round(fed / alone, 3),
               "fed_high_priority_images_per_s": round(fed_hi), "fed_high_priority_share": round(fed_hi / alone, 3),
               "reps": {k: [round(r) for r in v] for k, v in rates.items()},
               "note": "packed batches from memory (no workers): isolates the device stage's overlap with training; "
                       "high: CUDAPrefetcher(stream_priority='high')"}
        row("resnet18", f"resident {round(alone):,} img/s; fed by prefetcher+stage {round(fed):,} "
                        f"({fed / alone:.0%}); high-priority stream {round(fed_hi):,} ({fed_hi / alone:.0%})")
        return res

    @part("loader", budget, 30)
    def _loader():
        from fastdata.dataset import ShardedDataset
        from fastdata.loader import DataLoader
        from fastdata.prefetch import CUDAPrefetcher
        from fastdata.shards.writer import ShardWriter

        tmp = Path(tempfile.mkdtemp(prefix="decode_gpu_"))
        with ShardWriter(tmp / "ds", max_samples=256) as w:
            for i, d in enumerate(datas):
                w.write({"__key__": f"s{i:06d}", "jpg": d, "cls": i % 1000})
        res = {}
        bs = 256
        step = resnet_setup(bs)
        for workers in (4,):
            ds = ShardedDataset(tmp / "ds", image_decode="device", shuffle=True)
            dl = DataLoader(ds, batch_size=bs, num_workers=workers, pin_memory=True, drop_last=True,
                            persistent_workers=True, prefetch_factor=4)
            fn = stage_fn()
            pf = CUDAPrefetcher(fn.transforms[0].ahead(dl), device=dev, transform=fn)
            for b in pf:  # warm-up epoch (workers start, cuDNN autotune)
                step(b["jpg"], b["cls"])
            torch.cuda.synchronize()
            t, n = time.perf_counter(), 0
            for epoch in range(1, 4):
                pf.set_epoch(epoch)
                for b in pf:
                    step(b["jpg"], b["cls"])
                    n += len(b["cls"])
            torch.cuda.synchronize()
            r = n / (time.perf_counter() - t)
            res[f"workers{workers}_images_per_s"] = round(r)
            row(f"loader w{workers}", f"{round(r):,} img/s tar -> 4 workers -> prefetcher+stage -> resnet18")
            pf.close()
        return res

    save()
    width = max(len(n) for n, _ in ROWS)
    print(f"\ndecode_gpu ({RESULTS['env']['gpu']}, torch {torch.__version__}, torchvision {torchvision.__version__}, "
          f"{RESULTS['total_seconds']} s)")
    for n, v in ROWS:
        print(f"  {n.ljust(width)}  {v}")


if __name__ == "__main__":
    main()
