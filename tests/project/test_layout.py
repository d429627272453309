"""The package layout: one folder per pipeline stage, imports only downward, no circles; test files
named after what they test, in stage folders."""
from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import inspect
import sys
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "fastdata"
# Low to high; a module may import from its own stage and the ones before it.
STAGES: tuple[tuple[str, ...], ...] = (
    ("_version", "_runtime", "_util", "_pickling", "_rng", "errors"),
    ("io",),
    ("manifest",),
    ("shards",),
    ("nodecache",),
    ("decode", "transforms"),
    ("cache",),
    ("dataset",),
    ("loader",),
    ("prefetch",),
    ("gpu",),
    ("train",),
    ("monitor",),
    ("cli", "__main__"),
)
_RANK = {name: rank for rank, names in enumerate(STAGES) for name in names}
TOP = len(STAGES)  # fastdata/__init__.py: the public facade, above every stage
# Documented import paths (README, ARCHITECTURE.md) that must keep working.
DOCUMENTED_MODULES = (
    "fastdata.cache", "fastdata.dataset", "fastdata.loader", "fastdata.prefetch", "fastdata.decode",
    "fastdata.gpu", "fastdata.transforms", "fastdata.shards.tar", "fastdata.shards.hdf5",
    "fastdata.shards.reader", "fastdata.shards.writer", "fastdata.shards.convert", "fastdata.manifest",
    "fastdata.errors", "fastdata.train", "fastdata.monitor", "fastdata.cli", "fastdata.io", "fastdata.nodecache",
)


@dataclass(frozen=True)
class Import:
    """One import statement's target: a module of fastdata, and a name imported from it (if any)."""

    importer: str
    line: int
    module: str  # the fastdata module that gets executed/imported
    name: str | None  # ``from module import name`` where name is not a module itself

    def where(self) -> str:
        return f"{module_path(self.importer)}:{self.line}"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def module_path(name: str) -> str:
    base = ROOT.joinpath(*name.split("."))
    return str((base / "__init__.py" if base.is_dir() else base.with_suffix(".py")).relative_to(ROOT))


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


MODULES = all_modules()


def is_package(name: str) -> bool:
    return name in MODULES and MODULES[name].name == "__init__.py"


def _resolve_relative(importer: str, module: str | None, level: int) -> str:
    base = importer.split(".")
    if not is_package(importer):
        base = base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


@functools.lru_cache(maxsize=None)
def imports_of(name: str) -> tuple[Import, ...]:
    """Every import of a fastdata module by module ``name`` (anywhere in the file)."""
    return tuple(imports_in(name, MODULES[name].read_text(encoding="utf-8")))


def imports_in(name: str, text: str) -> Iterator[Import]:
    tree = ast.parse(text, filename=module_path(name) if name in MODULES else name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "fastdata" or alias.name.startswith("fastdata."):
                    yield Import(name, node.lineno, alias.name, None)
        elif isinstance(node, ast.ImportFrom):
            source = _resolve_relative(name, node.module, node.level) if node.level else node.module
            if source is None or not (source == "fastdata" or source.startswith("fastdata.")):
                continue
            for alias in node.names:
                child = f"{source}.{alias.name}"
                if child in MODULES:  # ``from fastdata.shards import tar``: the module itself
                    yield Import(name, node.lineno, child, None)
                else:
                    yield Import(name, node.lineno, source, alias.name)


def rank(module: str) -> int:
    parts = module.split(".")
    if len(parts) == 1:
        return TOP
    if parts[1] not in _RANK:
        raise AssertionError(f"{module_path(module)} belongs to no stage: add '{parts[1]}' to STAGES in "
                             "tests/project/test_layout.py (and to docs/ARCHITECTURE.md's stage table)")
    return _RANK[parts[1]]


def stage_label(module: str) -> str:
    r = rank(module)
    return "fastdata/__init__ (public facade)" if r == TOP else "/".join(STAGES[r])


def owner_package(module: str) -> str | None:
    """The package holding the first private component of ``module`` (None: all public)."""
    parts = module.split(".")
    for i, part in enumerate(parts):
        if part.startswith("_") and not part.startswith("__"):
            return ".".join(parts[:i])
    return None


def inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def upward_imports(name: str, imports: Sequence[Import]) -> list[str]:
    return [f"{imp.where()}: imports {imp.module} ({stage_label(imp.module)}), a stage above "
            f"{stage_label(name)}" for imp in imports if rank(imp.module) > rank(name)]


def private_imports(name: str, imports: Sequence[Import]) -> list[str]:
    problems = []
    for imp in imports:
        owner = owner_package(imp.module)
        if owner is not None and not inside(name, owner):
            problems.append(f"{imp.where()}: imports private module {imp.module} of {owner}; import what "
                            f"{owner}'s __init__ re-exports instead")
        elif (imp.name and imp.name.startswith("_") and not imp.name.startswith("__")
              and name.split(".")[:2] != imp.module.split(".")[:2]):  # private names stay in their package
            problems.append(f"{imp.where()}: imports private name {imp.name} from {imp.module}")
    return problems


def import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for name in MODULES:
        for imp in imports_of(name):
            if imp.module != name and imp.module in MODULES:
                graph[name].add(imp.module)
    return graph


@functools.lru_cache(maxsize=1)
def _layout_stats():
    """benchmarks/layout_stats.py, loaded once: its SCC search and private-member heuristic are shared."""
    spec = importlib.util.spec_from_file_location("layout_stats", ROOT / "benchmarks" / "layout_stats.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module, each as a closed path."""
    return [_cycle_path(graph, set(component)) for component in _layout_stats()._circles(graph)]


def _cycle_path(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """One closed path through a strongly connected component (for the message)."""
    start = min(component)
    path, seen = [start], {start}
    while True:
        nxt = sorted(w for w in graph[path[-1]] if w in component)
        back = [w for w in nxt if w == start]
        fresh = [w for w in nxt if w not in seen]
        if back and (not fresh or len(path) > 1):
            return [*path, start]
        if not fresh:  # dead end inside the component: close it via any member already seen
            return [*path, nxt[0]]
        path.append(fresh[0])
        seen.add(fresh[0])


def test_the_rules_can_fail():
    """The checks see function-level and TYPE_CHECKING imports, private names, and circles."""
    sample = ("import os\nimport fastdata.shards.tar as t\n"
              "def f():\n    from fastdata.cli._args import positive_int\n"
              "if TYPE_CHECKING:\n    from fastdata.loader import DataLoader\n"
              "from fastdata.shards import tar, _keys\nfrom fastdata.manifest import _private\n")
    imports = list(imports_in("fastdata.shards.sample", sample))
    found = sorted((i.line, i.module, i.name or "") for i in imports)
    assert [(module, name or None) for _, module, name in found] == [
        ("fastdata.shards.tar", None), ("fastdata.cli._args", "positive_int"),
        ("fastdata.loader", "DataLoader"), ("fastdata.shards._keys", None),
        ("fastdata.shards.tar", None), ("fastdata.manifest", "_private")]
    upward = upward_imports("fastdata.shards.sample", imports)
    assert sorted(p.split(": ", 1)[1].split(" (")[0] for p in upward) == [
        "imports fastdata.cli._args", "imports fastdata.loader"]
    private = private_imports("fastdata.shards.sample", imports)
    assert sorted(p.split(": ", 1)[1] for p in private) == [
        "imports private module fastdata.cli._args of fastdata.cli; import what fastdata.cli's __init__ "
        "re-exports instead", "imports private name _private from fastdata.manifest"]
    assert owner_package("fastdata.cli._args") == "fastdata.cli" and owner_package("fastdata._util") == "fastdata"
    assert rank("fastdata.cli._main") > rank("fastdata.loader._loader") > rank("fastdata.shards.tar")
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_every_module_belongs_to_a_stage():
    for name in MODULES:
        rank(name)


@pytest.mark.parametrize("name", sorted(MODULES), ids=lambda n: module_path(n))
def test_no_upward_imports(name):
    problems = upward_imports(name, imports_of(name))
    assert not problems, "imports a stage above its own:\n  " + "\n  ".join(problems)


@pytest.mark.parametrize("name", sorted(MODULES), ids=lambda n: module_path(n))
def test_no_private_imports_across_packages(name):
    problems = private_imports(name, imports_of(name))
    assert not problems, "reaches into another package's private parts:\n  " + "\n  ".join(problems)


def test_no_import_circles():
    found = circles(import_graph())
    assert not found, "import circles:\n  " + "\n  ".join(" -> ".join(c) for c in found)


def test_no_private_member_reads_across_stages():
    """``obj._name`` where only other stages define ``_name`` (benchmarks/layout_stats.py's heuristic)."""
    found = _layout_stats().stats(ROOT)
    assert not found.private_attribute_reads, (
        "reads another stage's private members (add a method to its package-internal API instead):\n  "
        + "\n  ".join(found.private_attribute_reads))
    assert found.circles == []  # the same search over a graph built independently


def test_public_names_resolve():
    import fastdata

    missing = [name for name in fastdata.__all__ if not hasattr(fastdata, name)]
    assert not missing, f"fastdata.__all__ names that do not resolve: {missing}"
    for name in fastdata.__all__:
        if name != "__version__":
            assert getattr(fastdata, name) is not None


@pytest.mark.parametrize("module", DOCUMENTED_MODULES)
def test_documented_module_paths_import(module):
    imported = importlib.import_module(module)
    for name in getattr(imported, "__all__", ()):
        assert hasattr(imported, name), f"{module}.__all__ lists {name!r}, which it does not define"


@pytest.mark.parametrize("name", sorted(n for n in MODULES if not n.endswith("__main__")),  # running it runs the CLI
                         ids=lambda n: module_path(n))
def test_every_exception_derives_from_fastdata_error(name):
    from fastdata.errors import FastdataError

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = importlib.import_module(name)
    stray = [f"{cls.__qualname__}{tuple(b.__name__ for b in cls.__bases__)}"
             for _, cls in inspect.getmembers(module, inspect.isclass)
             if cls.__module__ == name and issubclass(cls, BaseException)
             and not issubclass(cls, (Warning, FastdataError))]
    assert not stray, f"{module_path(name)}: exception classes outside the FastdataError hierarchy: {stray}"


def _named_after_history(name: str) -> bool:
    """``test_s5_lead.py``, ``test_s9_lefta.py``: named after when they were written, not what they test."""
    return name.startswith("test_s") and name[len("test_s"):][:1].isdigit()


def test_test_files_sit_in_stage_folders_named_after_what_they_test():
    """Every test file is ``tests/<stage>/test_<feature>.py``: none at the top of tests/, none named after
    when it was written (a reader cannot tell what ``test_s8_lead.py`` tests)."""
    assert _named_after_history("test_s5_lead.py") and _named_after_history("test_s10_x.py")
    assert not _named_after_history("test_split.py") and not _named_after_history("test_shards.py")
    tests = ROOT / "tests"
    flat = sorted(p.name for p in tests.glob("test_*.py"))
    history = sorted(str(p.relative_to(tests)) for p in tests.rglob("test_*.py") if _named_after_history(p.name))
    assert not flat, f"test files at the top of tests/, not in a stage folder: {flat}"
    assert not history, f"test files named after when they were written: {history}"


MAX_MODULE_LINES = 600  # a module past this holds more than one responsibility: split it
MAX_DOCSTRING_LINES = 20  # what the module owns and its invariants; reasoning goes to docs/design/


@pytest.mark.parametrize("name", sorted(MODULES), ids=lambda n: module_path(n))
def test_modules_are_small_and_their_docstrings_short(name):
    """A module stays under 600 lines and its docstring under 20: the essays that used to open modules
    (and went stale with their timings) live in docs/design/, which the docstring links to."""
    source = MODULES[name].read_text()
    lines = source.count("\n") + (not source.endswith("\n"))
    assert lines <= MAX_MODULE_LINES, f"{module_path(name)}: {lines} lines (at most {MAX_MODULE_LINES})"
    doc = ast.get_docstring(ast.parse(source), clean=False)
    doc_lines = doc.count("\n") + 1 if doc else 0
    assert doc_lines <= MAX_DOCSTRING_LINES, (f"{module_path(name)}: a {doc_lines}-line module docstring (at most "
                                              f"{MAX_DOCSTRING_LINES}; move the reasoning to docs/design/)")
