"""docs/ARCHITECTURE.md stays true to the code it maps.

Its stage table is ``STAGES`` of tests/project/test_layout.py, in order; its thread and fork-hook tables
are the inventory of ``fastdata._runtime`` (nothing missing, nothing stale); its state-dict tables list
every key the dataset, loader, prefetcher and checkpoint write today, and its JSON examples are the states
the code makes in the scenarios they describe; it links every stage and every design note. Its links
and its ```python block are checked by tests/project/test_docs.py with every other page.
"""
from __future__ import annotations

import importlib
import json
import pkgutil
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from tests.project.test_layout import STAGES

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "ARCHITECTURE.md"
FIX = "docs/ARCHITECTURE.md"


def sections(text: str) -> dict[str, str]:
    """Each heading's text (``## x`` and ``### y``, outside code blocks) -> its body, up to the next heading
    of the same or a higher level."""
    lines = text.splitlines()
    heads, fence = [], False
    for i, line in enumerate(lines):
        if line.startswith("```"):
            fence = not fence
        elif not fence and (m := re.match(r"(#{2,3}) (.+?)\s*$", line)):
            heads.append((i, len(m.group(1)), m.group(2)))
    out = {}
    for k, (i, level, title) in enumerate(heads):
        end = next((j for j, lv, _ in heads[k + 1:] if lv <= level), len(lines))
        out[title] = "\n".join(lines[i + 1:end])
    return out


def section(title: str) -> str:
    found = sections(PAGE.read_text())
    assert title in found, f"{FIX} lost its section {title!r} (sections: {sorted(found)})"
    return found[title]


def tables(text: str) -> list[list[list[str]]]:
    """The markdown tables of ``text`` (outside code blocks): per table its data rows, each a list of cells."""
    out, rows, fence = [], None, False
    for line in text.splitlines():
        if line.startswith("```"):
            fence = not fence
        if not fence and line.startswith("|"):
            if rows is None:
                rows = []
                out.append(rows)
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        else:
            rows = None
    return [t[2:] for t in out]  # without the header and the |---| line


def ticked(cell: str) -> list[str]:
    """The `code spans` of a table cell, in order."""
    return re.findall(r"`([^`]+)`", cell)


def json_blocks(text: str) -> list[dict]:
    return [json.loads(block) for block in re.findall(r"^```json\n(.*?)^```", text, re.DOTALL | re.MULTILINE)]


def test_the_page_parser_sees_sections_tables_and_code_spans():
    text = ("# T\n## A\nx\n```python\n## not a heading\n```\n| a | b |\n|---|---|\n| `p` `q` | [`m`](x.py) |\n"
            "### B\n| c |\n|---|\n| d |\n```json\n{\"k\": 1}\n```\n## C\ny\n")
    found = sections(text)
    assert list(found) == ["A", "B", "C"]
    assert "not a heading" in found["A"] and "### B" in found["A"] and "| d |" in found["B"]
    assert tables(found["A"]) == [[["`p` `q`", "[`m`](x.py)"]], [["d"]]]
    assert ticked("`p` `q`") == ["p", "q"] and ticked("[`m`](x.py)") == ["m"]
    assert json_blocks(found["B"]) == [{"k": 1}]


# ----- stages ------------------------------------------------------------------------------------

def test_the_stage_table_is_test_layouts_stages_in_order():
    stage_table, base_table = tables(section("Stages and the import rule"))[:2]
    listed = [tuple(ticked(row[0])) for row in stage_table]
    assert listed == list(STAGES), (
        f"{FIX}'s stage table lists {listed}; tests/project/test_layout.py's STAGES are {list(STAGES)}")
    base = [re.sub(r"\.py$", "", re.sub(r"^\[(.*?)\]\(.*\)$", r"\1", row[0])) for row in base_table]
    assert base == list(STAGES[0]), f"{FIX}'s base-module table lists {base}, STAGES[0] is {STAGES[0]}"


def test_every_stage_is_linked_from_the_page():
    links = set(re.findall(r"\]\(\.\./fastdata/([^)#]+)\)", PAGE.read_text()))
    missing = [name for names in STAGES for name in names
               if not any(link == f"{name}.py" or link.startswith(f"{name}/") for link in links)]
    assert missing == [], f"{FIX} links no file of these stages: {missing}"


# ----- threads and fork hooks --------------------------------------------------------------------

def _import_every_module() -> None:
    import fastdata

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for info in pkgutil.walk_packages(fastdata.__path__, "fastdata."):
            if not info.name.endswith("__main__"):  # importing it runs the command
                importlib.import_module(info.name)


def _diff(doc: dict, code: dict) -> str:
    missing = {k: code[k] for k in code.keys() - doc.keys()}
    stale = sorted(doc.keys() - code.keys())
    differ = {k: (doc[k], code[k]) for k in doc.keys() & code.keys() if doc[k] != code[k]}
    return (f"regenerate the table with the ```python block of {FIX}'s 'Threads and fork hooks':\n"
            f"  missing: {missing}\n  listed but gone: {stale}\n  differ (page, code): {differ}")


def test_the_thread_table_is_the_inventory():
    from fastdata import _runtime

    (rows,) = tables(section("Threads"))
    doc = {ticked(row[0])[0]: (ticked(row[1])[0], row[2]) for row in rows}
    assert len(doc) == len(rows), f"{FIX} lists a thread prefix twice"
    assert doc == dict(_runtime.THREADS), _diff(doc, dict(_runtime.THREADS))


def _calls(hook) -> str:
    return ", ".join(f"`{kind}`: `{fn.__qualname__}`" for kind in ("before", "after_in_parent", "after_in_child")
                     if (fn := getattr(hook, kind)) is not None)


def test_the_fork_hook_table_is_the_inventory():
    from fastdata import _runtime

    _import_every_module()
    (rows,) = tables(section("Fork hooks"))
    doc = {ticked(row[0])[0]: (row[1], row[2]) for row in rows}
    code = {h.owner: (h.purpose, _calls(h)) for h in _runtime.fork_hooks()}
    assert len(doc) == len(rows), f"{FIX} lists a fork-hook owner twice"
    assert doc == code, _diff(doc, code)


def test_the_exit_hook_table_is_the_inventory():
    from fastdata import _runtime

    _import_every_module()
    (rows,) = tables(section("Exit hooks"))
    doc = {ticked(row[0])[0]: (row[1], ticked(row[2])[0]) for row in rows}
    code = {h.owner: (h.purpose, h.fn.__qualname__) for h in _runtime.exit_hooks()}
    assert len(doc) == len(rows), f"{FIX} lists an exit-hook owner twice"
    assert doc == code, _diff(doc, code)


def test_the_registration_order_the_page_gives():
    """'``import fastdata`` alone registers none; ``fastdata.DataLoader`` registers the first six above, in
    that order' (in a fresh process)."""
    (rows,) = tables(section("Fork hooks"))
    text = " ".join(section("Fork hooks").split())
    assert "`import fastdata` alone registers none" in text
    assert "`fastdata.DataLoader` registers the first six above, in that order" in text
    code = ("import fastdata; from fastdata import _runtime; print(len(_runtime.fork_hooks())); "
            "fastdata.DataLoader; print(*[h.owner for h in _runtime.fork_hooks()])")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    alone, loader = out.stdout.splitlines()
    assert alone == "0"
    assert loader.split() == [ticked(row[0])[0] for row in rows[:6]]


# ----- state dicts -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def states(tmp_path_factory) -> dict:
    """The states the page's examples describe, made by the code: a dataset looped over in this process, a
    loader, a prefetcher, a checkpoint, and rank 0's state after two elastic resizes."""
    import torch

    import fastdata
    from tests.helpers.shards import make_shards

    root = tmp_path_factory.mktemp("architecture")
    src = make_shards(root / "shards", 24, 8, cls="int")  # 24 samples in 3 tar shards
    out: dict = {}

    ds = fastdata.ShardedDataset(src, shuffle=True, seed=3)
    it = iter(ds)
    next(it), next(it)
    out["dataset"] = ds.state_dict()

    # the thread decoder gives the state worker processes would (the resume contract), without processes
    loader = fastdata.DataLoader(fastdata.ShardedDataset(src, shuffle=True, seed=3), batch_size=4, num_workers=2,
                                 decode_threads=1)
    it = iter(loader)
    for _ in range(3):
        next(it)
    out["loader"] = loader.state_dict()

    with fastdata.CUDAPrefetcher(fastdata.DataLoader(fastdata.ShardedDataset(src), batch_size=4),
                                 device="cpu") as prefetcher:
        next(iter(prefetcher))
        out["prefetcher"] = prefetcher.state_dict()

        model = torch.nn.Linear(2, 2)
        step = fastdata.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss)
        path = fastdata.save_checkpoint(root / "checkpoint.pt", step, loader=prefetcher, epoch=0, extra={"lr": 0.1})
    out["checkpoint"] = torch.load(path, weights_only=True)

    def ranks(world_size: int, resume_from: list | None = None) -> list:
        loaders = [fastdata.DataLoader(fastdata.ShardedDataset(src, rank=r, world_size=world_size,
                                                               samples_per_epoch=24), batch_size=2)
                   for r in range(world_size)]
        for one in loaders:
            if resume_from is not None:
                one.load_state_dict(resume_from)
        return loaders

    def one_batch_each(loaders: list) -> list:
        saved = []
        for one in loaders:
            next(iter(one))
            saved.append(one.state_dict())
        return saved

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 20 samples left for 3 ranks: even="pad" repeats one
        three = ranks(3, one_batch_each(ranks(2)))  # 2 ranks -> 3 in epoch 0
        out["elastic"] = one_batch_each(three)[0]["dataset"]
        for one in three:  # the rest of epoch 0, then a batch of epoch 1
            for _ in one:
                pass
            one.set_epoch(1)
        out["elastic_twice"] = one_batch_each(ranks(2, one_batch_each(three)))[0]["dataset"]  # 3 -> 2 in epoch 1
    return out


def keys_of(title: str, table: int = 0) -> list[str]:
    return [ticked(row[0])[0] for row in tables(section(title))[table]]


def test_every_dataset_state_key_is_in_the_schema(states):
    from fastdata.dataset._state import REQUIRED

    made = [states["dataset"], states["loader"]["dataset"], states["prefetcher"]["dataset"], states["elastic"],
            states["elastic_twice"]]
    produced = set().union(*made)
    documented = keys_of("ShardedDataset state")
    assert set(REQUIRED) <= produced
    assert set(documented) == produced, (f"{FIX}'s ShardedDataset state table: missing "
                                         f"{sorted(produced - set(documented))}, not made by the code "
                                         f"{sorted(set(documented) - produced)}")


def test_every_loader_and_prefetcher_state_key_is_in_the_schema(states):
    documented = set(keys_of("DataLoader state"))
    assert set(states["loader"]) == documented, f"{FIX}'s DataLoader state table: {sorted(documented)}"
    # the prefetcher has no keys of its own: the wrapped loader's state
    assert set(states["prefetcher"]) == documented
    assert "DataLoader state's keys" in section("CUDAPrefetcher state")


def test_every_checkpoint_key_is_in_the_schema(states):
    payload = states["checkpoint"]
    assert set(payload) == set(keys_of("Checkpoint", 0)), f"{FIX}'s checkpoint table: {keys_of('Checkpoint', 0)}"
    assert set(payload["train_step"]) == set(keys_of("Checkpoint", 1)), \
        f"{FIX}'s train_step table: {keys_of('Checkpoint', 1)}"
    assert payload["format"] == "fastdata-checkpoint" and payload["loader"] == states["prefetcher"]


def test_the_json_examples_are_the_states_the_code_makes(states):
    """The page's examples, in order: the in-process loop, rank 0 after two resizes, the loader."""
    examples = json_blocks(section("State dicts"))
    made = [states["dataset"], states["elastic_twice"], states["loader"]]
    assert len(examples) == len(made), f"{FIX} has {len(examples)} JSON examples, this test knows {len(made)}"
    for example, state in zip(examples, made):
        assert example == state, f"{FIX}: an example differs from the state the code makes now:\n{json.dumps(state)}"


def test_the_versions_the_page_gives_are_the_codes():
    from fastdata.dataset._state import STATE_VERSION
    from fastdata.loader._state import LOADER_STATE_VERSION
    from fastdata.train._checkpoint import VERSION

    text = section("State dicts")
    for name, value in (("STATE_VERSION", STATE_VERSION), ("LOADER_STATE_VERSION", LOADER_STATE_VERSION),
                        ("checkpoint `VERSION", VERSION)):
        assert f"{name} = {value}`" in text, f"{FIX} does not give {name} = {value}"


# ----- design notes ------------------------------------------------------------------------------

def test_every_design_note_is_listed():
    listed = re.findall(r"\]\(design/([^)#]+)\)", section("Design notes"))
    notes = sorted(p.name for p in (ROOT / "docs" / "design").glob("*.md"))
    assert sorted(listed) == notes, f"{FIX}'s design notes list {sorted(listed)}; docs/design/ holds {notes}"
