"""Shared test configuration: GPU tests skip without CUDA."""

import os

import pytest
import torch

# Without a GPU the Triton kernels run in Triton's interpreter. Triton decides at decoration
# time, so this must be set before any test imports miles_native.kernels (directly or through
# miles_fsdp's MoE adaptation).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords or "/tests/gpu/" in str(item.fspath):
            item.add_marker(skip)
