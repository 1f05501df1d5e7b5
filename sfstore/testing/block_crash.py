"""Crash-safety trials of the block store: a child putting, overwriting and deleting is SIGKILLed at random.

Each trial forks a child (from a ``multiprocessing`` forkserver with sfstore imported, so it starts in
milliseconds) that opens the store (recovering from the previous kill or close) and runs random operations on
a fixed key space: batches of puts (new keys and overwrites, values in every size class), deletes and
flushes. Before each operation it appends the intent to a log (``P key version`` / ``D key``), and after each
:meth:`~sfstore.blocks.BlockStore.flush` returns it appends ``F``; the log is written with ``O_APPEND``, so it
survives the kill. Once the child has flushed in this trial it is killed after a random delay. Then the parent
opens the store (rebuilding the index from the slot headers) and, for every key:

(what the parent finds, and makes durable by closing the store, is logged as the state of each key for the
next trial: ``O key version`` lines and an ``F``)

* the *flushed* state is the last operation on it before the last ``F``; the *possible* states are that one
  plus every operation on it after the last ``F`` (unflushed: they may or may not have landed);
* a value returned must be bit-exactly the value of one possible put (never a torn value, never an older
  version than the flushed one); ``None`` is allowed only where the flushed state or an unflushed operation
  is a delete (or the key was never flushed).

The key space fits the store, so nothing is evicted. ``python -m sfstore.testing.block_crash IMAGE [TRIALS]``
runs them and prints the report.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass
from typing import Any

from sfstore.testing.crash_trials import TrialReport, forkserver, main
from sfstore.testing.sigkill import kill_after_progress

__all__ = ["run_trials", "CrashReport", "expected_value", "STORE_BYTES", "CLASSES"]

STORE_BYTES = 48 << 20
CLASSES = (4 << 10, 64 << 10, 1 << 20)
# (key prefix, keys, value sizes): fits the classes above twice over (live values + overwritten slots
# awaiting a flush), so nothing is ever evicted.
_KEYS = (("s", 40, (1, 100, 4000, 4096)), ("m", 16, (5000, 30_000, 65_536)), ("b", 4, (100_000, 1 << 20)))


def _key_space() -> list[tuple[str, tuple[int, ...]]]:
    return [(f"{p}{i}", sizes) for p, n, sizes in _KEYS for i in range(n)]


def expected_value(key: str, version: int) -> bytes:
    """The value the child puts for ``key`` at ``version`` (size and bytes derived from both)."""
    sizes = dict(_key_space())[key]
    rng = random.Random(f"{key}/{version}")
    return rng.randbytes(rng.choice(sizes))


def _child(target: dict[str, Any], log: str, seed: int, first_version: int) -> None:
    """The loop run in the child until it is killed."""
    from sfstore.blocks import BlockStore

    keys = [k for k, _ in _key_space()]
    rng = random.Random(seed)
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    store = BlockStore(target, size_classes=CLASSES, lock_timeout=30)
    version = first_version
    while True:
        r = rng.random()
        if r < 0.1:
            k = rng.choice(keys)
            os.write(fd, f"D {k}\n".encode())
            store.delete(k)
        elif r < 0.3:
            store.flush()
            os.write(fd, b"F\n")
        else:
            batch = {}
            lines = []
            for k in rng.sample(keys, rng.randint(1, 8)):
                batch[k] = expected_value(k, version)
                lines.append(f"P {k} {version}\n")
                version += 1
            os.write(fd, "".join(lines).encode())
            store.put_many(batch)


@dataclass
class CrashReport(TrialReport):
    """What :func:`run_trials` saw."""

    operations: int = 0
    flushes: int = 0
    unflushed_seen: int = 0  # keys whose value came from an operation after the last flush
    torn_dropped: int = 0  # slots the recovery found torn (checksum) and dropped


def _states(log: str) -> tuple[dict[str, Any], dict[str, list[Any]], int, int, int]:
    """Per key: the flushed state and the possible unflushed ones (``None``: deleted / absent); the number of
    operations and flushes; the highest version put."""
    flushed: dict[str, Any] = {}
    after: dict[str, list[Any]] = {}
    ops = flushes = top = 0
    with open(log) as f:
        lines = f.read().splitlines()
    for line in lines:
        parts = line.split()
        if not parts:
            continue
        if parts[0] == "T":  # a trial began (written by the parent)
            continue
        if parts[0] == "O" and len(parts) == 3:  # what the parent found after a kill (then closed: durable)
            after.setdefault(parts[1], []).append(None if parts[2] == "-" else int(parts[2]))
            continue
        if parts[0] == "F":
            flushes += 1
            for k, states in after.items():
                flushed[k] = states[-1]
            after = {}
            continue
        ops += 1
        if parts[0] == "P" and len(parts) == 3:
            after.setdefault(parts[1], []).append(int(parts[2]))
            top = max(top, int(parts[2]))
        elif parts[0] == "D" and len(parts) == 2:
            after.setdefault(parts[1], []).append(None)
    return flushed, after, ops, flushes, top


def _check(target: dict[str, Any], log: str, report: CrashReport, trial: int) -> dict[str, int | None]:
    """Verify the store against the log; return the version found for each key (``None``: absent)."""
    from sfstore.blocks import BlockStore

    flushed, after, ops, flushes, _top = _states(log)
    report.operations, report.flushes = ops, flushes
    found: dict[str, int | None] = {}
    with BlockStore(target, size_classes=CLASSES, lock_timeout=30) as store:
        report.torn_dropped += int(store.stats()["corrupt_dropped"])
        if store.recovered != "scan":
            report.failures.append(f"trial {trial}: a killed store was recovered by {store.recovered!r}, not a scan")
        for key, _ in _key_space():
            done = flushed.get(key)
            maybe = after.get(key, [])
            got = store.get(key)
            allowed = [done, *maybe]
            found[key] = None
            if got is None:
                if None not in allowed:
                    report.failures.append(f"trial {trial}: {key} lost (flushed version {done}, then {maybe})")
                continue
            match = [v for v in allowed if v is not None and expected_value(key, v) == got]
            if not match:
                report.failures.append(
                    f"trial {trial}: {key} returned {len(got)} bytes matching none of versions {allowed}"
                )
            else:
                found[key] = match[-1]
                if match[-1] != done:
                    report.unflushed_seen += 1
    return found


def run_trials(
    directory: str | os.PathLike[str],
    trials: int = 30,
    *,
    seed: int = 0,
    max_delay: float = 0.2,
    start_timeout: float = 60.0,
    target: dict[str, Any] | str | None = None,
) -> CrashReport:
    """Run ``trials`` kill trials on a store in ``directory`` (an image file there, or ``target``).

    Failures are collected in :attr:`CrashReport.failures`, not raised.
    """
    from sfstore.blocks import BlockStore

    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    tgt: Any = target or {"kind": "image", "path": os.path.join(directory, "blocks.img"), "size": STORE_BYTES}
    log = os.path.join(directory, "operations.log")
    with open(log, "w"):
        pass
    BlockStore(tgt, size_classes=CLASSES, capacity=STORE_BYTES, format=True).close()
    rng = random.Random(seed)
    ctx = forkserver("sfstore.blocks", __name__)
    report = CrashReport()
    began = time.monotonic()
    version = 1
    for trial in range(trials):
        before = _states(log)[3]
        with open(log, "a") as f:
            f.write(f"T {trial}\n")
        proc = ctx.Process(target=_child, args=(tgt, log, rng.randrange(1 << 30), version), daemon=True)
        proc.start()
        report.trials = trial + 1
        if not kill_after_progress(proc, lambda: _states(log)[3], before, rng, max_delay, start_timeout):
            report.failures.append(f"trial {trial}: the child flushed nothing (exit code {proc.exitcode})")
            break
        found = _check(tgt, log, report, trial)
        # The parent's clean close made what it found durable: that is every key's state for the next trial.
        with open(log, "a") as f:
            f.write("".join(f"O {k} {'-' if v is None else v}\n" for k, v in found.items()) + "F\n")
        version = _states(log)[4] + 1
    report.seconds = time.monotonic() - began
    return report


if __name__ == "__main__":  # pragma: no cover - a manual entry point
    main(run_trials, "sfstore.testing.block_crash")
