"""GPU checks for a machine with a CUDA GPU (the device tool's H200), run once per task that has one.

    python tools/gpu_check.py [--json OUT]

Checks what CPU-only CI cannot: the CUDA driver is found through dlopen, registered buffers are
CUDA-registered (cuMemHostRegister) and torch sees them as pinned, a file is read into a CUDA tensor through
FilePath (pinned bounce path) bit-exactly, and the probe reports the GPUs (and GDS where present). Each check
prints PASS/FAIL/SKIP with the reason; the exit status is 1 when any check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

Result = dict[str, Any]


def _check_probe() -> str:
    from sfstore.probe import probe

    report = probe()
    gpus = report["gpus"]
    if gpus.get("status") != "ok":
        raise AssertionError(f"probe reports no GPU: {gpus}")
    return f"{gpus.get('count', '?')} GPU(s); gds: {report['gds'].get('status')}"


def _check_cuda_registration() -> str:
    import torch
    from torch.utils.dlpack import from_dlpack

    from sfstore.buffers import RegisteredBufferPool, memory_capabilities

    caps = memory_capabilities()
    if not caps["cuda_register"]["ok"]:
        raise AssertionError(f"cuda registration unavailable: {caps['cuda_register']['reason']}")
    with RegisteredBufferPool(8 << 20, cuda_register="on") as pool:
        buf = pool.acquire()
        assert buf.cuda_registered
        host = from_dlpack(buf)
        host.fill_(7)
        dev = host.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        assert int(dev.sum().item()) == 7 * (8 << 20)
        del host, dev
        buf.release()
    return "cuMemHostRegister ok; host->device copy from a registered buffer verified"


def _check_read_into_cuda() -> str:
    import torch

    from sfstore.paths.file import FilePath

    with tempfile.TemporaryDirectory() as d:
        fp = FilePath(d)
        payload = os.urandom(20 << 20)
        fp.write("x.bin", payload)
        out = torch.empty(len(payload), dtype=torch.uint8, device="cuda")
        n = fp.read_into("x.bin", out)
        assert n == len(payload)
        assert bytes(out.cpu().numpy()) == payload
    return "FilePath.read_into(cuda tensor) through pinned bounce buffers: bit-exact"


CHECKS: list[tuple[str, Callable[[], str]]] = [
    ("probe", _check_probe),
    ("cuda_registration", _check_cuda_registration),
    ("read_into_cuda", _check_read_into_cuda),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="OUT", help="also write the results as JSON")
    args = parser.parse_args(argv)
    results: list[Result] = []
    for name, fn in CHECKS:
        try:
            detail = fn()
            results.append({"check": name, "status": "PASS", "detail": detail})
        except ImportError as exc:
            results.append({"check": name, "status": "SKIP", "detail": f"missing: {exc}"})
        except Exception as exc:
            results.append({"check": name, "status": "FAIL", "detail": repr(exc), "trace": traceback.format_exc()})
        r = results[-1]
        print(f"{r['status']:<5} {name}: {r['detail']}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 1 if any(r["status"] == "FAIL" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
