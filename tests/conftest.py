"""Test configuration: Triton's interpreter on machines without a GPU, and
skipping of GPU-only tests there."""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()

# Triton reads this when @triton.jit decorates a kernel, so it must be set
# before any test imports dma_compile.kernels.
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def seed():
    """A fresh seed per test run, printed on failure, so inputs are random but reproducible."""
    value = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(value)
    return value
