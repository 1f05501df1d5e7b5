"""Would the block store gain from storing a KV chunk as one value? Issue 27 asked to measure it.

One run, both sides interleaved pair by pair: ``get_into`` of ``--bytes`` as values of ``--block`` bytes (a KV
block each, as the block tier stores them) against the same bytes as values of ``--chunk`` bytes (a chunk of
consecutive blocks as one value), from one block store on an image file (O_DIRECT: the page cache is not
involved) into registered buffers. Prints the median of each side and their ratio; the machine's noise falls on
both sides alike.

    python -m tools.bench.block_units [--dir DIR] [--block 128k] [--chunk 1m] [--bytes 8m] [--pairs 30]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Any

from tools.bench.common import default_bench_dir
from tools.bench.options import parse_size

__all__ = ["measure", "main"]


def measure(directory: str, block: int, chunk: int, total: int, pairs: int) -> dict[str, Any]:
    """Time both sides ``pairs`` times (after two warm-up pairs); their medians in seconds and the ratio."""
    import numpy as np

    from sfstore.blocks import BlockStore
    from sfstore.buffers import RegisteredBufferPool

    if block <= 0 or chunk <= block or chunk % block or total % chunk:
        raise ValueError("--chunk must be a multiple of --block, and --bytes a multiple of --chunk")
    image = os.path.join(directory, f"block-units-{os.getpid()}.img")
    store = BlockStore({"kind": "image", "path": image, "size": 2 * total + (64 << 20)},
                       size_classes=(block, chunk), format=True)
    try:
        rng = np.random.default_rng(0)
        sides: dict[str, tuple[list[bytes], list[Any]]] = {}
        for name, size in (("blocks", block), ("chunks", chunk)):
            keys = [f"{name}-{i}".encode().ljust(32, b"\0") for i in range(total // size)]
            store.put_many([(k, rng.integers(0, 255, size, dtype=np.uint8)) for k in keys])
            pool = RegisteredBufferPool(size)
            sides[name] = (keys, [pool.acquire() for _ in keys])
        times: dict[str, list[float]] = {"blocks": [], "chunks": []}
        for r in range(pairs + 2):
            for name in (("blocks", "chunks") if r % 2 else ("chunks", "blocks")):
                keys, bufs = sides[name]
                t0 = time.perf_counter()
                got = store.get_into(keys, bufs)
                took = time.perf_counter() - t0
                if not all(got):
                    raise RuntimeError(f"{name}: a value was not read back")
                if r >= 2:
                    times[name].append(took)
    finally:
        store.close()
        os.unlink(image)
    med = {name: statistics.median(t) for name, t in times.items()}
    return {"block": block, "chunk": chunk, "bytes": total, "pairs": pairs, "median_s": med,
            "chunks_faster": med["blocks"] / med["chunks"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.bench.block_units", description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default=None, help="where the image file goes (default: the bench directory)")
    p.add_argument("--block", type=parse_size, default=128 << 10)
    p.add_argument("--chunk", type=parse_size, default=1 << 20)
    p.add_argument("--bytes", type=parse_size, default=8 << 20)
    p.add_argument("--pairs", type=int, default=30)
    args = p.parse_args(argv)
    directory = args.dir or default_bench_dir()
    os.makedirs(directory, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        out = measure(tmp, args.block, args.chunk, args.bytes, args.pairs)
    mib = out["bytes"] / (1 << 20)
    b, c = out["median_s"]["blocks"], out["median_s"]["chunks"]
    print(f"{mib:g} MiB as values of {out['block']} bytes: {b * 1e3:.2f} ms ({mib / b:.0f} MiB/s); as values of "
          f"{out['chunk']} bytes: {c * 1e3:.2f} ms ({mib / c:.0f} MiB/s): chunks {out['chunks_faster']:.2f}x as fast "
          f"(medians of {out['pairs']} interleaved pairs)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
