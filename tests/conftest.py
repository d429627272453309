"""Shared test configuration: CUDA tests skip cleanly on machines without a GPU."""
from __future__ import annotations

import pytest

import fork_probe  # noqa: F401  registers its fork hook before fastdata's, so it runs after them


@pytest.fixture(scope="module")
def seven(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """7 samples in tar shards of 4 and 3 (cls = global index): the resume and multi-rank tests' set."""
    from fastdata.shards.tar import write_tar_shard

    dest = tmp_path_factory.mktemp("seven")
    paths, i = [], 0
    for j, size in enumerate([4, 3]):
        path = dest / f"s{j}.tar"
        write_tar_shard(path, [{"__key__": f"k{i + k:04d}", "cls": str(i + k).encode()} for k in range(size)])
        paths.append(str(path))
        i += size
    return paths


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def pytest_configure(config: pytest.Config) -> None:
    """Workers under the ``forkserver`` start method fork from a server that has imported torch and
    fastdata already, as a training script's forkserver would after its first loader: each test then
    pays that import once, not once per worker (seconds each on a loaded 2-core machine). The
    start method's semantics (pickled datasets, fresh worker state) are unchanged."""
    import multiprocessing as mp

    if "forkserver" in mp.get_all_start_methods():
        mp.set_forkserver_preload(["torch", "fastdata", "fastdata.loader", "fastdata.dataset"])
