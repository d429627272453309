"""The image decoder libraries that load in this environment, for tests parametrised over them.

Tests name the decoder they use instead of depending on what ``"auto"`` picks on the machine;
a library that does not load here is left out of the lists (the dev extra installs them all).
"""
from __future__ import annotations

from fastdata.gpu import _codec


def _loads(name: str) -> bool:
    status = {"torchcodec": _codec.torchcodec_status, "torchvision": _codec.torchvision_status,
              "nvimgcodec": _codec.nvimgcodec_status}[name]
    return status()[0] is not None


# host decoders: Pillow always; the libraries where they load
HOST_DECODERS = ["pillow"] + [n for n in ("torchcodec", "torchvision") if _loads(n)]
# device decoders of the CUDA tests (nvImageCodec's CPU backend also runs on the CPU)
DEVICE_DECODERS = [n for n in ("torchcodec", "torchvision", "nvimgcodec") if _loads(n)]


def unimportable(monkeypatch, *modules: str) -> None:
    """Make ``import`` of each module fail as if it were not installed, for the rest of the test, also where it
    was imported before (``from nvidia import nvimgcodec`` reads the attribute of an imported parent first)."""
    import sys

    for name in modules:
        monkeypatch.setitem(sys.modules, name, None)
        parent, _, child = name.rpartition(".")
        if parent and hasattr(sys.modules.get(parent), child):
            monkeypatch.delattr(sys.modules[parent], child)
