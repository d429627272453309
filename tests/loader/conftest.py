"""Fixtures shared by the loader tests."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.helpers.shards import make_shards


@pytest.fixture(scope="module")
def tiny_jpeg_shards(tmp_path_factory: Any) -> Path:
    """8 small JPEGs (20 to 27 x 24 pixels) with int labels, in 2 tar shards."""
    return make_shards(tmp_path_factory.mktemp("tiny") / "ds", 8, 4, key="k{i:03d}", image=lambda i: (20 + i, 24),
                       cls="int")
