"""The README's Python blocks run as written, so they cannot rot.

Every ```python block of README.md is executed, in order. The first one (the headline training
loop) sets the scene: each later block runs in a copy of the names it defined (``model``, ``step``,
``loader``, ``normalize``, ...), as a reader following the page would use them, but what one later
block defines is not seen by the others, so self-contained examples elsewhere on the page (which
may rebind ``ds`` or ``loader``) cannot break each other. They run in a temporary folder that
holds what the README assumes: ``shards/`` (tar shards of small photo-like JPEGs with ``cls``
labels) and ``shards-h5/`` (the same as HDF5), with ``HOME`` pointing there too, so
``~/.cache/fastdata`` stays inside it. The blocks pick their device themselves: on a machine
without a GPU they run on the CPU.

A block that cannot run alone (a fragment of a script that needs ``torchrun``) is preceded by
``<!-- not run by tests/test_readme.py: REASON -->`` naming where it is tested instead; such blocks
are listed in the test's output, and there may be only a few.
"""
from __future__ import annotations

import gc
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
NOT_RUN = re.compile(r"<!-- not run by tests/test_readme.py: (.*?) -->\s*$")
MAX_NOT_RUN = 2


def python_blocks(text: str) -> list[tuple[int, str, str | None]]:
    """(first line number, source, reason it is not run or None) of every ```python block."""
    out = []
    for m in BLOCK.finditer(text):
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        reason = NOT_RUN.search(before)
        out.append((text.count("\n", 0, m.start(1)) + 1, m.group(1), reason.group(1).strip() if reason else None))
    return out


@pytest.fixture(scope="module")
def readme_folder(tmp_path_factory):
    from fastdata.cli._synth import make_image_folder
    from fastdata.shards.convert import ConvertOptions, convert

    root = tmp_path_factory.mktemp("readme")
    images = make_image_folder(root / "images", 24, num_classes=3, min_side=40, max_side=90, seed=1)
    convert(images, root / "shards", ConvertOptions(samples_per_shard=8, workers=1, progress=False))
    convert(images, root / "shards-h5", ConvertOptions(format="hdf5", samples_per_shard=8, workers=1,
                                                       progress=False))
    return root


def test_the_block_extractor_finds_every_block():
    text = ("a\n```python\nx = 1\n```\nb\n```bash\nls\n```\n```python\ny = 2\nz = 3\n```\n"
            "<!-- not run by tests/test_readme.py: needs torchrun -->\n```python\nw = 1\n```\n")
    assert python_blocks(text) == [(3, "x = 1\n", None), (10, "y = 2\nz = 3\n", None),
                                   (15, "w = 1\n", "needs torchrun")]


def test_readme_python_blocks_run_as_written(readme_folder, monkeypatch, capsys):
    blocks = python_blocks(README.read_text())
    assert len(blocks) >= 4, "the README lost its examples"
    not_run = [(line, reason) for line, _, reason in blocks if reason is not None]
    assert len(not_run) <= MAX_NOT_RUN, f"too many README blocks marked not run: {not_run}"
    assert all(not_run_reason for _, not_run_reason in not_run), "a 'not run' marker must give its reason"
    print("README blocks not run here:", not_run)
    blocks = [(line, source) for line, source, reason in blocks if reason is None]
    monkeypatch.chdir(readme_folder)
    monkeypatch.setenv("HOME", str(readme_folder))
    monkeypatch.setenv("XDG_CACHE_HOME", str(readme_folder / ".cache"))
    import torch

    # the headline's TrainStep(tf32=True) changes process-wide flags on a GPU: restore them afterwards
    matmul, cudnn = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    # run as a script: the headline loop sits under `if __name__ == "__main__":`, as spawn/forkserver need
    headline: dict = {"__name__": "__main__"}
    namespaces = []
    try:
        for i, (line, source) in enumerate(blocks):
            namespace = headline if i == 0 else dict(headline)
            namespaces.append(namespace)
            code = compile(source, f"README.md:{line}", "exec")  # tracebacks name the README line
            try:
                exec(code, namespace)
            except Exception as e:
                raise AssertionError(f"README.md block at line {line} failed: {type(e).__name__}: {e}") from e
    finally:
        import fastdata

        for namespace in namespaces:  # stop prefetch threads and loader workers the blocks left
            for value in list(namespace.values()):
                if isinstance(value, fastdata.CUDAPrefetcher):
                    value.close()
            namespace.clear()
        gc.collect()
        torch.set_float32_matmul_precision(matmul)
        torch.backends.cudnn.allow_tf32 = cudnn
    out = capsys.readouterr().out
    assert "epoch 1 step 0 loss" in out  # the headline loop trained two epochs
    assert (readme_folder / "checkpoint.pt").is_file()
    assert "'samples': 24" in out  # evaluate() saw the whole validation set
