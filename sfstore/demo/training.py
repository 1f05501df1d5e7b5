"""The demo's training job: a sharded dataset streamed over ``sf://``, checkpoints with ``save_async``, a crash
and a resume from ``latest()``. Needs torch and numpy."""

from __future__ import annotations

import io
import multiprocessing
import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import Dataset

from sfstore import errors

__all__ = ["make_dataset", "ShardDataset", "training_job"]

FEATURES = 32
CLASSES = 4
RUN = "demo-run"  # checkpoints go to <checkpoint root>/demo-run/step-NNNNN


def make_dataset(shards: int = 32, samples: int = 512, prefix: str = "demo/dataset") -> dict[str, Any]:
    """Write ``shards`` shards of ``samples`` labelled samples each as ``.npy`` files under ``sf://<prefix>/``."""
    import fsspec
    import numpy as np

    fs = fsspec.filesystem("sf")
    rng = np.random.default_rng(0)
    w = rng.standard_normal((FEATURES, CLASSES)).astype(np.float32)
    files = {}
    for i in range(shards):
        x = rng.standard_normal((samples, FEATURES)).astype(np.float32)
        y = (x @ w).argmax(axis=1).astype(np.int64)  # a rule the model can learn
        buf = io.BytesIO()
        np.save(buf, np.concatenate([x, y[:, None].astype(np.float32)], axis=1))
        files[f"{prefix}/shard-{i:05d}.npy"] = buf.getvalue()
    t0 = time.perf_counter()
    fs.pipe(files)
    seconds = time.perf_counter() - t0
    names = sorted(files)
    drop_cached(fs.file_path, names)  # cold: the first epoch reads from storage
    t0 = time.perf_counter()
    back = fs.cat(names)  # one pipelined batch, as a loader prefetching shards would
    read_s = time.perf_counter() - t0
    ok = isinstance(back, dict) and all(back[n] == files[n] for n in names)
    return {"shards": shards, "samples": shards * samples, "bytes": sum(len(v) for v in files.values()),
            "write_s": seconds, "read_s": read_s, "verified": ok, "names": names}


def drop_cached(fp: Any, names: list[str]) -> None:
    """Drop the page cache of the files ``names`` of the file path ``fp``, each opened beneath its root (a
    directory swapped for a symlink meanwhile is refused, never followed out)."""
    for name in names:
        fd, _ = fp.open_beneath(name, os.O_RDONLY | os.O_NONBLOCK)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class ShardDataset(Dataset):  # type: ignore[type-arg]
    """One shard per item, read over ``sf://`` in the DataLoader worker (``np.load`` never unpickles here)."""

    def __init__(self, names: list[str]) -> None:
        self.names = names

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, i: int) -> Any:
        import fsspec
        import numpy as np
        import torch

        raw = fsspec.filesystem("sf").cat_file(self.names[i])
        arr = np.load(io.BytesIO(raw), allow_pickle=False)
        return torch.from_numpy(arr[:, :FEATURES].copy()), torch.from_numpy(arr[:, FEATURES].astype(np.int64))


def _model() -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                               torch.nn.ReLU(), torch.nn.Linear(512, CLASSES))


def _batches(names: list[str], workers: int) -> Iterator[Any]:
    from torch.utils.data import DataLoader

    while True:  # epochs
        yield from DataLoader(ShardDataset(names), batch_size=None, shuffle=True, num_workers=workers,
                              persistent_workers=False)


def _trainer(names: list[str], every: int, workers: int, conn: Any) -> None:
    """The training process (killed by the parent): train, save_async every ``every`` steps, report commits."""
    import torch

    from sfstore import checkpoint

    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    pending: list[tuple[int, Any]] = []
    seen = 0
    t0 = time.perf_counter()
    for step, (x, y) in enumerate(_batches(names, workers), start=1):
        seen += x.numel() * 4 + y.numel() * 8
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        for s, fut in list(pending):
            if fut.done():
                fut.get()
                pending.remove((s, fut))
                conn.send(("committed", s, loss.item(), seen, time.perf_counter() - t0))
        if step % every == 0:
            conn.send(("saving", step))
            state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}
            b0 = time.perf_counter()
            fut = checkpoint.save_async(state, f"{RUN}/step-{step:05d}", metadata={"step": step})
            conn.send(("returned", step, time.perf_counter() - b0))  # save_async blocked this long
            pending.append((step, fut))


def _watch(
    proc: Any, conn: Any, kill_after: int, progress: Callable[[str], None]
) -> tuple[list[int], list[float], tuple[Any, ...], int | None]:
    """Follow the trainer's reports; SIGKILL it as it starts a save after ``kill_after`` commits."""
    committed: list[int] = []
    blocked: list[float] = []
    last: tuple[Any, ...] = ()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if not conn.poll(1.0):
            if not proc.is_alive():
                raise RuntimeError(f"the training process died (exit code {proc.exitcode})")
            continue
        msg = conn.recv()
        if msg[0] == "committed":
            committed.append(msg[1])
            last = msg
            progress(f"step {msg[1]}: checkpoint committed (loss {msg[2]:.3f})")
        elif msg[0] == "returned":
            blocked.append(msg[2])
        elif msg[0] == "saving" and len(committed) >= kill_after:
            time.sleep(0.005)  # let the save get going
            os.kill(proc.pid or 0, signal.SIGKILL)
            return committed, blocked, last, int(msg[1])
    raise RuntimeError("the trainer made no progress for 120 s")


def training_job(
    names: list[str], *, every: int = 10, workers: int = 2, kill_after: int = 3, resume_steps: int = 20,
    progress: Callable[[str], None] = lambda s: None,
) -> dict[str, Any]:
    """Train in a child process streaming ``names`` through a DataLoader; SIGKILL it while a checkpoint is
    being saved after ``kill_after`` committed ones; resume from ``latest()`` in this process and train on."""
    import torch

    import sfstore
    from sfstore import checkpoint

    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    try:
        old = checkpoint.list(RUN)
    except errors.PathNotFoundError:
        old = []
    root = sfstore.open().file_path("checkpoint")
    for info in old:  # a fresh run each time; removed beneath the checkpoint root (links removed, not followed)
        try:
            root.rmtree(root.relative(info.path))
        except OSError:
            pass
    proc = ctx.Process(target=_trainer, args=(names, every, workers, child))  # not daemonic: it has workers
    proc.start()
    try:
        committed, blocked, last, killed_during = _watch(proc, parent, kill_after, progress)
    finally:
        if proc.is_alive():
            os.kill(proc.pid or 0, signal.SIGKILL)
        proc.join()
    progress(f"trainer killed (SIGKILL) while saving step {killed_during}")
    found = checkpoint.latest(RUN)
    if found is None:
        raise RuntimeError("latest() found no checkpoint after the crash")
    info = found
    recovered = int(info.step or 0)
    t0 = time.perf_counter()
    state = checkpoint.load(info)  # checksums verified
    load_s = time.perf_counter() - t0
    model = _model()
    model.load_state_dict(state["model"])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    opt.load_state_dict(state["optimizer"])
    progress(f"resumed from {info.name} (step {recovered}); training {resume_steps} more steps")
    losses = []
    for i, (x, y) in enumerate(_batches(names, workers)):
        if i == resume_steps:
            break
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        losses.append(loss.item())
    final = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": recovered + resume_steps}
    t0 = time.perf_counter()
    done = checkpoint.save(final, f"{RUN}/step-{recovered + resume_steps:05d}",
                           metadata={"step": recovered + resume_steps})
    save_s = time.perf_counter() - t0
    acc = _accuracy(model, names[:4])
    return {
        "committed": committed, "killed_during": killed_during, "recovered_step": recovered,
        # the newest commit the trainer reported, or a later one that completed before the kill
        "recovered_last_committed": bool(committed) and committed[-1] <= recovered <= (killed_during or 0),
        "stream_mib_s": (last[3] / last[4] / (1 << 20)) if last else 0.0,
        "save_async_blocked_s": max(blocked) if blocked else None,
        "checkpoint_bytes": done.tensor_bytes, "save_s": save_s, "load_s": load_s,
        "loss_start": last[2] if last else None, "loss_end": losses[-1] if losses else None, "accuracy": acc,
        "final": done.name,
    }


def _accuracy(model: Any, names: list[str]) -> float:
    import torch

    ds = ShardDataset(names)
    right = total = 0
    with torch.no_grad():
        for i in range(len(ds)):
            x, y = ds[i]
            right += int((model(x).argmax(1) == y).sum())
            total += len(y)
    return right / max(1, total)
