"""Errors raised in background threads: the note naming the thread, also where exceptions have no add_note."""
from __future__ import annotations

from fastdata._util import add_note


class _NoNotes(Exception):
    """An exception as Python 3.10 has them: no add_note method."""

    def __getattribute__(self, name: str):  # noqa: ANN204
        if name == "add_note":
            raise AttributeError(name)
        return super().__getattribute__(name)


def test_add_note_works_without_exception_add_note():
    # fastdata declares Python >= 3.10; BaseException.add_note is 3.11+. The thread decoder's error path called
    # e.add_note(...) directly, which on 3.10 replaced the user's error with an AttributeError.
    e = _NoNotes("boom")
    add_note(e, "(in thread t of fastdata.DataLoader)")
    assert e.__notes__ == ["(in thread t of fastdata.DataLoader)"]
    f = ValueError("x")
    add_note(f, "a")
    add_note(f, "b")
    assert f.__notes__ == ["a", "b"]
