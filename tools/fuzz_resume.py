"""Resume and elastic fuzzer over fastdata's public API, for checking a change (runs at any commit).

    PYTHONPATH=. python tools/fuzz_resume.py resume 500 7    # KIND CASES SEED
    PYTHONPATH=. python tools/fuzz_resume.py elastic 500 7

resume: a chain of 1-10 interruptions, each resumed by a fresh loader on a random path (worker processes
or decode threads, at the case's ``num_workers``, which fixes the order), must give the uninterrupted
run's batches, in order, for epochs 0 and 1.
elastic: W1 ranks with N1 workers take 0-4 batches and save; W2 ranks with N2 workers load the list:
every remaining position exactly once and equal batch counts across the new ranks, allowing only the
documented exception (one worker per rank: fewer than W2 repeats, with a warning; docs/guide/resume.md).
Prints each failing case and a count; exits 1 when any failed.
"""

import json
import random
import sys
import tempfile
import warnings
from collections import Counter
from pathlib import Path

from fastdata.dataset import ShardedDataset, ShuffleOptions
from fastdata.loader import DataLoader
from fastdata.shards.tar import write_tar_shard

warnings.filterwarnings("ignore")
BS = 4


def collate(samples):
    return [int(s["cls"]) for s in samples]


def make(dest):
    sizes = [9, 4, 11, 7, 3, 10, 8, 5]
    paths, i = [], 0
    for j, size in enumerate(sizes):
        p = dest / f"s{j}.tar"
        write_tar_shard(p, [{"__key__": f"k{i + k:04d}", "cls": str(i + k).encode()} for k in range(size)])
        paths.append(str(p))
        i += size
    return paths


def loader(shards, rank, world, path, workers, *, even="pad", drop_last=False, shuffle=True, threads=2):
    ds = ShardedDataset(
        shards,
        shuffle=ShuffleOptions(open_shards=2, buffer_size=8) if shuffle else False,
        seed=7,
        rank=rank,
        world_size=world,
        even=even,
    )
    # num_workers fixes the order on every path; decode_threads only says how many threads decode
    kw = (
        {"num_workers": workers}
        if path in ("workers", "inproc")
        else {"num_workers": workers, "decode_threads": threads}
    )
    return DataLoader(ds, batch_size=BS, collate_fn=collate, drop_last=drop_last, **kw)


def resume_case(shards, rng):
    """One worker count per case (the order is the same on every path at one count): the interrupted
    chain must give the uninterrupted run's batches, in order, for epochs 0 and 1."""
    world = rng.choice([1, 2, 3])
    rank = rng.randrange(world)
    opts = dict(even=rng.choice(["pad", "drop"]), drop_last=rng.random() < 0.3, shuffle=rng.random() < 0.8)
    w = rng.choice([0, 1, 2])
    paths = ["inproc" if w == 0 else "workers", "threads"]

    def make(path):
        return loader(shards, rank, world, path, w, threads=rng.choice([1, 2]), **opts)

    ref_loader = make(paths[0])
    ref = []
    for ep in range(2):
        ref_loader.set_epoch(ep)
        ref.append([b for b in ref_loader])
    flat_ref = [(0, b) for b in ref[0]] + [(1, b) for b in ref[1]]
    got, state, epoch = [], None, 0
    for _ in range(rng.randint(1, 10)):
        ld = make(rng.choice(paths))
        if state is not None:
            ld.load_state_dict(json.loads(json.dumps(state)))
        it = iter(ld)
        take = rng.randint(0, 5)
        for _ in range(take):
            try:
                got.append((epoch, next(it)))
            except StopIteration:
                epoch += 1
                ld.set_epoch(epoch)
                it = iter(ld)
                if epoch > 1:
                    break
        state = ld.state_dict()
        del it, ld
        if epoch > 1:
            break
    ld = make(paths[0])
    ld.load_state_dict(state)
    while epoch <= 1:
        got += [(epoch, b) for b in ld]
        epoch += 1
        ld.set_epoch(epoch)
    ok = got == flat_ref
    return ok, dict(world=world, rank=rank, w=w, **opts)


def elastic_case(shards, rng):
    w1, w2 = rng.randint(1, 4), rng.randint(1, 4)
    n1, n2 = rng.choice([0, 1, 2]), rng.choice([0, 1, 2])
    steps = rng.randint(0, 4)
    full = Counter()
    for r in range(w1):
        for b in loader(shards, r, w1, "inproc", 0):
            full.update(b)
    seen, states = Counter(), []
    for r in range(w1):
        ld = loader(shards, r, w1, "workers" if n1 else "inproc", n1)
        it = iter(ld)
        for _ in range(steps):
            seen.update(next(it))
        states.append(json.loads(json.dumps(ld.state_dict())))
        del it
    batches, warned = [], []
    for r in range(w2):
        ld = loader(shards, r, w2, "workers" if n2 else "inproc", n2)
        with warnings.catch_warnings(record=True) as ws:
            warnings.simplefilter("always")
            ld.load_state_dict(states)
            n = 0
            for b in ld:
                seen.update(b)
                n += 1
        warned += [str(x.message)[:120] for x in ws if "elastic" in str(x.message)]
        batches.append(n)
    extra = sum(((seen - full) + (full - seen)).values())
    # the documented exception: one worker per rank, fewer than W2 samples repeated (pad), with a warning
    ok = len(set(batches)) == 1 and (seen == full or (warned and n2 <= 1 and extra < w2))
    return ok, dict(w1=w1, n1=n1, steps=steps, w2=w2, n2=n2, batches=batches, extra=extra, warned=warned[:1])


if __name__ == "__main__":
    kind, n, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    rng = random.Random(seed)
    shards = make(Path(tempfile.mkdtemp()))
    fails = errs = 0
    for i in range(n):
        try:
            ok, case = (resume_case if kind == "resume" else elastic_case)(shards, rng)
        except Exception as e:  # a refused state is an outcome too; count it by type
            ok, case = False, {"error": f"{type(e).__name__}: {e}"[:200]}
            errs += 1
        if not ok:
            fails += 1
            print("FAIL", i, case, flush=True)
    print(f"{kind}: {n} cases, {fails} failed ({errs} raised)")
    sys.exit(1 if fails else 0)
