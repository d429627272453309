"""The inventory of fork hooks, exit hooks and threads (fastdata._runtime) is complete: nothing bypasses it."""
from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import pytest

import fastdata
from fastdata import _runtime

PACKAGE = Path(fastdata.__file__).parent
BYPASSES = {("os", "register_at_fork"), ("atexit", "register"), ("threading", "Thread"), (None, "ThreadPoolExecutor"),
            ("futures", "ThreadPoolExecutor")}


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p.name != "_runtime.py")


def _calls(tree: ast.AST) -> list[ast.Call]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call)]


def _target(call: ast.Call) -> tuple[str | None, str] | None:
    f = call.func
    if isinstance(f, ast.Attribute):
        return (f.value.id if isinstance(f.value, ast.Name) else f.value.attr if isinstance(f.value, ast.Attribute)
                else None, f.attr)
    if isinstance(f, ast.Name):
        return None, f.id
    return None


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_registers_a_fork_hook_or_starts_a_thread_past_the_inventory(path: Path) -> None:
    tree = ast.parse(path.read_text())
    found = [f"line {c.lineno}: {'.'.join(x for x in t if x)}" for c in _calls(tree)
             if (t := _target(c)) in BYPASSES]
    assert not found, f"use fastdata._runtime.at_fork/at_exit/thread/executor instead: {found}"


def _thread_names(tree: ast.AST) -> list[tuple[int, str]]:
    """The literal start of the ``name=`` given to every _runtime.thread/executor call (a constant,
    an f-string's leading text, or a module-level constant)."""
    consts = {t.id: n.value.value for n in ast.walk(tree) if isinstance(n, ast.Assign)
              for t in n.targets if isinstance(t, ast.Name) and isinstance(n.value, ast.Constant)}
    out = []
    for call in _calls(tree):
        t = _target(call)
        if t is None or t[1] not in ("thread", "new_thread", "executor", "Pool"):  # a Pool names its threads
            continue
        name = next((k.value for k in call.keywords if k.arg == "name"), None)
        if isinstance(name, ast.Constant):
            out.append((call.lineno, name.value))
        elif isinstance(name, ast.JoinedStr) and isinstance(name.values[0], ast.Constant):
            out.append((call.lineno, name.values[0].value))
        elif isinstance(name, ast.Name) and name.id in consts:
            out.append((call.lineno, consts[name.id]))
        elif isinstance(name, ast.JoinedStr):  # f"{self.name}-...": the pool's default name
            out.append((call.lineno, "<dynamic>"))
    return out


def test_every_thread_name_is_in_the_inventory_and_owned_by_the_module_that_starts_it() -> None:
    seen: dict[str, set[str]] = {}
    for path in _modules():
        module = "fastdata." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
        for line, name in _thread_names(ast.parse(path.read_text())):
            if name == "<dynamic>":
                continue
            prefix = max((p for p in _runtime.THREADS if name.startswith(p)), key=len, default=None)
            assert prefix is not None, f"{module}:{line}: thread name {name!r} is not in _runtime.THREADS"
            seen.setdefault(prefix, set()).add(module)
    from fastdata.loader._pool import Pool  # the decode pool names its threads after itself

    seen.setdefault(Pool(1).name, set()).add("fastdata.loader._pool")
    for prefix, (owner, _) in _runtime.THREADS.items():
        assert seen.get(prefix) == {owner}, f"{prefix}: owned by {owner}, started in {sorted(seen.get(prefix, ()))}"


def test_an_unknown_thread_name_is_refused() -> None:
    with pytest.raises(ValueError, match="not in fastdata._runtime.THREADS"):
        _runtime.thread(print, name="worker-1")
    with pytest.raises(ValueError, match="not in fastdata._runtime.THREADS"):
        _runtime.executor(1, name="fastdata-prefetcher")  # a prefix must match whole words
    t = _runtime.thread(print, name="fastdata-verify-3")
    assert t.daemon and t.name == "fastdata-verify-3" and not t.is_alive()


def test_every_fork_hook_of_every_module_is_in_the_inventory_with_its_owner() -> None:
    for info in pkgutil.walk_packages(fastdata.__path__, "fastdata."):
        if not info.name.endswith("__main__"):  # it runs the command line
            importlib.import_module(info.name)
    hooks = _runtime.fork_hooks()
    owners = [h.owner for h in hooks]
    assert len(owners) == len(set(owners)), "one hook per module: a second one in a module is a hint to merge them"
    assert set(owners) == {"fastdata._util", "fastdata.cache._store", "fastdata.dataset._readers",
                           "fastdata.nodecache._threads", "fastdata.loader._pool", "fastdata.loader._gather",
                           "fastdata.loader._watchdog"}
    for h in hooks:
        assert h.purpose and any((h.before, h.after_in_parent, h.after_in_child)), h
        assert (h.before is None) == (h.after_in_parent is None), f"{h.owner}: a pause needs its resume"


def test_every_exit_hook_is_in_the_inventory_with_its_owner() -> None:
    for info in pkgutil.walk_packages(fastdata.__path__, "fastdata."):
        if not info.name.endswith("__main__"):  # it runs the command line
            importlib.import_module(info.name)
    hooks = _runtime.exit_hooks()
    assert {h.owner for h in hooks} == {"fastdata.dataset._preload", "fastdata.prefetch._prefetcher",
                                        "fastdata.gpu._threads", "fastdata.gpu._nvimgcodec"}
    assert all(h.purpose and callable(h.fn) for h in hooks)
