"""The BlockStore conformance suite on an image file and on a raw loop device with 4096-byte sectors.

The same suite runs on a real NVMe-oF namespace over soft-RoCE in the testbed VM
(``tests/integration/test_block_store_nvmeof.py``).
"""

from __future__ import annotations

from typing import Any

import pytest

from sfstore.testing.block_store import BlockStoreTests


class TestBlockStoreOnImageFile(BlockStoreTests):
    """The embedded default: a preallocated image file."""


class TestBlockStoreOnLoopDevice4k(BlockStoreTests):
    """A block device with 4096-byte logical blocks (O_DIRECT at 4096, headers of 4096 bytes)."""

    @pytest.fixture
    def block_target(self, loop_block_device: str) -> Any:
        return loop_block_device
