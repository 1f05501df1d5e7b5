"""README's quick start, as a new user runs it: twice in a row, in a fresh data directory, with nothing on stderr.

The script is the quick start with its resume guarded (``latest()`` is ``None`` on the first run) and the
checkpoint saved with ``overwrite=True`` (a rerun saves the same names again).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("torch")

QUICK_START = textwrap.dedent(
    """
    import fsspec, torch
    from torch.utils.data import DataLoader
    from sfstore import checkpoint
    from sfstore.kvcache import KVCacheStore, KVGeometry

    fs = fsspec.filesystem("sf")
    fs.pipe({f"train/{i:04d}.bin": torch.randn(1024).numpy().tobytes() for i in range(64)})
    class Shards(torch.utils.data.Dataset):
        def __len__(self): return 64
        def __getitem__(self, i): return torch.frombuffer(bytearray(fs.cat(f"train/{i:04d}.bin")), dtype=torch.float32)
    for batch in DataLoader(Shards(), batch_size=16, num_workers=2): ...

    model = torch.nn.Linear(1024, 1024)
    if (last := checkpoint.latest("run1")) is not None:
        model.load_state_dict(checkpoint.load(last)["model"])
    checkpoint.save_async({"model": model.state_dict(), "step": 100}, "run1/step-100", overwrite=True).get()
    restored = checkpoint.load(checkpoint.latest("run1"))
    assert restored["step"] == 100

    geom = KVGeometry(num_layers=4, block_tokens=16, num_kv_heads=2, head_dim=64, dtype="bfloat16")
    kv = KVCacheStore.from_router(geom, model_id="my-model")
    keys = kv.keys_for(list(range(64)))
    kv.put(keys, [torch.zeros(geom.block_shape, dtype=torch.bfloat16) for _ in keys])
    kv.get_into(keys, [torch.empty(geom.block_shape, dtype=torch.bfloat16) for _ in keys])
    print("quick start ok")
    """
)


def test_quick_start_runs_twice_with_a_clean_stderr(tmp_path: Path) -> None:
    script = tmp_path / "quick_start.py"
    script.write_text(QUICK_START)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SFSTORE_")}
    env["SFSTORE_DATA_DIR"] = str(tmp_path / "data")
    for run in (1, 2):
        done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, f"run {run}: {done.stderr[-3000:]}"
        assert "quick start ok" in done.stdout
        # Nothing at exit either: no "Exception ignored in ... __del__" from objects torn down at shutdown.
        assert done.stderr == "", f"run {run} wrote to stderr:\n{done.stderr[-3000:]}"
