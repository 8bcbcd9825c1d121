"""Shared pytest setup: GPU tests skip with a reason when CUDA is absent."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA; this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
