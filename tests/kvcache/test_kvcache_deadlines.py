"""Deadlines and quarantine of the KV cache's lower tiers, against a stall simulated on the host.

The stall (:func:`tests.kvcache.stalls.simulated_stall`) makes every open beneath the tier's directory first wait
on a FIFO no one writes, in the kernel, as a thread in a hard NFS mount whose server is gone does; ending it lets
every waiting thread through. The block tier's stall waits on such a FIFO inside the block store's read or write.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sfstore import cli, defaults, probe, quarantine_records
from sfstore.blocks import BlockStore
from sfstore.kvcache import KVCacheStore
from sfstore.kvcache.deadline import QuarantineRecorder, TierGuard
from sfstore.kvcache.shared_budget import META
from tests.forked_child import in_forked_child
from tests.kvcache import shared_workers as w
from tests.kvcache.stalls import Stall, simulated_stall

REPO = Path(__file__).resolve().parents[2]

DEADLINE_MS = 100
SLACK_S = 0.050  # the acceptance bound: a miss within the deadline + 50 ms
# long enough that the tier is still quarantined when the test looks, with the record's writer thread (which
# runs at that moment) holding the GIL for a while and other processes on the 2 cores: a back-off that ended
# before the test's next get makes that get a probe into the stall (another deadline miss), not a quarantine skip
BACKOFF_MS = 60


@pytest.fixture(autouse=True)
def _state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This test's own data directory: the quarantine records its processes leave go there."""
    data = tmp_path / "data"
    monkeypatch.setenv("SFSTORE_DATA_DIR", str(data))
    return data


def wait_for(cond: Callable[[], bool], seconds: float = 10.0) -> None:
    end = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.002)


def end_stall(stall: Stall, guard: TierGuard) -> None:
    """The server is back: end ``stall`` and wait until every worker it held has returned."""
    stall.end()
    wait_for(lambda: guard.describe()["abandoned_now"] == 0)


def store(tmp_path: Path, **kwargs: Any) -> KVCacheStore:
    kwargs.setdefault("pinned_bytes", 0)
    kwargs.setdefault("quarantine_ms", 1)
    return KVCacheStore(w.GEOM, model_id="deadline-test", shared_dir=tmp_path / "shared", io_timeout_ms=DEADLINE_MS,
                        **kwargs)


def two_shared_blocks(kv: KVCacheStore) -> tuple[list[bytes], TierGuard]:
    """Blocks 0 and 1 put in ``kv``'s shared tier: their keys, and the tier's guard."""
    assert kv.shared is not None
    keys = [w.key(kv, i) for i in range(2)]
    kv.put(keys, [w.block(0), w.block(1)])
    return keys, kv.shared.guard


def test_a_stalled_shared_tier_misses_within_the_deadline_and_recovers(tmp_path: Path) -> None:
    with store(tmp_path, quarantine_ms=BACKOFF_MS) as kv:
        keys, guard = two_shared_blocks(kv)
        dest = np.full(w.GEOM.block_bytes, 7, dtype=np.uint8)
        late: list[float] = []
        slow_probes = 0  # recovery probes that missed the deadline on a loaded machine, with no stall
        for trial in range(100):
            with simulated_stall(kv.shared, "_open", tmp_path) as stall:
                t0 = time.monotonic()
                got = kv.get_into([keys[0]], [dest])
                took = time.monotonic() - t0
                late.append(took)
                assert got == [None] and (dest == 7).all(), trial  # a miss; the destination as it was
                assert guard.quarantined() and kv.stats()["quarantine"]["shared"]["quarantined"]
                assert kv.get_into([keys[1]], [dest]) == [None]  # quarantined: answered at once
                end_stall(stall, guard)  # its late read is discarded
            while True:
                time.sleep(BACKOFF_MS / 1000 + 0.002)  # past the back-off: the next get probes the tier
                got = kv.get_into([keys[trial % 2]], [dest])
                if got == ["shared"]:
                    break
                # the server is back, but the probe's open and read took longer than the deadline (other work on
                # the 2 cores): quarantined again, as it should be; the next probe after the back-off recovers
                assert got == [None] and (dest == 7).all() and guard.quarantined(), trial
                slow_probes += 1
                assert slow_probes <= 20, "the tier never recovered"
                wait_for(lambda: guard.describe()["abandoned_now"] == 0)
            assert np.array_equal(dest, w.block(trial % 2)) and not guard.quarantined()
            dest[:] = 7
        assert max(late) <= DEADLINE_MS / 1000 + SLACK_S, sorted(late)[-5:]
        q = kv.stats()["quarantine"]["shared"]
        assert q["deadline_misses"] == 100 + slow_probes and q["recoveries"] == 100
        assert q["late_returns"] == 100 + slow_probes
        assert kv.stats()["deadline_misses"] == 100 + slow_probes and kv.stats()["misses"] >= 200
        assert guard.recorder is not None and guard.recorder.flush(10.0)
        assert not list(Path(quarantine_records.quarantine_dir()).glob("*.json"))  # each recovery withdrew its record


def test_abandoned_workers_are_bounded_and_the_tier_says_so(tmp_path: Path) -> None:
    with store(tmp_path) as kv:
        assert kv.shared is not None
        key = w.key(kv, 0)
        kv.put([key], [w.block(0)])
        guard = kv.shared.guard
        dest = np.zeros(w.GEOM.block_bytes, dtype=np.uint8)
        with simulated_stall(kv.shared, "_open", tmp_path) as stall:
            for _ in range(guard.max_abandoned):
                wait_for(lambda: not guard.quarantined(), 5.0)  # each probe abandons one more worker
                t0 = time.monotonic()
                assert kv.get_into([key], [dest]) == [None]
                assert time.monotonic() - t0 <= DEADLINE_MS / 1000 + SLACK_S
            d = kv.describe()["quarantine"]["shared"]
            assert d["abandoned_now"] == guard.max_abandoned and d["quarantined"]
            assert "stuck" in d["reason"]
            time.sleep(0.2)  # far past any back-off: still quarantined, no more workers risked
            t0 = time.monotonic()
            assert kv.get_into([key], [dest]) == [None] and time.monotonic() - t0 < 0.02
            assert kv.stats()["quarantine"]["shared"]["abandoned_now"] == guard.max_abandoned
            assert not kv.contains(key) and kv.stats()["resident"]["shared"] is None
            end_stall(stall, guard)
        wait_for(lambda: kv.get_into([key], [dest]) == ["shared"])
        assert np.array_equal(dest, w.block(0)) and kv.contains(key)


def test_a_put_past_its_deadline_is_dropped_and_never_published_late(tmp_path: Path) -> None:
    with store(tmp_path) as kv:
        assert kv.shared is not None
        key = w.key(kv, 5)
        guard = kv.shared.guard
        with simulated_stall(kv.shared, "_open", tmp_path) as stall:
            t0 = time.monotonic()
            kv.put([key], [w.block(5)])
            assert time.monotonic() - t0 <= DEADLINE_MS / 1000 + SLACK_S
            assert kv.stats()["puts_dropped"] == 1
            kv.put([w.key(kv, 6)], [w.block(6)])  # quarantined: dropped at once
            assert kv.stats()["puts_dropped"] == 2
            end_stall(stall, guard)
        assert not list((tmp_path / "shared").rglob("*.kv[bc]"))  # the late write saw it was abandoned
        assert not [f for f in (tmp_path / "shared").rglob("*") if f.is_file() and "tmp" in f.name]
        time.sleep(0.01)
        kv.put([key], [w.block(5)])
        assert kv.contains(key) and kv.stats()["puts_dropped"] == 2


def test_a_stalled_read_into_a_pinned_slot_never_lands_in_a_reused_slot(tmp_path: Path) -> None:
    writer = store(tmp_path)
    keys = [w.key(writer, i) for i in range(40)]
    writer.put(keys[:1], [w.block(0)])
    writer.close()
    with store(tmp_path, pinned_bytes=4 * (w.GEOM.block_bytes + 4096)) as kv:
        assert kv.shared is not None
        guard = kv.shared.guard
        dest = np.zeros(w.GEOM.block_bytes, dtype=np.uint8)
        with simulated_stall(kv.shared, "_open", tmp_path) as stall:
            assert kv.get_into(keys[:1], [dest]) == [None]  # its slot is the stuck worker's
            for i in range(1, 40):  # churn the pinned tier: every free slot is reused
                kv.put([keys[i]], [w.block(i)])
            end_stall(stall, guard)
            kv.wait_for_puts()
        resident = [keys.index(k) for k in list(kv.pinned.entries)]
        assert len(resident) == kv.pinned.capacity and 0 not in resident
        for i in resident:  # each resident block is its own bytes, never block 0's late read
            assert kv.get_into([keys[i]], [dest]) == ["pinned"]
            assert np.array_equal(dest, w.block(i)), i


def test_a_stalled_block_store_misses_within_the_deadline(tmp_path: Path) -> None:
    bs = BlockStore({"kind": "image", "path": str(tmp_path / "hot.img"), "size": 16 << 20},
                    size_classes=(w.GEOM.block_bytes,))
    kv = KVCacheStore(w.GEOM, model_id="deadline-test", pinned_bytes=0, block_store=bs, io_timeout_ms=DEADLINE_MS,
                      quarantine_ms=1)
    try:
        keys = [w.key(kv, i) for i in range(3)]
        kv.put(keys[:2], [w.block(0), w.block(1)])
        dest = np.full(w.GEOM.block_bytes, 7, dtype=np.uint8)
        guard = kv.block_tier.guard
        with simulated_stall(bs, "_read_entries", tmp_path) as stall:
            for keep in (True, False):
                wait_for(lambda: not guard.quarantined(), 5.0)
                t0 = time.monotonic()
                assert kv.get_into(keys[:1], [dest], keep_on_miss=keep) == [None]
                assert time.monotonic() - t0 <= DEADLINE_MS / 1000 + SLACK_S
                assert (dest == 7).all()
            end_stall(stall, guard)
            time.sleep(0.05)
            assert (dest == 7).all()  # the late reads landed in staging buffers, never in the caller's memory
        with simulated_stall(bs, "_write_slots", tmp_path) as stall:
            wait_for(lambda: not guard.quarantined(), 5.0)
            t0 = time.monotonic()
            kv.put(keys[2:], [w.block(2)])
            assert time.monotonic() - t0 <= DEADLINE_MS / 1000 + SLACK_S
            assert kv.stats()["puts_dropped"] == 1 and kv.stats()["quarantine"]["block"]["quarantined"]
            end_stall(stall, guard)
        wait_for(lambda: kv.get_into(keys[:1], [dest]) == ["block"])
        assert np.array_equal(dest, w.block(0))
        assert kv.stats()["quarantine"]["block"]["deadline_misses"] == 3
    finally:
        kv.close()
        bs.close()


def test_a_large_batch_meets_the_block_stores_deadline_16_blocks_a_call(tmp_path: Path) -> None:
    # One deadline per call of 16 blocks, not one for the whole batch: a put of a prompt's hundreds of blocks is
    # not all dropped because their sum takes longer than the deadline
    n = 40
    bs = BlockStore({"kind": "image", "path": str(tmp_path / "hot.img"), "size": (n + 8) * (w.GEOM.block_bytes + 8192)
                     + (8 << 20)}, size_classes=(w.GEOM.block_bytes,))
    kv = KVCacheStore(w.GEOM, model_id="deadline-test", pinned_bytes=(n + 2) * (w.GEOM.block_bytes + 8192),
                      block_store=bs, io_timeout_ms=60_000)
    try:
        keys = [w.key(kv, i) for i in range(n)]
        calls = kv.block_tier.guard.counters.snapshot
        before = calls()["calls"]
        kv.put(keys, [w.block(i) for i in range(n)])
        kv.wait_for_puts()
        assert calls()["calls"] - before == 3  # 16 + 16 + 8
        assert kv.evict(keys, tiers=("pinned",)) == n
        dests = [np.zeros(w.GEOM.block_bytes, dtype=np.uint8) for _ in range(n)]
        before = calls()["calls"]
        assert kv.get_into(keys, dests) == ["block"] * n
        assert calls()["calls"] - before == 3
        assert all(np.array_equal(d, w.block(i)) for i, d in enumerate(dests))
    finally:
        kv.close()
        bs.close()


def test_the_guard_backs_off_exponentially_and_runs_inline_without_a_deadline() -> None:
    inline = TierGuard("t", 0, 1)
    assert inline.run(threading.get_ident) == ("ok", threading.get_ident())  # the caller's own thread
    g = TierGuard("t", 0.02, 0.01, workers=1, max_abandoned=4)
    release = threading.Event()
    try:
        backoffs = []
        for _ in range(3):
            wait_for(lambda: not g.quarantined(), 5.0)
            assert g.run(release.wait) == ("timeout", None)
            backoffs.append(g.describe()["backoff_ms"])
        assert backoffs == [10, 20, 40]
        with pytest.raises(ZeroDivisionError):  # an error in time is the caller's (and lifts the quarantine)
            wait_for(lambda: not g.quarantined(), 5.0)
            g.run(lambda: 1 // 0)
        assert not g.quarantined() and g.describe()["backoff_ms"] == 0
    finally:
        release.set()
        g.close()


# -- the quarantine as other processes see it --------------------------------------------------------------------


def _record_shared_tier(kv: KVCacheStore) -> None:
    """Record the shared tier's quarantine in its directory too, as :class:`SharedTier` is to wire it."""
    assert kv.shared is not None
    kv.shared.guard.record_to(QuarantineRecorder.for_shared(kv.shared.budget))


def quarantined_worker(shared: str, stall_dir: str, backoff_ms: int, conn: Any) -> None:
    """A process whose shared tier stalls: it gets a miss, is quarantined, says so and waits; told to, it ends
    the stall, probes the tier back once the back-off is over, says so, and closes."""
    kv = KVCacheStore(w.GEOM, model_id="deadline-test", pinned_bytes=0, shared_dir=shared,
                      io_timeout_ms=DEADLINE_MS, quarantine_ms=backoff_ms)
    assert kv.shared is not None
    _record_shared_tier(kv)
    guard = kv.shared.guard
    assert guard.recorder is not None
    key = w.key(kv, 0)
    kv.put([key], [w.block(0)])
    dest = np.zeros(w.GEOM.block_bytes, dtype=np.uint8)
    with simulated_stall(kv.shared, "_open", Path(stall_dir)) as stall:
        t0 = time.monotonic()
        got = kv.get_into([key], [dest])
        took = time.monotonic() - t0
        guard.recorder.flush(10.0)
        conn.send(("quarantined", got, took, guard.describe()))
        conn.recv()  # "recover"
        end_stall(stall, guard)
    wait_for(lambda: kv.get_into([key], [dest]) == ["shared"], 30.0)
    guard.recorder.flush(10.0)
    conn.send(("recovered", guard.describe()))
    conn.recv()  # "close"
    kv.close()


def _start_quarantined(tmp_path: Path, backoff_ms: int) -> tuple[multiprocessing.process.BaseProcess, Any, tuple]:
    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    p = ctx.Process(target=quarantined_worker, args=(str(tmp_path / "shared"), str(tmp_path), backoff_ms, there))
    p.start()
    assert here.poll(120), "the worker did not report"
    msg = here.recv()
    assert msg[0] == "quarantined" and msg[1] == [None], msg
    assert msg[2] <= DEADLINE_MS / 1000 + SLACK_S, msg[2]
    return p, here, msg


def _du(shared: Path, capsys: pytest.CaptureFixture[str]) -> list[dict[str, Any]]:
    capsys.readouterr()
    assert cli.main(["kv", "du", str(shared), "--json"]) == 0
    rows: list[dict[str, Any]] = json.loads(capsys.readouterr().out)
    return rows[0]["quarantined"]


def test_the_probe_and_kv_du_report_a_quarantine_until_it_is_lifted(tmp_path: Path, _state_dir: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    shared = tmp_path / "shared"
    p, conn, (_, _, _, seen) = _start_quarantined(tmp_path, backoff_ms=2000)
    try:
        assert seen["quarantined"] and seen["since"] is not None and "deadline" in seen["reason"]
        # another process: `sfstore probe` as a user runs it
        env = {**os.environ, "SFSTORE_DATA_DIR": str(_state_dir), "PYTHONPATH": str(REPO)}
        done = subprocess.run([sys.executable, "-m", "sfstore.cli", "probe", "--json"], capture_output=True,
                              text=True, env=env, cwd=REPO, timeout=120, check=False)
        assert done.returncode == 0, done.stderr
        (rec,) = json.loads(done.stdout)["kvcache"]["quarantined"]
        assert (rec["host"], rec["pid"], rec["tier"]) == (quarantine_records.host_name(), p.pid, "shared")
        assert rec["target"] == str(shared) and rec["deadline_ms"] == DEADLINE_MS and "deadline" in rec["reason"]
        assert rec["since"] <= time.time() < rec["until"] <= rec["since"] + 2.5
        table = subprocess.run([sys.executable, "-m", "sfstore.cli", "probe"], capture_output=True, text=True,
                               env=env, cwd=REPO, timeout=120, check=False).stdout
        assert "quarantined  1 tier(s)" in table and f" {p.pid} " in table
        # `sfstore kv du` of the directory: the record in it (and this host's) names the same quarantine
        (in_dir,) = list((shared / META / "quarantine").glob("*.json"))
        assert in_dir.stem == rec["name"]
        (q,) = _du(shared, capsys)
        assert (q["pid"], q["until"]) == (p.pid, rec["until"])
        assert cli.main(["kv", "du", str(shared)]) == 0
        assert "quarantined by processes" in capsys.readouterr().out
        conn.send("recover")
        assert conn.poll(60) and conn.recv()[0] == "recovered"
        # lifted: both records are gone, and neither command reports it
        assert probe.probe_kvcache()["quarantined"] == [] and _du(shared, capsys) == []
        assert not list((shared / META / "quarantine").glob("*.json"))
        assert not list(Path(quarantine_records.quarantine_dir()).glob("*.json"))
        conn.send("close")
        p.join(60)
        assert p.exitcode == 0
    finally:
        if p.is_alive():
            p.kill()
            p.join()


def test_a_quarantine_killed_with_its_process_is_ignored_and_cleaned(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    shared = tmp_path / "shared"
    p, _conn, _ = _start_quarantined(tmp_path, backoff_ms=60_000)  # in force for a minute, were it alive
    (rec,) = probe.probe_kvcache()["quarantined"]
    assert rec["pid"] == p.pid and rec["until"] > time.time() + 30
    assert p.pid is not None
    os.kill(p.pid, signal.SIGKILL)
    p.join()
    # its records outlive it, but a dead process's quarantine holds no more: ignored, then removed
    assert len(list(Path(quarantine_records.quarantine_dir()).glob("*.json"))) == 1
    assert _du(shared, capsys) == []
    assert probe.probe_kvcache()["quarantined"] == []
    assert not list(Path(quarantine_records.quarantine_dir()).glob("*.json"))  # the probe cleaned this host's
    assert len(list((shared / META / "quarantine").glob("*.json"))) == 1
    assert cli.main(["kv", "gc", str(shared), "--json"]) == 0  # gc cleans the directory's
    assert json.loads(capsys.readouterr().out)[0]["quarantined"] == []
    assert not list((shared / META / "quarantine").glob("*.json"))


def test_another_nodes_quarantine_holds_until_its_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A record from another host (its pid cannot be checked from here) is in force until its ``until``."""
    shared = tmp_path / "shared"
    kv = w.open_store(str(shared), 0)
    kv.put([w.key(kv, 0)], [w.block(0)])
    assert kv.shared is not None
    budget = kv.shared.budget
    kv.close()
    now = time.time()
    base = {"host": "node-b", "pid": 4242, "tier": "shared", "target": "/mnt/kv", "namespace": "",
            "reason": "a read missed its deadline", "abandoned": 1, "deadline_ms": 500, "written": now}
    budget.write_quarantine("node-b-4242-shared-1", {**base, "since": now - 5, "until": now + 30})
    budget.write_quarantine("node-b-4243-shared-1", {**base, "pid": 4243, "since": now - 90, "until": now - 1})
    (d := shared / META / "quarantine").joinpath("torn.json").write_bytes(b'{"v": 1, "host": "x"')
    (q,) = _du(shared, capsys)
    assert (q["host"], q["pid"]) == ("node-b", 4242)
    assert cli.main(["kv", "gc", str(shared)]) == 0
    assert sorted(f.name for f in d.iterdir()) == ["node-b-4242-shared-1.json", "torn.json"]  # torn: not yet a
    # minute old (a writer may be mid-write); the ended record is gone


def test_the_record_never_waits_for_the_stalled_mount(tmp_path: Path) -> None:
    """The shared directory's record is written into the stalled mount: its thread waits there, the caller does
    not, and this host's record (which the probe reads) is written meanwhile."""
    with store(tmp_path, quarantine_ms=5000) as kv:
        assert kv.shared is not None
        _record_shared_tier(kv)
        key = w.key(kv, 0)
        kv.put([key], [w.block(0)])
        dest = np.zeros(w.GEOM.block_bytes, dtype=np.uint8)
        with simulated_stall(kv.shared, "_open", tmp_path) as stall, \
                simulated_stall(kv.shared.budget, "write_quarantine", tmp_path) as record_stall:
            t0 = time.monotonic()
            assert kv.get_into([key], [dest]) == [None]
            assert time.monotonic() - t0 <= DEADLINE_MS / 1000 + SLACK_S
            wait_for(lambda: len(probe.probe_kvcache()["quarantined"]) == 1)
            assert not (tmp_path / "shared" / META / "quarantine").exists()  # its writer is stuck
            t0 = time.monotonic()
            for _ in range(20):  # quarantined: answered at once, the stuck record writer or not
                assert kv.get_into([key], [dest]) == [None]
            assert time.monotonic() - t0 <= DEADLINE_MS / 1000 + SLACK_S  # (the writer's wait is endless)
            record_stall.end()
            stall.end()
            wait_for(lambda: len(list((tmp_path / "shared" / META / "quarantine").glob("*.json"))) == 1)
    wait_for(lambda: not list(Path(quarantine_records.quarantine_dir()).glob("*.json")))  # closed: withdrawn


# -- the default deadline ----------------------------------------------------------------------------------------


def test_the_default_deadline_is_on_and_zero_still_means_none(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    assert defaults.SETTINGS["kvcache_io_timeout_ms"].default == 500
    kv = KVCacheStore(w.GEOM, model_id="deadline-test", pinned_bytes=0, shared_dir=tmp_path / "s1")
    try:
        assert kv.shared is not None and kv.shared.guard.timeout_s == 0.5
        assert kv.stats()["quarantine"]["shared"]["timeout_ms"] == 500
        thread = kv.shared.guard.run(threading.get_ident)[1]
        assert thread != threading.get_ident()  # the tier's own worker: the caller can stop waiting
    finally:
        kv.close()

    def inline(kv: KVCacheStore) -> bool:
        assert kv.shared is not None
        try:
            return not kv.shared.guard.enabled and kv.shared.guard.run(threading.get_ident)[1] == threading.get_ident()
        finally:
            kv.close()

    assert inline(KVCacheStore(w.GEOM, model_id="d", pinned_bytes=0, shared_dir=tmp_path / "s2", io_timeout_ms=0))
    with defaults.set(kvcache_io_timeout_ms=0):
        assert inline(KVCacheStore(w.GEOM, model_id="d", pinned_bytes=0, shared_dir=tmp_path / "s3"))
    monkeypatch.setenv("SFSTORE_KVCACHE_IO_TIMEOUT_MS", "0")
    assert inline(KVCacheStore(w.GEOM, model_id="d", pinned_bytes=0, shared_dir=tmp_path / "s4"))


def test_the_record_follows_the_quarantine_stuck_workers_back_off_and_recovery(tmp_path: Path) -> None:
    where = str(tmp_path / "records")
    rec = QuarantineRecorder("t", target="/dev/x", state_dir=where)
    g = TierGuard("t", 0.02, 0.3, workers=1, max_abandoned=1, recorder=rec)
    release = threading.Event()

    def records() -> list[dict[str, Any]]:
        assert rec.flush(10.0)
        return quarantine_records.read_quarantine_records(where)

    try:
        t0 = time.time()
        assert g.run(release.wait) == ("timeout", None)
        (r,) = records()  # the worker is stuck, at the bound: open-ended, so the longest back-off, renewed
        assert (r["tier"], r["target"], r["abandoned"], r["pid"]) == ("t", "/dev/x", 1, os.getpid())
        assert "stuck" in r["reason"] and r["until"] >= t0 + 0.3 * 64 - 1 and r["since"] >= t0 - 1
        release.set()  # the I/O returns: what is left is the back-off of the miss
        wait_for(lambda: g.describe()["abandoned_now"] == 0)
        wait_for(lambda: [x["abandoned"] for x in records()] == [0])
        (r2,) = records()
        assert r2["until"] <= t0 + 0.3 + 1 and r2["since"] == r["since"] and "missed its deadline" in r2["reason"]
        wait_for(lambda: not g.quarantined())
        assert g.run(lambda: 1) == ("ok", 1)  # the probe: lifted, and the record with it
        assert records() == [] and not os.listdir(where)
        assert g.describe()["since"] is None
    finally:
        release.set()
        g.close()


def test_a_slow_listing_is_bounded_but_never_quarantines_the_tier(tmp_path: Path) -> None:
    """stats() counts the shared tier's blocks by listing its directory, which takes longer as it grows, not as
    the mount sickens: past the deadline the count is unknown (None), and gets and puts go on."""
    with store(tmp_path, quarantine_ms=10_000) as kv:  # a quarantine would last the whole test
        keys, guard = two_shared_blocks(kv)
        with simulated_stall(kv.shared, "_count", tmp_path) as stall:
            t0 = time.monotonic()
            assert kv.stats()["resident"]["shared"] is None
            assert time.monotonic() - t0 <= DEADLINE_MS / 1000 + SLACK_S
            assert not guard.quarantined() and guard.counters.snapshot()["slow_unjudged"] == 1
            assert guard.counters.snapshot()["deadline_misses"] == 0
            dest = np.zeros(w.GEOM.block_bytes, dtype=np.uint8)
            assert kv.get_into([keys[1]], [dest]) == ["shared"] and np.array_equal(dest, w.block(1))
            end_stall(stall, guard)
        assert kv.stats()["resident"]["shared"] == 2


def test_a_listing_never_probes_a_quarantined_tier(tmp_path: Path) -> None:
    with store(tmp_path, quarantine_ms=BACKOFF_MS) as kv:
        keys, guard = two_shared_blocks(kv)
        dest = np.zeros(w.GEOM.block_bytes, dtype=np.uint8)
        with simulated_stall(kv.shared, "_open", tmp_path) as stall:
            assert kv.get_into([keys[0]], [dest]) == [None] and guard.quarantined()
            end_stall(stall, guard)
        time.sleep(BACKOFF_MS / 1000 + 0.005)  # the back-off is over: the next judging call probes
        probes = guard.counters.snapshot()["probes"]
        assert kv.stats()["resident"]["shared"] is None  # the listing waits for a probe, as every call does
        assert guard.counters.snapshot()["probes"] == probes
        assert kv.get_into([keys[0]], [dest]) == ["shared"] and not guard.quarantined()  # this get probed
        assert kv.stats()["resident"]["shared"] == 2


def test_a_lookup_asks_the_shared_tier_once_for_its_whole_prefix(tmp_path: Path) -> None:
    """One operation under the deadline (one handoff to the tier's workers) for every block only the shared
    tier may hold, instead of one per block; the answer is the same."""
    with store(tmp_path, pinned_bytes=2 * w.GEOM.block_bytes) as kv:
        assert kv.shared is not None
        tokens = list(range(w.GEOM.block_tokens * 10 + 3))
        keys = kv.keys_for(tokens)
        kv.put(keys[:7], [w.block(i) for i in range(7)])
        kv.wait_for_puts()
        guard = kv.shared.guard
        calls = guard.counters.snapshot()["calls"]
        assert kv.lookup(tokens) == 7 * w.GEOM.block_tokens
        assert guard.counters.snapshot()["calls"] == calls + 1
        assert kv.lookup(tokens[: w.GEOM.block_tokens * 3]) == 3 * w.GEOM.block_tokens
        kv.close()
        kv = store(tmp_path, pinned_bytes=2 * w.GEOM.block_bytes)  # nothing pinned: all from the shared tier
        assert kv.lookup(tokens) == 7 * w.GEOM.block_tokens
        # the directory's descriptor stalls, as on a stalled mount: for the batched lookup (one native call for
        # every name) and the one key by key alike. Past the deadline: nothing found
        with simulated_stall(kv.shared, "_dir", tmp_path) as stall:
            t0 = time.monotonic()
            assert kv.lookup(tokens) == 0
            assert time.monotonic() - t0 <= DEADLINE_MS / 1000 + SLACK_S
            stall.end()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_guards_and_records_its_own_quarantine(tmp_path: Path) -> None:
    """A real fork while the parent's record writer and guard hold their locks and a worker is stuck: the child
    runs operations on workers of its own, quarantines on its own miss and publishes that under its own name and
    pid, without waiting for anything of the parent's; the parent's record is untouched."""
    from sfstore.kvcache import deadline

    where = str(tmp_path / "records")
    rec = QuarantineRecorder("t", target="/dev/x", state_dir=where)
    # at the bound of stuck workers: the parent's record is open-ended (12.8 s), the child's back-off 0.2 s
    g = TierGuard("t", 0.05, 0.2, workers=1, max_abandoned=1, recorder=rec)
    release = threading.Event()
    try:
        assert g.run(release.wait) == ("timeout", None)  # the parent's worker is stuck: quarantined
        assert rec.flush(10.0)
        (parent_rec,) = quarantine_records.read_quarantine_records(where)
        assert parent_rec["pid"] == os.getpid() and f"-{os.getpid()}-" in rec.name

        def check() -> dict[str, Any]:
            wait_for(lambda: not g.quarantined())  # the parent's back-off ends; its stuck worker is not here
            ok = g.run(lambda: 7)
            missed = g.run(time.sleep, 0.5)  # a miss of the child's own
            flushed = rec.flush(10.0)
            return {"ok": list(ok), "missed": list(missed), "flushed": flushed, "me": os.getpid(),
                    "name": rec.name, "abandoned": g.describe()["abandoned_now"],
                    "pids": sorted(r["pid"] for r in quarantine_records.read_quarantine_records(where))}

        # as threads of the parent may hold them at the fork
        with deadline._local_writer._cond, g._lock, rec._lock:
            out = in_forked_child(check)
        assert "error" not in out, out
        assert out["ok"] == ["ok", 7] and out["missed"] == ["timeout", None] and out["flushed"]
        assert f"-{out['me']}-" in out["name"] and out["abandoned"] == 1  # its own worker, not the parent's
        assert out["pids"] == sorted([os.getpid(), out["me"]])
        # the child is gone: its record no longer holds; the parent's does
        assert [r["pid"] for r in quarantine_records.read_quarantine_records(where)] == [os.getpid()]
        assert f"-{os.getpid()}-" in rec.name and g.describe()["abandoned_now"] == 1  # the parent's state
    finally:
        release.set()
        g.close()


def test_an_operation_that_never_started_gives_back_what_it_was_lent_at_its_deadline(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # the only worker is stuck and no other may start (as when every worker of the pool is busy): the second
    # operation waits in the queue past its deadline and is cancelled; the memory it was lent (on_late's release)
    # comes back at once, as it does when an abandoned operation returns
    g = TierGuard("t", 0.05, 0.01, workers=1, max_abandoned=4)
    stuck = threading.Event()
    released: list[str] = []
    try:
        first = threading.Thread(target=g.run, args=(stuck.wait,), kwargs={"on_late": lambda: released.append("1")})
        first.start()
        wait_for(lambda: g.describe()["calls"] == 1 and g._idle == 0)
        monkeypatch.setattr(g, "_start_worker", lambda: None)
        first.join(5)
        wait_for(lambda: not g.quarantined())  # the first one's miss: a back-off of 10 ms
        assert g.run(lambda: released.append("ran"), on_late=lambda: released.append("2")) == (
            "timeout", None)
        assert released == ["2"]  # never ran, given back before the answer
        stuck.set()
        wait_for(lambda: g.describe()["abandoned_now"] == 0)
        assert released == ["2", "1"]  # the abandoned one gives back when it returns
    finally:
        stuck.set()
        g.close()
