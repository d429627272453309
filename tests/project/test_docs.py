"""The documentation runs as written, so it cannot rot: README.md and every docs/**/*.md page.

Every ```python block of a page is executed, in order. The first block of a page sets the scene
(in README.md the headline training loop): each later block of that page runs in a copy of the
names it defined (``model``, ``step``, ``loader``, ``normalize``, ...), as a reader following the
page would use them, but what one later block defines is not seen by the others, so
self-contained examples further down (which may rebind ``ds`` or ``loader``) cannot break each
other. Each page runs in a fresh temporary folder that holds what the pages assume: ``shards/``
(tar shards of small photo-like JPEGs with ``cls`` labels) and ``shards-h5/`` (the same as HDF5),
with ``HOME`` pointing there too, so ``~/.cache/fastdata`` stays inside it. The blocks pick their
device themselves: on a machine without a GPU they run on the CPU.

A block that cannot run alone (a fragment of a script that needs ``torchrun``) is preceded by
``<!-- not run by tests/project/test_docs.py: REASON -->`` naming where it is tested instead; such
blocks are listed in the test's output, and there may be only a few in all.

Every relative link of those pages (``[text](path)``, images too) names a file that exists, and a
link to a heading (``page.md#anchor``, ``#anchor``) names a heading of that page.
"""
from __future__ import annotations

import gc
import re
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").rglob("*.md"))
PAGES = [README, *DOCS]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
NOT_RUN = re.compile(r"<!-- not run by tests/project/test_docs.py: (.*?) -->\s*$")
MAX_NOT_RUN = 2
# what a page's blocks must print, beyond running without an error: proof that they did their work
PRINTS = {"docs/guide/training.md": ["'samples': 24"]}  # evaluate() saw the whole validation set


def name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def python_blocks(text: str) -> list[tuple[int, str, str | None]]:
    """(first line number, source, reason it is not run or None) of every ```python block."""
    out = []
    for m in BLOCK.finditer(text):
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        reason = NOT_RUN.search(before)
        out.append((text.count("\n", 0, m.start(1)) + 1, m.group(1), reason.group(1).strip() if reason else None))
    return out


@pytest.fixture(scope="module")
def shard_folders(tmp_path_factory):
    from fastdata.cli._synth import make_image_folder
    from fastdata.shards.convert import ConvertOptions, convert

    root = tmp_path_factory.mktemp("docs-shards")
    images = make_image_folder(root / "images", 24, num_classes=3, min_side=40, max_side=90, seed=1)
    convert(images, root / "shards", ConvertOptions(samples_per_shard=8, workers=1, progress=False))
    convert(images, root / "shards-h5", ConvertOptions(format="hdf5", samples_per_shard=8, workers=1,
                                                       progress=False))
    return root


@pytest.fixture
def page_folder(shard_folders, tmp_path):
    """A fresh folder per page holding ``shards/`` and ``shards-h5/``: pages cannot see each other's files."""
    for sub in ("shards", "shards-h5"):
        shutil.copytree(shard_folders / sub, tmp_path / sub)
    return tmp_path


def run_page(page: Path, folder: Path, monkeypatch) -> int:
    """Run the page's blocks in ``folder`` as the module docstring says; returns how many ran."""
    blocks = [(line, source) for line, source, reason in python_blocks(page.read_text()) if reason is None]
    monkeypatch.chdir(folder)
    monkeypatch.setenv("HOME", str(folder))
    monkeypatch.setenv("XDG_CACHE_HOME", str(folder / ".cache"))
    import torch

    # the headline's TrainStep(tf32=True) changes process-wide flags on a GPU: restore them afterwards
    matmul, cudnn = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    # run as a script: the headline loop sits under `if __name__ == "__main__":`, as spawn/forkserver need
    scene: dict = {"__name__": "__main__"}
    namespaces = []
    try:
        for i, (line, source) in enumerate(blocks):
            namespace = scene if i == 0 else dict(scene)
            namespaces.append(namespace)
            code = compile(source, f"{name(page)}:{line}", "exec")  # tracebacks name the page and line
            try:
                exec(code, namespace)
            except Exception as e:
                raise AssertionError(f"{name(page)} block at line {line} failed: {type(e).__name__}: {e}") from e
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
    return len(blocks)


def test_the_block_extractor_finds_every_block():
    text = ("a\n```python\nx = 1\n```\nb\n```bash\nls\n```\n```python\ny = 2\nz = 3\n```\n"
            "<!-- not run by tests/project/test_docs.py: needs torchrun -->\n```python\nw = 1\n```\n")
    assert python_blocks(text) == [(3, "x = 1\n", None), (10, "y = 2\nz = 3\n", None),
                                   (15, "w = 1\n", "needs torchrun")]


def test_readme_python_blocks_run_as_written(page_folder, monkeypatch, capsys):
    assert run_page(README, page_folder, monkeypatch) >= 1, "the README lost its training loop"
    out = capsys.readouterr().out
    assert "epoch 1 step 0 loss" in out  # the headline loop trained two epochs
    assert (page_folder / "checkpoint.pt").is_file()


@pytest.mark.parametrize("page", DOCS, ids=name)
def test_docs_python_blocks_run_as_written(page, page_folder, monkeypatch, capsys):
    run_page(page, page_folder, monkeypatch)
    out = capsys.readouterr().out
    for expected in PRINTS.get(name(page), []):
        assert expected in out, f"{name(page)}'s blocks did not print {expected!r}"


def test_few_blocks_are_not_run():
    not_run = [(name(page), line, reason) for page in PAGES
               for line, _, reason in python_blocks(page.read_text()) if reason is not None]
    print("blocks not run here:", not_run)
    assert len(not_run) <= MAX_NOT_RUN, f"too many blocks marked not run: {not_run}"
    assert all(reason for _, _, reason in not_run), "a 'not run' marker must give its reason"


def test_docs_index_lists_every_guide_page():
    index = ROOT / "docs" / "README.md"
    guide = sorted((ROOT / "docs" / "guide").glob("*.md"))
    assert index.is_file() and guide
    linked = {(index.parent / target).resolve() for target in relative_links(index.read_text())}
    assert [name(p) for p in guide if p.resolve() not in linked] == []


FENCE = re.compile(r"^```.*?^```", re.S | re.M)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s*\[[^\]\n]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.M)


def links(text: str) -> list[str]:
    """The targets of the page's relative links and images, anchors included (code left out)."""
    text = CODE_SPAN.sub("", FENCE.sub("", text))
    targets = LINK.findall(text) + REFERENCE.findall(text)
    return [t for t in targets if not re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", t)]


def relative_links(text: str) -> list[str]:
    """The files the page's relative links and images name, without their anchors."""
    return [t.split("#", 1)[0] for t in links(text) if not t.startswith("#")]


def anchors(text: str) -> set[str]:
    """The anchors of a page's headings, as GitHub makes them (a repeated one gets -1, -2, ...)."""
    out, counts = set(), {}
    for heading in re.findall(r"^#{1,6} +(.+?) *$", FENCE.sub("", text), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        n = counts[slug] = counts.get(slug, -1) + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_the_link_extractor_finds_relative_links_only():
    text = ("[a](docs/a.md) ![pic](../p.png \"title\") [web](https://x.org/y) [here](#anchor) "
            "[b](b.md#part) `[no](code.md)`\n```python\nx = d[0](1)\n```\n[ref]: ../c.md\n")
    assert links(text) == ["docs/a.md", "../p.png", "#anchor", "b.md#part", "../c.md"]
    assert relative_links(text) == ["docs/a.md", "../p.png", "b.md", "../c.md"]
    assert anchors("# Scaling out\n## `fastdata shard`: converting data\n## Notes\n## Notes\n") == {
        "scaling-out", "fastdata-shard-converting-data", "notes", "notes-1"}


@pytest.mark.parametrize("page", PAGES, ids=name)
def test_relative_links_name_files_that_exist(page):
    missing = [t for t in relative_links(page.read_text()) if not (page.parent / t).exists()]
    assert missing == [], f"{name(page)} links to files that do not exist: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=name)
def test_links_to_headings_name_headings_that_exist(page):
    missing = []
    for target in links(page.read_text()):
        path, _, anchor = target.partition("#")
        target_page = (page.parent / path) if path else page
        if anchor and target_page.suffix == ".md" and target_page.exists():
            if anchor not in anchors(target_page.read_text()):
                missing.append(target)
    assert missing == [], f"{name(page)} links to headings that do not exist: {missing}"
