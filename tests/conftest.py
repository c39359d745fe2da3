"""Every test starts from its own fixed seed (from its node id), so its random inputs are the
same on every run and a failure reproduces with `pytest <node id>`. Tests that seed themselves
still do; this covers those that draw without a seed (one such GPU test failed at random until
the kernel it checks was made deterministic: docs/performance.md §31)."""

from __future__ import annotations

import random
import zlib
from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed_per_test(request: pytest.FixtureRequest) -> Iterator[None]:
    seed = zlib.crc32(request.node.nodeid.encode())
    random.seed(seed)
    torch.manual_seed(seed)  # every device's generator
    yield
