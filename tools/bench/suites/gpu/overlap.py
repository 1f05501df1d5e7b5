"""The ``gpu`` suite's ``layers-overlap`` case: an engine's per-layer loads behind its compute.

32-layer KV blocks sit in the pinned tier; a forward pass needs layer ``i`` of every block before its layer ``i``
computes. sfstore's side does what an engine with sfstore does: ``prefetch`` once, then layer ``i + 1`` loads
(``get_layer_into`` on a load stream) while layer ``i`` computes (a stand-in kernel per layer on a compute stream
that waits on layer ``i``'s event). The reference does the same loads and the same compute one after the other
(every layer loaded, then every layer computed), as an engine that loads its KV before the forward pass. Their
ratio is the time overlap saves; the share of the load time hidden, ``1 - (t_overlapped - t_compute) / t_load``,
is the goal (>= 70% on CUDA). The stand-in compute is calibrated once to take about a layer's load time.
With ``--device cpu`` nothing runs beside anything (no streams): the case runs, without a goal.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from tools.bench.common import BenchSetupError
from tools.bench.measure import CpuMeter, RunResult
from tools.bench.suites.gpu.sides import Blocks, WrongResult

__all__ = ["Overlap", "overlap_geometry", "HIDDEN_GOAL", "LAYERS"]

LAYERS = 32
HIDDEN_GOAL = 0.70  # an engine's per-layer loads hide >= 70% of their time behind its compute


def overlap_geometry(block_bytes: int) -> Any:
    """A 32-layer KV geometry of blocks of ``block_bytes``: 16 tokens, bfloat16, heads x head_dim =
    ``block_bytes / 2048`` (head_dim 128 where that divides it: 8 heads at 2 MiB)."""
    from sfstore.kvcache import KVGeometry

    per_layer_token = LAYERS * 2 * 16 * 2  # layers x (K, V) x tokens x bf16 bytes
    if block_bytes % per_layer_token:
        raise BenchSetupError(f"a {LAYERS}-layer block of 16 tokens is a multiple of {per_layer_token} bytes; "
                              f"--block-size gives {block_bytes}")
    per = block_bytes // per_layer_token
    dim = math.gcd(per, 128)
    return KVGeometry(num_layers=LAYERS, block_tokens=16, num_kv_heads=per // dim, head_dim=dim, dtype="bfloat16")


def _on_stream(torch: Any, stream: Any, fn: Callable[[], None]) -> None:
    with torch.cuda.stream(stream):
        fn()


def stand_in_compute(torch: Any, stream: Any, seconds: float) -> tuple[Callable[[], None], str]:
    """A callable that keeps ``stream`` busy for about ``seconds`` (one layer's compute), and what it is: a spin
    kernel (``torch.cuda._sleep``) calibrated with CUDA events, else repeated matmuls; without a stream
    ``time.sleep``."""
    if stream is None:
        return partial(time.sleep, seconds), f"time.sleep({seconds * 1e3:.2f} ms) per layer (no streams)"
    sleep = getattr(torch.cuda, "_sleep", None)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        if sleep is not None:
            probe = 20_000_000
            sleep(1000)  # the kernel's first launch loads it: outside the calibration
            start.record()
            sleep(probe)
            end.record()
            end.synchronize()
            per_s = probe / (start.elapsed_time(end) / 1e3)
            cycles = max(1, int(seconds * per_s))
            return (partial(_on_stream, torch, stream, partial(sleep, cycles)),
                    f"torch.cuda._sleep({cycles}) per layer ({per_s / 1e9:.2f} G cycles/s)")
        a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
        torch.matmul(a, a)
        start.record()
        for _ in range(10):
            torch.matmul(a, a)
        end.record()
        end.synchronize()
        one = start.elapsed_time(end) / 1e3 / 10
    reps = max(1, round(seconds / one))

    def matmuls() -> None:
        for _ in range(reps):
            torch.matmul(a, a)

    return partial(_on_stream, torch, stream, matmuls), f"{reps} bf16 2048x2048 matmuls per layer"


class Overlap:
    """The case's two sides over one store: :meth:`overlapped` (sfstore's) and :meth:`sequential` (the
    reference); both load every layer of every block from the pinned tier and run the same compute."""

    def __init__(self, blocks: Blocks) -> None:
        from sfstore.kvcache import KVCacheStore

        lib = blocks.lib
        torch = lib.torch  # type: ignore[attr-defined]
        self.blocks, self.torch = blocks, torch
        self.cuda = lib.device == "cuda"
        B, N = blocks.block_bytes, blocks.nblocks
        self.geom = overlap_geometry(B)
        shape = (N, *self.geom.block_shape)
        srcb = list(blocks.src.view(torch.bfloat16).view(shape).unbind(0))
        per_block = blocks.dst.view(torch.bfloat16).view(shape)
        self.layer_dst = [[per_block[n, layer] for n in range(N)] for layer in range(LAYERS)]
        self.kv = KVCacheStore(self.geom, model_id="bench-gpu-overlap", pinned_bytes=(N + 8) * (B + 8192))
        self.keys = self.kv.keys_for(list(range(N * self.geom.block_tokens)))
        self.kv.put(self.keys, srcb)
        self.kv.wait_for_puts()
        self.load_stream = torch.cuda.Stream() if self.cuda else None
        self.compute_stream = torch.cuda.Stream() if self.cuda else None
        self.misses = 0
        t_load = self._time(self._loads_alone)  # calibration: the compute takes about a layer's load
        self.busy, self.compute = stand_in_compute(torch, self.compute_stream, t_load / LAYERS)

    def _load(self, layer: int) -> Any:
        """Layer ``layer`` of every block into its destination, issued on the load stream; its event (CUDA)."""
        torch = self.torch
        ctx = torch.cuda.stream(self.load_stream) if self.load_stream is not None else contextlib.nullcontext()
        with ctx:
            tiers = self.kv.get_layer_into(self.keys, layer, self.layer_dst[layer])
            self.misses += sum(1 for t in tiers if t != "pinned")
            if self.load_stream is None:
                return None
            ev = torch.cuda.Event()
            ev.record(self.load_stream)
            return ev

    def _loads_alone(self) -> None:
        self.kv.prefetch(self.keys, count=True).get()
        for layer in range(LAYERS):
            self._load(layer)

    def _compute_alone(self) -> None:
        for _layer in range(LAYERS):
            self.busy()

    def _interleaved(self) -> None:
        self.kv.prefetch(self.keys, count=True).get()
        events = [self._load(0)]
        for layer in range(LAYERS):
            if self.compute_stream is not None:
                self.compute_stream.wait_event(events[layer])  # layer i's compute reads layer i's KV
            self.busy()
            if layer + 1 < LAYERS:
                events.append(self._load(layer + 1))

    def _time(self, fn: Callable[[], None]) -> float:
        self.blocks.lib.sync()
        t0 = time.perf_counter()
        fn()
        self.blocks.lib.sync()
        return time.perf_counter() - t0

    def _checked(self, what: str) -> None:
        if self.misses:
            raise WrongResult(f"layers-overlap ({what}): {self.misses} layer load(s) did not come from the pinned "
                              "tier")
        self.blocks.check(f"layers-overlap ({what})")

    def overlapped(self) -> RunResult:
        """sfstore's side: layer i + 1 loads while layer i computes."""
        self.blocks.clear()
        meter = CpuMeter()
        meter.start()
        seconds = self._time(self._interleaved)
        cpu = meter.stop()
        self._checked("overlapped")
        return RunResult(bytes=self.blocks.total, ops=LAYERS, seconds=seconds, cpu_s=cpu)

    def sequential(self) -> RunResult:
        """The reference: every layer loaded, then every layer computed; the two times kept apart too."""
        self.blocks.clear()
        meter = CpuMeter()
        meter.start()
        t_load = self._time(self._loads_alone)
        t_compute = self._time(self._compute_alone)
        cpu = meter.stop()
        self._checked("sequential")
        return RunResult(bytes=self.blocks.total, ops=LAYERS, seconds=t_load + t_compute, cpu_s=cpu,
                         extra={"t_load_s": t_load, "t_compute_s": t_compute})

    def close(self) -> None:
        self.kv.close()
        self.layer_dst.clear()


def hidden_fraction(overlapped_s: float, t_load_s: float, t_compute_s: float) -> float:
    """The share of the load time the overlap hid: ``1 - (overlapped - compute) / load``."""
    return 1.0 - (overlapped_s - t_compute_s) / t_load_s if t_load_s > 0 else 0.0
