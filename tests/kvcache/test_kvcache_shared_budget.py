"""The shared tier's byte budget with real processes on one directory: several writers keep it (within a block
per writer once they settle, exactly after gc), readers racing the evictors verify every byte they get, SIGKILL
of a writer and of an evictor between its rename and its unlink leaves nothing that gc does not repair,
namespaces isolate, a new process recounts from the files, and reads keep blocks in (LRU)."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sfstore import cli, errors, temp_names
from sfstore.kvcache.shared_budget import (
    EVICTING,
    META,
    SharedBudget,
    check_namespace,
    list_namespaces,
    namespace_prefix,
)
from sfstore.kvcache.tiers import SharedTier
from tests.forked_child import in_forked_child
from tests.kvcache import shared_workers as w

FILE = w.FILE_BYTES
files_in, leftovers = w.files_in, w.leftovers


def held(root: Path) -> int:
    return sum(f.stat().st_size for f in files_in(root))


def every_block_whole(root: Path) -> int:
    """Read back every block file there through a store; each must verify and be its block's bytes."""
    kv = w.open_store(str(root), 0)
    try:
        index = {w.key(kv, i): i for i in range(2000)}
        dest = np.zeros(w.GEOM.block_bytes, dtype=np.uint8)
        found = files_in(root)
        for f in found:
            k = w.key_in_name(f.name)
            assert kv.get_into([k], [dest]) == ["shared"], f
            assert np.array_equal(dest, w.block(index[k]))
        return len(found)
    finally:
        kv.close()


def start(target: Any, *args: Any) -> multiprocessing.process.BaseProcess:
    p = multiprocessing.get_context("spawn").Process(target=target, args=args)
    p.start()
    return p


def test_several_writers_keep_the_budget_and_readers_never_get_a_wrong_block(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    budget = 12 * FILE
    writers, per = 4, 60
    out = multiprocessing.get_context("spawn").Queue()
    procs = [start(w.writer, str(shared), budget, i * per, per, "", out) for i in range(writers)]
    procs += [start(w.reader, str(shared), writers * per, 6.0, seed, out) for seed in range(2)]
    results = [out.get(timeout=240) for _ in procs]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    readers = [r for r in results if r[0] == "reader"]
    assert sum(r[1] for r in readers) > 0, "the readers never found a block: the race was not run"
    assert all(r[3] == 0 for r in readers), f"a reader got a wrong or partial block: {readers}"
    # every file is published whole (renamed into place): a reader never finds one that fails verification
    assert all(r[4] == 0 for r in readers), f"a reader dropped a block as corrupt: {readers}"
    writers_done = [r for r in results if r[0] == "writer"]
    assert not any(r[3] for r in writers_done), f"writes were dropped: {writers_done}"
    assert sum(r[2] for r in writers_done) > 0  # the writers evicted, not only gc
    # settled (every writer closed): within one block per writer, from the writers' own enforcement
    settled = held(shared)
    assert 0 < settled <= budget + writers * FILE, (settled, budget, results)
    report = SharedBudget(SharedTier(w.GEOM, shared).fp, "", budget).gc()
    assert report["bytes_after"] == held(shared) <= budget
    assert not leftovers(shared)
    assert every_block_whole(shared) == held(shared) // FILE > 0, (settled, report)


def test_sigkill_of_writers_and_of_an_evictor_leaves_what_gc_repairs(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    budget = 8 * FILE
    for trial in range(4):  # writers that also evict, killed at any point
        p = start(w.endless_writer, str(shared), budget, trial * 400)
        deadline = time.time() + 60
        while time.time() < deadline and not list((shared / META / "writers").glob(f"*-{p.pid}-*.json")):
            time.sleep(0.01)  # until it wrote (its record comes before its first block)
        time.sleep(0.1 + 0.07 * trial)
        assert p.pid is not None
        os.kill(p.pid, signal.SIGKILL)
        p.join()
    # A writer killed between its own rename and unlink leaves one too: those are counted before the evictor runs.
    before = {f.name for f in leftovers(shared) if f.name.startswith(EVICTING)}
    p = start(w.killed_evictor, str(shared), budget, 1600, 200)
    p.join(120)
    assert p.exitcode == -signal.SIGKILL  # it died between the rename and the unlink
    stuck = [f for f in leftovers(shared) if f.name.startswith(EVICTING) and f.name not in before]
    assert len(stuck) == 1
    # what the dead evictor left is no block: its key misses cleanly, and the tier does not count it
    victim = stuck[0].name.rsplit("-", 1)[1]
    kv = w.open_store(str(shared), 0)
    try:
        dest = np.full(w.GEOM.block_bytes, 7, dtype=np.uint8)
        assert kv.get_into([w.key_in_name(victim)], [dest]) == [None] and (dest == 7).all()
        assert kv.stats()["resident"]["shared"] == len(files_in(shared))
    finally:
        kv.close()
    records = list((shared / META / "writers").glob("*.json"))
    assert len(records) == 5  # one per killed process
    every_block_whole(shared)  # before gc too: nothing partial is visible
    # and the budget still holds without gc: a writer started after the kills counts what they left (their
    # records, the files) and keeps the directory within a block of the budget once it settles
    out = multiprocessing.get_context("spawn").Queue()
    p = start(w.writer, str(shared), budget, 1800, 30, "", out)
    assert out.get(timeout=240)[0] == "writer"
    p.join(60)
    assert p.exitcode == 0 and held(shared) <= budget + FILE, (held(shared), budget)
    every_block_whole(shared)
    report = SharedBudget(SharedTier(w.GEOM, shared).fp, "", budget).gc()
    assert report["evicting_removed"] == 1 + len(before) and report["records_removed"] == 6  # with the writer's
    assert not leftovers(shared), leftovers(shared)  # the killed writers' temporary files are gone too
    assert held(shared) <= budget
    assert every_block_whole(shared) > 0
    assert SharedBudget(SharedTier(w.GEOM, shared).fp, "").du()["estimate"] == held(shared)


def test_namespaces_isolate(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    out = multiprocessing.get_context("spawn").Queue()
    keep = [start(w.writer, str(shared), 0, 0, 20, ns, out) for ns in ("", "b")]
    for p in keep:
        p.join(120)
        assert p.exitcode == 0
    flood = [start(w.writer, str(shared), 4 * FILE, 1000 + i * 50, 50, "a", out) for i in range(2)]
    for p in flood:
        p.join(120)
        assert p.exitcode == 0
    assert len(files_in(shared)) == 20  # the default namespace: untouched
    assert len(files_in(shared / "ns" / "b")) == 20
    assert 1 <= len(files_in(shared / "ns" / "a")) <= 4 + 2  # two evictors settling at once: not drained
    for ns in ("b", "a"):
        kv = w.open_store(str(shared), 0, ns)
        try:  # a namespace never reads another's blocks, the default's included
            dest = np.zeros(w.GEOM.block_bytes, dtype=np.uint8)
            assert kv.get_into([w.key(kv, 0)], [dest]) == (["shared"] if ns == "b" else [None])
            assert kv.stats()["resident"]["shared"] == len(files_in(shared / "ns" / ns))
        finally:
            kv.close()
    # gc of one namespace leaves the others alone; with no namespace named, each keeps its own budget
    SharedBudget(SharedTier(w.GEOM, shared, namespace="a").fp, "ns/a/", 0, namespace="a").gc(budget=FILE)
    assert len(files_in(shared / "ns" / "a")) == 1 and len(files_in(shared / "ns" / "b")) == 20
    fp = SharedTier(w.GEOM, shared).fp
    for ns in list_namespaces(fp):
        SharedBudget(fp, namespace_prefix(ns), 10 * FILE, namespace=ns).gc()
    assert [len(files_in(d)) for d in (shared, shared / "ns" / "a", shared / "ns" / "b")] == [10, 1, 10]
    for bad in ("../x", "a\n", ".hidden", "x" * 65, "a/b"):  # "a\n": a name must match whole, newline too
        with pytest.raises(errors.ConfigError):
            check_namespace(bad)
    assert check_namespace("tenant-1.a_b") == "tenant-1.a_b" and check_namespace("") == ""
    with pytest.raises(errors.ConfigError):
        w.open_store(str(shared), 0, ".sfkv")


def test_two_evictors_from_one_scan_free_the_excess_once(tmp_path: Path) -> None:
    """Two processes settling at once scan the same files and evict in the same LRU order: a block the other
    evicted first is freed all the same, so together they evict the excess once, not once each. The second
    evictor's estimate is held stale on purpose (a long ``refresh_s``: the other's record not yet read, as on
    an NFS client's caches)."""
    shared = tmp_path / "shared"
    kv = w.open_store(str(shared), 0)
    for i in range(8):
        kv.put([w.key(kv, i)], [w.block(i)])
    kv.close()
    fp = SharedTier(w.GEOM, shared).fp
    first = SharedBudget(fp, "", 4 * FILE)
    second = SharedBudget(fp, "", 4 * FILE, refresh_s=1e9)
    first.rescan()
    second.rescan()
    assert first.enforce() == 4 and len(files_in(shared)) == 4
    assert second.enforce() == 0  # its four oldest were gone: the budget already holds
    assert len(files_in(shared)) == 4 and second.evictions == 0


def test_a_new_process_recounts_from_the_files_and_torn_records_are_ignored(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    kv = w.open_store(str(shared), 0)  # unbounded: 20 blocks
    for i in range(20):
        kv.put([w.key(kv, i)], [w.block(i)])
    kv.close()
    for f in (shared / META).rglob("*"):  # the state is lost (or never existed: an older writer's directory)
        if f.is_file():
            f.unlink()
    (shared / META / "writers" / "torn.json").write_bytes(b'{"v": 1, "id": "x", "added": 99999')
    kv = w.open_store(str(shared), 6 * FILE)
    try:
        kv.put([w.key(kv, 100)], [w.block(100)])
        assert held(shared) <= 6 * FILE
        s = kv.stats()
        assert s["evictions_shared"] >= 15 and s["shared_bytes_held"] == held(shared)
        assert s["shared_budget_bytes"] == 6 * FILE and s["cache_namespace"] == ""
    finally:
        kv.close()


def test_recently_read_blocks_stay(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    tier_opts = {"touch_s": 0.0}
    from sfstore.kvcache.tiers import SharedTier as Tier

    kv = w.open_store(str(shared), 0)
    keys = [w.key(kv, i) for i in range(15)]
    for i in range(10):
        kv.put([keys[i]], [w.block(i)])
    assert kv.shared is not None
    kv.shared.close()
    kv.shared = Tier(w.GEOM, shared, budget_bytes=10 * FILE, budget_options=tier_opts, chunk_blocks=16,
                     chains=kv.chains)
    dest = np.zeros(w.GEOM.block_bytes, dtype=np.uint8)
    time.sleep(0.01)
    for i in range(5):  # read: their access times are newer than every other block's
        assert kv.get_into([keys[i]], [dest]) == ["shared"]
    time.sleep(0.01)
    for i in range(10, 15):
        kv.put([keys[i]], [w.block(i)])
    try:
        present = [kv.contains(k) for k in keys]
        assert present == [True] * 5 + [False] * 5 + [True] * 5
    finally:
        kv.close()


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_kv_gc_removes_killed_writers_temporaries_and_keeps_live_ones(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``sfstore kv gc`` removes the temporaries a killed writer of this host left (named as
    ``temp_names.temp_name`` names them) at once, well within the grace period; a live writer's (this process's),
    another host's recent ones and names sfstore does not write (a bare pid, no host) are left to the grace
    period."""
    shared = tmp_path / "shared"
    kv = w.open_store(str(shared), 0)
    for i in range(3):
        kv.put([w.key(kv, i)], [w.block(i)])
    kv.close()
    block = files_in(shared)[0]
    dead, host = _dead_pid(), temp_names.host()
    planted: dict[Path, tuple[list[str], list[str]]] = {  # directory: (removed, kept)
        block.parent: ([f".{block.name}.sfstore-tmp-{host}-{dead}-0123456789ab"],
                       [temp_names.temp_name(block.name, "tmp"), f".{block.name}.sfstore-tmp-{dead}-0123456789ab",
                        f".{block.name}.sfstore-tmp-another_host-{dead}-0123456789ab"]),
        shared / META / "writers": ([f".w.json.sfstore-tmp-{host}-{dead}-0123456789ab"],
                                    [temp_names.temp_name("w.json", "tmp"), f".w.json.tmp-{dead}-ab12",
                                     f".w.json.sfstore-tmp-another_host-{dead}-0123456789ab"]),
        shared / META: ([f".base.json.sfstore-tmp-{host}-{dead}-0123456789ab"],
                        [temp_names.temp_name("base.json", "tmp"), f".base.json.tmp-{dead}-ab12"]),
    }
    (shared / META / "quarantine").mkdir(exist_ok=True)
    planted[shared / META / "quarantine"] = ([f".q.json.sfstore-tmp-{host}-{dead}-0123456789ab"],
                                             [temp_names.temp_name("q.json", "tmp"), f".q.json.tmp-{dead}-ab12"])
    before = {d: set(os.listdir(d)) for d in planted}
    for d, (gone, kept) in planted.items():
        for name in gone + kept:
            (d / name).write_bytes(b"{")
    assert cli.main(["kv", "gc", str(shared), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    for d, (_gone, kept) in planted.items():
        assert {n for n in os.listdir(d) if n.startswith(".")} - before[d] == set(kept), d
    (ns,) = report  # the default namespace's; the writers' directory's temporaries count as its records
    assert (ns["temporaries_removed"], ns["records_removed"]) == (2, 1), ns
    assert every_block_whole(shared) == 3


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_is_another_writer(tmp_path: Path) -> None:
    """In a real ``os.fork()`` child (forked while the parent's budget holds its locks, as a thread of it may)
    the budget is another writer's: a record of its own name and pid, nothing counted of the parent's, and no
    wait for the parent's locks (an alarm kills a child that deadlocks); the parent keeps its identity."""
    shared = tmp_path / "shared"
    b = SharedBudget(SharedTier(w.GEOM, shared).fp, "", 0)
    b.register()
    b.added_bytes(100)
    b.flush(force=True)
    parent = (b.id, b.pid)
    def check() -> dict[str, Any]:
        b.register()
        b.added_bytes(7)
        b.flush(force=True)
        recs = {x.id: (x.pid, x.added) for x in b.read_records()}
        return {"id": b.id, "pid": b.pid, "me": os.getpid(), "recs": recs}

    with b._lock, b._enforcing:  # forked while the parent's budget holds its locks
        out = in_forked_child(check)
    assert out["pid"] == out["me"] and out["id"] != parent[0] and f"-{out['me']}-" in out["id"]
    assert out["recs"] == {parent[0]: [parent[1], 100], out["id"]: [out["me"], 7]}
    assert (b.id, b.pid) == parent
