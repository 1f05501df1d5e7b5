"""``sfstore kv du`` and ``sfstore kv gc`` on a real shared directory with two namespaces and a leftover of a
killed evictor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sfstore import cli
from sfstore.kvcache.shared_budget import EVICTING
from tests.kvcache import shared_workers as w

FILE = w.FILE_BYTES
files_in, leftovers = w.files_in, w.leftovers


def test_kv_du_and_gc_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shared = tmp_path / "shared"
    for ns in ("", "x"):
        kv = w.open_store(str(shared), 0, ns)
        for i in range(6):
            kv.put([w.key(kv, i)], [w.block(i)])
        kv.close()
    (shared / "00").mkdir(exist_ok=True)
    (shared / "00" / f"{EVICTING}dead-1-1-00ab.kvb").write_bytes(b"x")
    assert cli.main(["kv", "du", str(shared), "--budget", str(4 * FILE), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["namespace"], r["files"], r["bytes"], r["budget"], r["evicting"]) for r in rows] == [
        ("", 6, 6 * FILE, 4 * FILE, 1), ("x", 6, 6 * FILE, 4 * FILE, 0)]
    assert cli.main(["kv", "du", str(shared), "--budget", str(4 * FILE)]) == 0
    text = capsys.readouterr().out
    assert "(default)" in text and "over budget" in text
    assert cli.main(["kv", "gc", str(shared), "-n", "x", "--budget", str(4 * FILE)]) == 0
    capsys.readouterr()
    assert len(files_in(shared / "ns" / "x")) == 4 and len(files_in(shared)) == 6
    assert cli.main(["kv", "gc", str(shared), "--budget", str(4 * FILE), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[0]["evicted"] == 2 and rows[0]["evicting_removed"] == 1 and not leftovers(shared)
    assert cli.main(["kv", "du", str(tmp_path / "none")]) == 1
