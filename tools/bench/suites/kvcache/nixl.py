"""NIXL's POSIX backend as a reference of the kvcache suite (``get-block-vs-nixl`` / ``put-block-vs-nixl``): the
same blocks as the store, moved between the same DRAM buffers and the value areas of the store's own slots.

Needs ``nixl`` and ``nixl-cu12`` (``tools/kvbench-env.sh``); runs without a GPU.
"""

from __future__ import annotations

import importlib
import os
import time
from typing import Any

from tools.bench.common import BenchSetupError, drop_cache, warn
from tools.bench.measure import CpuMeter, RunResult
from tools.bench.pairs import SideFailed
from tools.bench.suites.kvcache.workload import ENV_HINT, Bench, block_latency, timed_batches

__all__ = ["probe", "NixlPeer"]


def probe() -> str | None:
    """Why NIXL's POSIX backend cannot be used here, or None when it can.

    Returns
    -------
    str or None
        ``not installed: ...`` (with how to get it) or the error; None when ``nixl._api`` imports and has
        the POSIX plugin.
    """
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    try:
        api = importlib.import_module("nixl._api")
    except ImportError as exc:
        return f"not installed ({exc}); {ENV_HINT}"
    except Exception as exc:  # a broken install: say what it raised
        return f"cannot import nixl: {type(exc).__name__}: {exc}"
    try:
        agent = api.nixl_agent(f"sfstore-probe-{os.getpid()}", api.nixl_agent_config(backends=[]))
        plugins = list(agent.get_plugin_list())
    except Exception as exc:
        return f"NIXL cannot start an agent: {type(exc).__name__}: {exc}"
    if "POSIX" not in plugins:
        return f"NIXL has no POSIX plugin (it has {', '.join(plugins) or 'none'})"
    return None



class NixlPeer:
    """NIXL's POSIX backend on the block store's own slots: an agent, the source and destination blocks registered
    as DRAM, the image registered as FILE (fd mode, O_DIRECT), and per batch the value areas of the batch's keys'
    slots (``BlockStore.locate``), so NIXL moves the same bytes at the same places in the same order as the
    store. A NIXL put writes each block's bytes over the same bytes, so the store stays intact."""

    def __init__(self, bench: Bench) -> None:
        self.b = bench
        self.tier = tier = bench.block_tier()
        self.api = importlib.import_module("nixl._api")
        self.fd = -1
        self.agent: Any = None
        self.regs: list[Any] = []
        self.local: dict[str, Any] = {}
        self.remote: Any = None
        self.offsets: list[int] = []
        try:
            self.agent = self.api.nixl_agent(f"sfstore-bench-{os.getpid()}", self.api.nixl_agent_config(backends=[]))
            try:
                self.agent.create_backend("POSIX", {"use_uring": "true"})
                self.queue = "io_uring (use_uring=true)"
            except Exception as exc:
                warn(f"NIXL POSIX backend refused use_uring ({type(exc).__name__}: {exc}); using its default queue")
                self.agent.create_backend("POSIX")
                self.queue = "its default (use_uring refused)"
            self.params = dict(self.agent.get_backend_params("POSIX"))
            self.fd = os.open(tier.image, os.O_RDWR | os.O_DIRECT)
            blk, batch = bench.block, bench.batch
            for region in (bench.values, bench.dests):
                self.regs.append(self.agent.register_memory([(region.address, batch * blk, 0, "")], "DRAM"))
            self.regs.append(self.agent.register_memory([(0, tier.image_size, self.fd, "")], "FILE"))
            for op, region in (("WRITE", bench.values), ("READ", bench.dests)):
                self.local[op] = self.agent.prep_xfer_dlist(
                    "NIXL_INIT_AGENT", [(region.address + j * blk, blk, 0) for j in range(batch)], "DRAM")
        except Exception as exc:
            self.close()
            raise SideFailed(f"NIXL POSIX backend failed to start: {type(exc).__name__}: {exc}") from exc

    def _locate(self) -> None:
        """Make the store hold the N blocks (untimed) and prep the FILE descriptors of their value areas (again
        only when the slots moved)."""
        tier = self.tier
        tier.fill()
        hdr = tier.layout.header_bytes
        offsets = []
        for key in tier.flat:
            where = tier.bs.locate(key)
            if where is None:
                raise BenchSetupError("NIXL side: a block the store was filled with has no slot")
            offsets.append(int(where[0]) + hdr)
        if offsets == self.offsets and self.remote is not None:
            return
        if self.remote is not None:
            self.agent.release_dlist_handle(self.remote)
            self.remote = None
        self.remote = self.agent.prep_xfer_dlist(self.agent.name, [(o, self.b.block, self.fd) for o in offsets],
                                                 "FILE")
        self.offsets = offsets

    def _transfer(self, op: str, batch: int) -> None:
        b, agent = self.b, self.agent
        first, count = b.firsts[batch], len(b.tokens[batch]) // b.geom.block_tokens
        handle = agent.make_prepped_xfer(op, self.local[op], list(range(count)), self.remote,
                                         list(range(first, first + count)))
        try:
            state = agent.transfer(handle)
            while state == "PROC":
                state = agent.check_xfer_state(handle)
            if state != "DONE":
                raise SideFailed(f"NIXL {op} of {count} blocks ended in state {state}")
        finally:
            agent.release_xfer_handle(handle)

    def put(self) -> RunResult:
        b = self.b
        self._locate()
        drop_cache(self.tier.image)
        _, lat, cpu0, t0, tf = timed_batches(lambda i: self._transfer("WRITE", i), range(len(b.tokens)))
        meter = CpuMeter()
        meter.start()
        os.fsync(self.fd)
        t1 = time.perf_counter()
        cpu = cpu0 + meter.stop()
        return RunResult(bytes=b.n * b.block, ops=b.n, seconds=t1 - t0, cpu_s=cpu,
                         extra={**block_latency(lat), "fsync_s": t1 - tf})

    def get(self) -> RunResult:
        b = self.b
        self._locate()
        b.zero_dests()
        drop_cache(self.tier.image)
        _, lat, cpu, t0, t1 = timed_batches(lambda i: self._transfer("READ", i), b.get_order)
        b.check_dests("get-block NIXL", b.get_order[-1], b.value_of)
        return RunResult(bytes=b.n * b.block, ops=b.n, seconds=t1 - t0, cpu_s=cpu, extra=block_latency(lat))

    def close(self) -> None:
        agent = self.agent
        if agent is not None:
            for h in [*self.local.values(), self.remote]:
                if h is None:
                    continue
                try:
                    agent.release_dlist_handle(h)
                except Exception:
                    pass
            for r in self.regs:
                try:
                    agent.deregister_memory(r)
                except Exception:
                    pass
        self.local, self.remote, self.regs, self.agent = {}, None, [], None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


    def call(self, writes: bool) -> str:
        """What a put (``writes``) or get run calls, for the case's ``params``."""
        b, op = self.b, "WRITE" if writes else "READ"
        return (f"nixl_agent POSIX ({self.queue}): make_prepped_xfer({op}, {b.batch} DRAM blocks, the value areas of "
                f"the batch's {b.batch} slots in {self.tier.image}) + transfer + poll per batch"
                + (" + fsync" if writes else ""))

    def describe(self) -> dict[str, Any]:
        """Backend, queue, parameters, file and version, for the JSON's ``machine.references``."""
        return {"backend": "POSIX", "queue": self.queue, "params": self.params, "file": self.tier.image,
                "version": _dist_version("nixl")}


def _dist_version(name: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:
        return None
