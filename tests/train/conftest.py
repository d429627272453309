"""Fixtures shared by the training tests."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture
def restore_tf32():
    """tf32=True changes process-wide flags: put them back for the tests that follow."""
    matmul, cudnn = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    yield
    torch.set_float32_matmul_precision(matmul)
    torch.backends.cudnn.allow_tf32 = cudnn
