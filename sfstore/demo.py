"""``sfstore demo``: what sfstore does, on the embedded default data directory, in a few seconds.

The probe's table and the routing of each data class, then: a round trip through the I/O engine (a file
written with O_DIRECT from registered buffers and fsynced, its pages dropped from the cache, read back in one
batch and verified, with the engine's counters and throughput); a dataset through ``sf://``; hot blocks put
into and got from the block store on its image file; a small model's checkpoint saved and loaded. Later issues
add the training and inference walk-through.
"""

from __future__ import annotations

import hashlib
import os
import time
from typing import Any

from sfstore import defaults
from sfstore.buffers import RegisteredBufferPool
from sfstore.engine import Request, get_engine, open_fd

__all__ = ["engine_round_trip", "dataset_through_sf", "checkpoint_round_trip", "hot_blocks", "kv_cache_reuse",
           "run_demo"]

MiB = 1 << 20


def engine_round_trip(data_dir: str | None = None, size: int = 64 * MiB, chunk: int = 4 * MiB) -> dict[str, Any]:
    """Write ``size`` bytes to ``<data_dir>/demo/roundtrip.bin`` and read them back through the engine.

    The write goes through registered buffers in ``chunk``-sized requests (O_DIRECT where the filesystem
    allows), is fsynced, its pages are dropped (``posix_fadvise(DONTNEED)``) so the read is cold, and the read
    lands in registered buffers. One extra misaligned read shows the bounce path. Returns what happened.
    """
    root = os.path.join(data_dir or defaults.get("data_dir"), "demo")
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, "roundtrip.bin")
    engine = get_engine()
    before = engine.stats()
    nchunks = max(1, size // chunk)
    size = nchunks * chunk
    with RegisteredBufferPool(chunk) as pool:
        bufs = [pool.acquire() for _ in range(nchunks)]
        digest_in = hashlib.blake2b()
        seed = os.urandom(chunk)
        for i, b in enumerate(bufs):
            mv = memoryview(b)
            mv[:] = seed
            mv[:8] = i.to_bytes(8, "little")  # every chunk differs, so a misplaced chunk is caught
            digest_in.update(mv)
            mv.release()
        fd, direct = open_fd(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
        try:
            t0 = time.perf_counter()
            engine.run([Request.write(fd, i * chunk, chunk, b) for i, b in enumerate(bufs)])
            os.fsync(fd)
            t_write = time.perf_counter() - t0
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            for b in bufs:
                memoryview(b)[:] = bytes(chunk)
            t0 = time.perf_counter()
            got = engine.run([Request.read(fd, i * chunk, chunk, b) for i, b in enumerate(bufs)])
            t_read = time.perf_counter() - t0
            digest_out = hashlib.blake2b()
            for b in bufs:
                mv = memoryview(b)
                digest_out.update(mv)
                mv.release()
            odd = bytearray(10_000)
            n_odd = engine.pread(fd, memoryview(odd)[3:], 12_345)  # misaligned: bounced on O_DIRECT
            odd_ok = bytes(odd[3 : 3 + n_odd]) == _expected(seed, chunk, 12_345, n_odd)
        finally:
            os.close(fd)
        for b in bufs:
            b.release()
        pool_stats = pool.stats()
    after = engine.stats()
    delta = {k: after[k] - before.get(k, 0) for k in after}
    return {
        "path": path,
        "engine": engine.name,
        "queue_depth": engine.queue_depth,
        "o_direct": direct,
        "bytes": size,
        "verified": digest_in.digest() == digest_out.digest() and sum(got) == size and odd_ok,
        "write_gib_s": size / t_write / (1 << 30),
        "read_gib_s": size / t_read / (1 << 30),
        "engine_counters": delta,
        "pool": pool_stats,
    }


def _expected(seed: bytes, chunk: int, offset: int, n: int) -> bytes:
    out = bytearray()
    pos = offset
    while len(out) < n:
        i, within = divmod(pos, chunk)
        block = i.to_bytes(8, "little") + seed[8:]
        take = min(n - len(out), chunk - within)
        out += block[within : within + take]
        pos += take
    return bytes(out)


def dataset_through_sf(data_dir: str | None = None, files: int = 256, file_size: int = 64 << 10) -> dict[str, Any]:
    """Generate a small sharded dataset under ``sf://demo-dataset/`` and read it back through fsspec.

    Writes ``files`` shards with ``fsspec`` (``pipe``), drops them from the page cache, then reads them all with
    one ``cat`` (pipelined opens, batched reads) and one shard through ``fsspec.open`` (buffered file with
    engine readahead). Returns what was moved and the file path's counters.
    """
    import fsspec

    from sfstore.fs import SFFileSystem

    root = data_dir or defaults.get("data_dir")
    fs = SFFileSystem(root=root)
    fs.file_path.counters.reset()
    seed = os.urandom(file_size)
    names = [f"demo-dataset/shard-{i:05d}.bin" for i in range(files)]
    fs.pipe({n: i.to_bytes(8, "little") + seed[8:] for i, n in enumerate(names)})
    for n in names:
        fd = os.open(fs.file_path.resolve(n), os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    t0 = time.perf_counter()
    got = fs.cat(names)
    assert isinstance(got, dict)
    t_cat = time.perf_counter() - t0
    ok = all(got[n] == i.to_bytes(8, "little") + seed[8:] for i, n in enumerate(names))
    with fsspec.open(f"sf://{names[-1]}", "rb", root=root) as f:
        ok = ok and f.read() == (files - 1).to_bytes(8, "little") + seed[8:]
    return {
        "files": files,
        "bytes": files * file_size,
        "cat_files_per_s": files / t_cat,
        "verified": ok,
        "path": fs.file_path.describe(),
    }


def checkpoint_round_trip(data_dir: str | None = None) -> dict[str, Any]:
    """Save a small model's checkpoint (model + optimizer + step) under ``<data_dir>/checkpoints/demo/``, load it
    back with checksums verified, and compare every tensor bit for bit. Needs torch."""
    import torch

    from sfstore import checkpoint

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 64))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, 256)).sum().backward()
    opt.step()
    weights, optim = model.state_dict(), opt.state_dict()
    state: dict[str, Any] = {"model": weights, "optimizer": optim, "step": 1}
    url = os.path.join(data_dir or defaults.get("data_dir"), "checkpoints", "demo", "step-1")
    t0 = time.perf_counter()
    info = checkpoint.save(state, url, overwrite=True, metadata={"step": 1})
    t_save = time.perf_counter() - t0
    t0 = time.perf_counter()
    back = checkpoint.load(url)
    t_load = time.perf_counter() - t0
    same = all(torch.equal(v, back["model"][k]) for k, v in weights.items())
    same = same and all(
        torch.equal(v, back["optimizer"]["state"][i][k]) for i, st in optim["state"].items() for k, v in st.items()
    )
    return {"path": info.path, "tensors": info.num_tensors, "bytes": info.tensor_bytes, "shards": info.num_shards,
            "save_s": t_save, "load_s": t_load, "verified": bool(same and back["step"] == 1)}


def hot_blocks(data_dir: str | None = None, blocks: int = 256, block_size: int = 64 << 10) -> dict[str, Any]:
    """Put ``blocks`` hot blocks into the block store on the embedded default (an image file under
    ``<data_dir>/hot/``) in batches, flush, read them back into a registered buffer, reopen the store and read
    them again: the index survives the restart."""
    from sfstore.blocks import BlockStore
    from sfstore.router import IMAGE_NAME

    image = os.path.join(data_dir or defaults.get("data_dir"), IMAGE_NAME)
    blobs = {f"block-{i:04d}": hashlib.shake_256(b"%d" % i).digest(block_size) for i in range(blocks)}
    keys = list(blobs)
    with BlockStore(image) as store:
        t0 = time.perf_counter()
        for first in range(0, blocks, 64):
            store.put_many({k: blobs[k] for k in keys[first:first + 64]})
        store.flush()
        t_put = time.perf_counter() - t0
        ok = True
        with RegisteredBufferPool(64 * block_size) as pool:
            buf = pool.acquire()
            try:
                view = memoryview(buf)
                t0 = time.perf_counter()
                for first in range(0, blocks, 64):
                    batch = keys[first:first + 64]
                    dests = [view[j * block_size:(j + 1) * block_size] for j in range(len(batch))]
                    got = store.get_into(batch, dests)
                    ok = ok and all(n == block_size and bytes(d) == blobs[k] for n, d, k in zip(got, dests, batch,
                                                                                                 strict=True))
                    del dests
                t_get = time.perf_counter() - t0
                del view
            finally:
                buf.release()
        desc = store.describe()
    with BlockStore(image) as again:
        recovered = again.recovered
        ok = ok and all(again.get(k) == blobs[k] for k in keys[:: max(1, blocks // 16)])
    mib = blocks * block_size / MiB
    return {"device": desc["device"], "transport": desc["transport"], "lba_size": desc["lba_size"],
            "capacity": desc["capacity"], "classes": desc["store"]["classes"], "fallbacks": desc["fallbacks"],
            "counters": desc["counters"], "put_mib_s": mib / t_put, "get_mib_s": mib / t_get,
            "blocks": blocks, "block_size": block_size, "recovered": recovered, "verified": ok}


def kv_cache_reuse(data_dir: str | None = None, prompt_tokens: int = 256) -> dict[str, Any]:
    """Serve three "requests" that share a prompt prefix through a :class:`~sfstore.kvcache.KVCacheStore` on the
    routed tiers: the first misses and offloads its KV blocks; the second finds them in pinned memory; after
    the pinned tier is emptied the third loads them from the block store (NVMe tier); a second store (another
    process or node) loads them from the shared directory. Every block read back is compared bit for bit."""
    import numpy as np

    import sfstore
    from sfstore.kvcache import KVCacheStore, KVGeometry

    geom = KVGeometry(num_layers=8, block_tokens=16, num_kv_heads=4, head_dim=64, dtype="bfloat16")  # 128 KiB
    router = sfstore.open({"root": data_dir} if data_dir else None)
    prefix = list(range(1000, 1000 + prompt_tokens))
    rng = np.random.default_rng(0)
    steps: list[dict[str, Any]] = []
    ok = True
    try:
        kv = KVCacheStore.from_router(geom, router, model_id="demo-model")
        with kv:
            for i, action in enumerate(("first request", "same prefix again", "pinned tier emptied first")):
                tokens = prefix + [7 + i] * 5  # a shared prefix and a question of its own
                if action == "pinned tier emptied first":
                    kv.evict(kv.keys_for(prefix), tiers=("pinned",))
                hit = kv.lookup(tokens)
                keys = kv.keys_for(tokens)
                out = [np.zeros(geom.block_bytes // 2, np.uint16) for _ in keys]
                tiers = kv.get_into(keys[: hit // geom.block_tokens], out[: hit // geom.block_tokens]) if hit else []
                if hit < len(keys) * geom.block_tokens:  # "compute" the missing blocks, then offload them
                    fresh = [rng.integers(0, 2**16, geom.block_bytes // 2, dtype=np.uint16)
                             for _ in keys[hit // geom.block_tokens:]]
                    kv.put(keys[hit // geom.block_tokens:], fresh)
                    expected = fresh
                steps.append({"request": action, "prompt_tokens": len(tokens), "hit_tokens": hit,
                              "tiers": sorted(set(t for t in tiers if t))})
            ok = ok and all(np.array_equal(a, b) for a, b in zip(out, expected, strict=False))
            stats = kv.stats()
        other = KVCacheStore(geom, model_id="demo-model", shared_dir=kv.shared.fp.root if kv.shared else None)
        with other:
            hit = other.lookup(prefix)
            out = [np.zeros(geom.block_bytes // 2, np.uint16) for _ in range(hit // geom.block_tokens)]
            tiers = other.get_into(other.keys_for(prefix)[: len(out)], out)
            ok = ok and all(np.array_equal(a, b) for a, b in zip(out, expected, strict=False))
            steps.append({"request": "another process, shared tier only", "prompt_tokens": len(prefix),
                          "hit_tokens": hit, "tiers": sorted(set(t for t in tiers if t))})
    finally:
        router.close()
    ok = ok and steps[0]["hit_tokens"] == 0 and all(st["hit_tokens"] == prompt_tokens for st in steps[1:])
    return {"block_bytes": geom.block_bytes, "steps": steps, "stats": stats, "verified": ok}


def run_demo(data_dir: str | None = None, size: int = 64 * MiB, show_probe: bool = True) -> int:
    """Print the probe table, the routing and every step with its counters; return 0 when all data verified.

    ``data_dir`` (default: the ``data_dir`` setting) is the embedded default data directory for the run.
    """
    if data_dir is not None:
        with defaults.set(data_dir=data_dir):
            return _run_demo(data_dir, size, show_probe)
    return _run_demo(None, size, show_probe)


def _run_demo(data_dir: str | None, size: int, show_probe: bool) -> int:
    from sfstore.probe import format_table, probe

    if show_probe:
        import sfstore

        print(format_table(probe(data_dir=data_dir)))
        print("routing")
        config = {"root": data_dir} if data_dir else None
        for line in sfstore.open(config).format().splitlines():
            print("    " + line)
        print()
    print(f"engine round trip: {size // MiB} MiB written from registered buffers, fsynced, dropped from the "
          "page cache, read back in one batch ...", flush=True)
    r = engine_round_trip(data_dir, size=size)
    c = r["engine_counters"]
    pool = r["pool"]
    print(f"  file           {r['path']} (O_DIRECT: {'yes' if r['o_direct'] else 'no, the filesystem refuses it'})")
    print(f"  engine         {r['engine']} (queue depth {r['queue_depth']})")
    print(f"  write          {r['write_gib_s']:.2f} GiB/s incl. fsync")
    print(f"  cold read      {r['read_gib_s']:.2f} GiB/s")
    print(f"  moved          {c['bytes_direct'] / MiB:.1f} MiB direct, {c['bytes_bounced']} bytes through bounce "
          "buffers (one deliberately misaligned read)")
    locked = "mlocked" if pool["locked_bytes"] else f"not mlocked ({pool['mlock_error']})"
    pages = ("hugetlbfs pages" if pool["hugetlb_buffers"] else
             "transparent huge pages advised" if pool["thp_buffers"] else "4 KiB pages")
    print(f"  buffers        {pool['allocated']} x {pool['buffer_size'] // MiB} MiB, {locked}, {pages}")
    print(f"  verified       {'yes' if r['verified'] else 'NO: the data read back differs'}")
    print()
    print("dataset through sf:// (fsspec): 256 shards of 64 KiB written with pipe(), dropped from the page cache, "
          "read back with one cat() ...", flush=True)
    d = dataset_through_sf(data_dir)
    p = d["path"]
    c = p["counters"]
    print(f"  root           {p['root']} (transport {p['transport']}, O_DIRECT {'on' if p['direct_io'] else 'off'})")
    print(f"  cat            {d['files']} files at {d['cat_files_per_s']:.0f} files/s")
    print(f"  counters       {c['files']} files, {c['requests']} requests, {c['bytes_read'] / MiB:.1f} MiB read, "
          f"{c['bytes_written'] / MiB:.1f} MiB written, {c['errors']} errors")
    for f in p["fallbacks"]:
        print(f"  fallback       {f}")
    print(f"  verified       {'yes' if d['verified'] else 'NO: the data read back differs'}")
    print()
    print("hot blocks (block path): 256 blocks of 64 KiB put in batches of 64, flushed, read back into a registered "
          "buffer, store reopened ...", flush=True)
    h = hot_blocks(data_dir)
    c = h["counters"]
    sizes = ", ".join(f"{x['size'] // 1024} KiB" for x in h["classes"])
    print(f"  device         {h['device']} (transport {h['transport']}, LBA {h['lba_size']} B, "
          f"{h['capacity'] / MiB:.0f} MiB, size classes {sizes})")
    print(f"  put / get      {h['put_mib_s']:.0f} MiB/s (incl. flush) / {h['get_mib_s']:.0f} MiB/s "
          "(checksums verified)")
    print(f"  moved          {c['bytes_direct'] / MiB:.1f} MiB direct, {c['bytes_bounced'] / MiB:.1f} MiB bounced")
    for f in h["fallbacks"]:
        print(f"  fallback       {f}")
    print(f"  reopened       index recovered from the {h['recovered']} written at close")
    print(f"  verified       {'yes' if h['verified'] else 'NO: the blocks read back differ'}")
    print()
    print("KV cache: requests sharing a 256-token prompt prefix, blocks of 16 tokens (128 KiB) offloaded to pinned "
          "memory, the block store and a shared directory ...", flush=True)
    k = kv_cache_reuse(data_dir)
    for st in k["steps"]:
        where = ", ".join(st["tiers"]) or "-"
        print(f"  {st['request']:<34} {st['hit_tokens']:>3} of {st['prompt_tokens']} tokens found (from: {where})")
    ks = k["stats"]
    print(f"  hits           pinned {ks['hits_pinned']}, block {ks['hits_block']}, shared {ks['hits_shared']}; "
          f"misses {ks['misses']}; {ks['bytes_put'] / MiB:.1f} MiB offloaded")
    print(f"  verified       {'yes' if k['verified'] else 'NO: the KV blocks read back differ'}")
    ok = r["verified"] and d["verified"] and h["verified"] and k["verified"]
    print()
    try:
        import torch  # noqa: F401
    except ImportError:
        print("checkpoint: skipped (torch is not installed: pip install 'sfstore[torch]')")
        return 0 if ok else 1
    print("checkpoint: a small model's state (model + AdamW state + step) saved, loaded, compared ...", flush=True)
    ck = checkpoint_round_trip(data_dir)
    print(f"  checkpoint     {ck['path']} ({ck['tensors']} tensors, {ck['bytes'] / MiB:.1f} MiB, "
          f"{ck['shards']} shard(s); safetensors + checksummed manifest)")
    print(f"  save / load    {ck['save_s'] * 1000:.0f} ms (staged, fsynced, renamed) / {ck['load_s'] * 1000:.0f} ms "
          "(checksums verified)")
    print(f"  verified       {'yes' if ck['verified'] else 'NO: the loaded state differs'}")
    return 0 if ok and ck["verified"] else 1
