"""Read-ahead for the device decode stage: :meth:`DecodeImages.ahead` returns a :class:`DecodeAhead`.

It reads ``batches`` batches past the one it yields and starts their device decode
(``DecodeImages.submit``), so decoding overlaps the resampling of the batch in hand. Invariants: batches
come out in the loader's order, each once; ``state_dict()`` is the loader's state as of the batch last
yielded (batches read ahead are not counted); the loader's ``iter()`` runs in the caller's thread.
Design note: docs/design/gpu-decode.md.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any, Protocol

__all__ = ["DecodeAhead", "check_batches"]

_END = object()


class _Submits(Protocol):
    def submit(self, batch: Any) -> None: ...


def check_batches(batches: Any) -> int:
    """``batches`` validated: an int >= 1 (a ValueError naming it otherwise)."""
    if isinstance(batches, bool) or not isinstance(batches, int) or batches < 1:
        raise ValueError(f"DecodeImages.ahead: batches must be an int >= 1 (batches decoded ahead of the one in "
                         f"hand), got {batches!r}")
    return batches


class DecodeAhead:
    """An iterable of batches whose packed images started decoding ``batches`` batches early."""

    def __init__(self, iterable: Any, stage: _Submits, batches: int = 1) -> None:
        self.iterable = iterable
        self.stage = stage
        self.batches = check_batches(batches)
        self._state: Any = None
        self._has_state = False

    def __iter__(self) -> Iterator[Any]:
        # the loader's iterator is made here, in the caller's thread, as without this wrapper (a
        # DataLoader starts or resets its workers there); batches are pulled where they are consumed
        self._has_state = False  # until its first batch, the state is the loader's: the new epoch's start
        return self._batches(iter(self.iterable))

    def _batches(self, it: Iterator[Any]) -> Iterator[Any]:
        snapshot = getattr(self.iterable, "state_dict", None)
        snapshot = snapshot if callable(snapshot) else None
        self._has_state = False
        window: deque[tuple[Any, Any]] = deque()  # (batch, the loader's state right after reading it)

        def read() -> bool:
            batch = next(it, _END)
            if batch is _END:
                return False
            window.append((batch, snapshot() if snapshot is not None else None))
            self.stage.submit(batch)
            return True

        more = True
        while more and len(window) < self.batches:
            more = read()
        while window:
            cur, state = window.popleft()
            if more:  # keep ``batches`` batches decoding behind the one handed out
                more = read()
            self._state, self._has_state = state, True
            yield cur

    @property
    def state_dict(self) -> Any:
        """The loader's ``state_dict`` as of the batch last yielded (not those read ahead); an
        AttributeError, as for the loader, when it has none."""
        fn = self.iterable.state_dict

        def state_dict() -> Any:
            return self._state if self._has_state else fn()
        return state_dict

    @property
    def load_state_dict(self) -> Any:
        fn = self.iterable.load_state_dict

        def load_state_dict(state: Any) -> None:
            self._has_state = False
            fn(state)
        return load_state_dict

    def __len__(self) -> int:
        return len(self.iterable)

    def __getattr__(self, name: str) -> Any:
        if name in ("iterable", "stage", "batches", "_state", "_has_state"):
            raise AttributeError(name)
        return getattr(self.iterable, name)
