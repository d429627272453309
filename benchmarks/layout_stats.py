"""Layout figures of a fastdata checkout: modules, import circles, longest file, private cross-stage reaches.

    python benchmarks/layout_stats.py [ROOT ...] [--json PATH]

ROOT is a checkout (default: this one); give two to compare, e.g. the flat layout before the
restructuring and now::

    git worktree add /tmp/before 342c851
    python benchmarks/layout_stats.py /tmp/before .

Figures (static, from :mod:`ast`; nothing is imported):

- **top-level modules**: ``.py`` files directly in ``fastdata/`` (and the subpackages beside them);
- **import circles**: groups of modules that import each other in a circle (strongly connected
  components of the import graph, every import counted: module level, in functions, under
  ``TYPE_CHECKING``), each listed;
- **longest file**: lines of the longest module;
- **private cross-stage accesses**: places where a module uses another stage's private parts:
  ``from M import _name`` or ``import``-ing a ``_module`` of another stage (the shared bottom stage
  ``_version``/``_util``/``errors`` excepted), and attribute reads ``obj._name`` (``obj`` not
  ``self``/``cls``) of a private name that only modules of other stages define (as a method, a
  ``self._name`` attribute, a class or module global). Counted per place, and as distinct names.

A module's stage is its folder in the stage layout; in the flat layout before it, the table
``FLAT_STAGES`` gives each file's stage (where the restructuring moved it).
"""
from __future__ import annotations

import argparse
import ast
import json
import sys
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

BASE = "base"  # _version, _util, errors: shared by every stage
_BASE_MODULES = {"_version", "_util", "errors"}

# flat layout (commit 342c851 and before): file -> stage (its folder after commit 9ab3d1d)
FLAT_STAGES = {
    "_cache_build": "dataset", "_cache_cli": "cli", "_cache_io": "cache", "_cache_loader": "loader",
    "_cache_store": "cache", "_demo": "cli", "_doctor": "cli", "_prefetch_queue": "prefetch",
    "_prefetch_stage": "prefetch", "_source": "dataset", "_split": "dataset", "_synth": "cli", "_tree": "prefetch",
    "cache": "cache", "cli": "cli", "dataset": "dataset", "loader": "loader", "prefetch": "prefetch",
    "__main__": "cli",
}


@dataclass
class Stats:
    root: str
    layout: str
    modules: int
    top_level_modules: int
    top_level_names: list[str]
    subpackages: list[str]
    circles: list[list[str]]
    longest_file: str
    longest_lines: int
    private_imports: list[str] = field(default_factory=list)
    private_attribute_reads: list[str] = field(default_factory=list)
    private_names: list[str] = field(default_factory=list)

    @property
    def private_accesses(self) -> int:
        return len(self.private_imports) + len(self.private_attribute_reads)


def _modules(root: Path) -> dict[str, Path]:
    out = {}
    for path in sorted((root / "fastdata").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _stage(module: str, flat: bool) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "fastdata"  # the package __init__ (public facade)
    head = parts[1]
    if head in _BASE_MODULES:
        return BASE
    if flat:
        return FLAT_STAGES.get(head, head)
    return "cli" if head == "__main__" else head


def _imports(name: str, tree: ast.AST, modules: dict[str, Path]) -> list[tuple[int, str, str | None]]:
    """``(line, module, imported name or None)`` for every import of a fastdata module."""
    is_pkg = modules[name].name == "__init__.py"
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, None) for a in node.names if a.name.split(".")[0] == "fastdata"]
        elif isinstance(node, ast.ImportFrom):
            source = node.module
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            if not source or source.split(".")[0] != "fastdata":
                continue
            for a in node.names:
                child = f"{source}.{a.name}"
                found.append((node.lineno, child, None) if child in modules else (node.lineno, source, a.name))
    return found


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


# namedtuple's public API, private-looking by convention only
_NAMEDTUPLE_API = {"_fields", "_replace", "_asdict", "_make", "_field_defaults"}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name not in _NAMEDTUPLE_API


def _defined_private_names(tree: ast.Module) -> set[str]:
    """Private names a module defines: module globals, class attributes and methods, ``self._x``."""
    names: set[str] = set()

    def targets(node: ast.AST) -> list[ast.AST]:
        if isinstance(node, ast.Assign):
            return node.targets
        if isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            return [node.target]
        return []

    for scope in [tree, *(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef))]:
        for node in scope.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            for t in targets(node):
                for leaf in ast.walk(t):
                    if isinstance(leaf, ast.Name):
                        names.add(leaf.id)
    for node in ast.walk(tree):
        for t in targets(node):
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id in ("self", "cls"):
                names.add(t.attr)
    return {n for n in names if _is_private(n)}


def _is_own(node: ast.expr) -> bool:
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def stats(root: Path) -> Stats:
    modules = _modules(root)
    flat = (root / "fastdata" / "dataset.py").is_file()
    trees = {m: ast.parse(p.read_text(encoding="utf-8"), filename=str(p)) for m, p in modules.items()}
    lines = {m: len(p.read_text(encoding="utf-8").splitlines()) for m, p in modules.items()}
    rel = {m: str(p.relative_to(root)) for m, p in modules.items()}
    stage = {m: _stage(m, flat) for m in modules}

    graph: dict[str, set[str]] = defaultdict(set)
    private_imports: list[str] = []
    for m, tree in trees.items():
        for line, target, name in _imports(m, tree, modules):
            if target in modules and target != m:
                graph[m].add(target)
            target_stage = _stage(target, flat)
            if target_stage in (stage[m], BASE):
                continue
            if name is not None and _is_private(name):
                private_imports.append(f"{rel[m]}:{line}: from {target} import {name}")
            elif any(_is_private(p) for p in target.split(".")[1:]):
                place = f"{rel[m]}:{line}: {target}"  # one reach per statement, however many names
                if place not in private_imports:
                    private_imports.append(place)

    defined = {m: _defined_private_names(t) for m, t in trees.items()}
    stages_defining: dict[str, set[str]] = defaultdict(set)
    for m, names in defined.items():
        for n in names:
            stages_defining[n].add(stage[m])
    reads = []
    names_reached = set()
    for m, tree in trees.items():
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and _is_private(node.attr) and not _is_own(node.value)
                    and stages_defining.get(node.attr) and stage[m] not in stages_defining[node.attr]):
                reads.append(f"{rel[m]}:{node.lineno}: .{node.attr} (defined in "
                             f"{'/'.join(sorted(stages_defining[node.attr]))})")
                names_reached.add(node.attr)
    names_reached |= {p.rsplit(" ", 1)[-1] for p in private_imports}

    top = sorted(p.name for p in (root / "fastdata").glob("*.py"))
    subpackages = sorted(p.parent.name for p in (root / "fastdata").glob("*/__init__.py"))
    longest = max(lines, key=lambda m: lines[m])
    return Stats(str(root), "flat" if flat else "stages", len(modules), len(top), top, subpackages,
                 _circles(graph), rel[longest], lines[longest], private_imports, reads, sorted(names_reached))


def _table(all_stats: list[Stats]) -> str:
    rows = [
        ("layout", [s.layout for s in all_stats]),
        ("modules (all .py in fastdata/)", [s.modules for s in all_stats]),
        ("top-level modules (fastdata/*.py)", [s.top_level_modules for s in all_stats]),
        ("subpackages", [len(s.subpackages) for s in all_stats]),
        ("import circles (groups)", [len(s.circles) for s in all_stats]),
        ("longest file (lines)", [f"{s.longest_file} ({s.longest_lines})" for s in all_stats]),
        ("private cross-stage accesses", [s.private_accesses for s in all_stats]),
        ("  of which imports", [len(s.private_imports) for s in all_stats]),
        ("  of which attribute reads", [len(s.private_attribute_reads) for s in all_stats]),
        ("  distinct private names", [len(s.private_names) for s in all_stats]),
    ]
    width = max(len(r[0]) for r in rows)
    cols = [max(len(str(v)) for v in [s.root, *(r[1][i] for r in rows)]) for i, s in enumerate(all_stats)]
    out = [" " * width + "  " + "  ".join(s.root.ljust(c) for s, c in zip(all_stats, cols))]
    for label, values in rows:
        out.append(label.ljust(width) + "  " + "  ".join(str(v).ljust(c) for v, c in zip(values, cols)))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("roots", nargs="*", type=Path, help="checkouts to measure (default: this one)")
    p.add_argument("--json", type=Path, help="write every figure and the listed places as JSON here")
    p.add_argument("--details", action="store_true", help="list circles and private accesses")
    args = p.parse_args(argv)
    roots = args.roots or [Path(__file__).resolve().parents[1]]
    all_stats = [stats(r) for r in roots]
    print(_table(all_stats))
    if args.details:
        for s in all_stats:
            print(f"\n== {s.root}")
            for c in s.circles:
                print("circle: " + " <-> ".join(c))
            for line in s.private_imports + s.private_attribute_reads:
                print("private: " + line)
    if args.json:
        args.json.write_text(json.dumps([{**asdict(s), "private_accesses": s.private_accesses} for s in all_stats],
                                        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
