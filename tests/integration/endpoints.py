"""Helpers shared by the integration tests: the testbed's endpoints from its environment variables."""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest


def env(name: str) -> str:
    """A testbed variable; fails the test (not skips it) when the guest did not set it."""
    value = os.environ.get(name)
    if not value:
        failed = os.environ.get("SFSTORE_TESTBED_SETUP_FAILED", "")
        pytest.fail(f"{name} is not set by the testbed" + (f" (setup failed in: {failed})" if failed else ""))
    return value


@dataclass(frozen=True)
class NvmeofTarget:
    """The NVMe-oF target the guest set up."""

    transport: str
    traddr: str
    trsvcid: str
    subsysnqn: str


def find_controller(subsysnqn: str) -> dict[str, Any] | None:
    """The live controller of ``subsysnqn`` in /sys/class/nvme with its namespace block devices, if any."""
    for ctrl in sorted(glob.glob("/sys/class/nvme/nvme*")):
        try:
            nqn = Path(ctrl, "subsysnqn").read_text().strip()
            state = Path(ctrl, "state").read_text().strip()
        except OSError:
            continue
        if nqn != subsysnqn or state != "live":
            continue
        devices = []
        for ns in sorted(glob.glob(os.path.join(ctrl, "nvme*n*"))):
            name = os.path.basename(ns)
            if "c" in name[4:]:  # multipath path device nvme0c0n1 -> block device nvme0n1
                name = name.split("c", 1)[0] + "n" + name.rsplit("n", 1)[1]
            devices.append(f"/dev/{name}")
        return {"name": os.path.basename(ctrl), "devices": devices}
    return None
