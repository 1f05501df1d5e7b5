"""``sfstore demo`` end to end in a reduced form, checking its own summary, and its ticker: a step quiet for a
while says it is still going."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import threading
import time
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from sfstore.demo.progress import TICK_SECONDS, say, still_going

MAX_QUIET_S = 15.0
"""The longest the demo may print nothing (README's promise: progress at least this often)."""
TICKER = re.compile(r"^  \.\.\. still (?P<step>.+) \((?P<s>\d+) s\)$")


def test_demo_runs_end_to_end_and_its_summary_holds(tmp_path: Path) -> None:
    """Twice on one data directory, as README's first command run again does: the second run finds what the
    first stored (checkpoints, hot blocks, KV blocks under the same keys) and must hold all the same. The
    first is the command itself; the second the same run with a ticker of half a second, which the quiet
    stretches of the training step must show."""
    _check_demo(tmp_path, 1)
    lines = _check_demo(tmp_path, 2, tick=0.5)
    ticks = [m for m in map(TICKER.match, lines) if m]
    assert any(m["step"] == "training" for m in ticks), "\n".join(lines)


def _run_timed(argv: list[str], timeout: float) -> tuple[int, list[str], float]:
    """Run ``argv``, its stderr into its stdout; its exit code, its lines, and the longest it was silent
    (from its start to its first line, between lines, and from its last line to its end)."""
    start = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    watchdog = threading.Timer(timeout, proc.kill)
    watchdog.start()
    lines: list[str] = []
    last, quiet = start, 0.0
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            now = time.monotonic()
            quiet, last = max(quiet, now - last), now
            lines.append(line.rstrip("\n"))
        rc = proc.wait()
    finally:
        watchdog.cancel()
    return rc, lines, max(quiet, time.monotonic() - last)


def _check_demo(tmp_path: Path, run: int, tick: float | None = None) -> list[str]:
    out_json = tmp_path / f"summary-{run}.json"
    data = str(tmp_path / "data")
    if tick is None:
        argv = [sys.executable, "-m", "sfstore.cli", "demo", "--data-dir", data, "--size", "8m", "--shards", "8",
                "--json", str(out_json)]
    else:
        argv = [sys.executable, "-c", "import sys; from sfstore.demo import run_demo; sys.exit(run_demo("
                f"data_dir={data!r}, size=8 << 20, shards=8, json_out={str(out_json)!r}, tick={tick!r}))"]
    rc, lines, quiet = _run_timed(argv, timeout=300)
    text = "\n".join(lines)
    assert rc == 0, f"run {run}: " + text[-6000:]
    assert quiet < MAX_QUIET_S, f"run {run}: silent for {quiet:.1f} s:\n{text[-6000:]}"
    s = json.loads(out_json.read_text())
    assert s["ok"] is True
    # every data class routed, with its path and transport
    assert {c: s["classes"][c]["path"] for c in s["classes"]} == {
        "dataset": "file", "checkpoint": "file", "hot": "block", "kvcache": "device"}
    assert all(c["available"] and c["transport"] == "local" for c in s["classes"].values())
    assert s["classes"]["hot"]["fallbacks"] and s["classes"]["dataset"]["fallbacks"]  # reported, not silent
    assert s["classes"]["checkpoint"]["bytes_written"] > 0 and s["classes"]["hot"]["bytes_read"] > 0
    # the crash-resume step recovered the last committed checkpoint
    tr = s["steps"]["training"]
    assert len(tr["committed"]) >= 3 and tr["recovered_last_committed"] is True
    assert tr["committed"][-1] <= tr["recovered_step"] <= tr["killed_during"]
    assert tr["loss_end"] < tr["loss_start"]
    # KV hits after the first request, from every tier
    kv = s["steps"]["kvcache"]
    assert kv["steps"][0]["hit_tokens"] == 0 and all(st["hit_tokens"] > 0 for st in kv["steps"][1:])
    assert [st["tiers"] for st in kv["steps"][1:]] == [["pinned"], ["block"], ["shared"]]
    assert kv["hits_shared"] > 0 and s["classes"]["kvcache"]["bytes_read"] > 0  # the second store's shared hits
    assert s["steps"]["hot"]["verified"] and s["steps"]["round_trip"]["verified"]
    # the round trip's own path counted what it moved: 8 MiB each way, plus the misaligned read of 9997 bytes
    rt = s["steps"]["round_trip"]["counters"]
    assert rt["bytes_written"] == 8 << 20 and rt["bytes_read"] == (8 << 20) + 9997 and rt["files"] == 1
    assert rt["requests"] == 5 and rt["errors"] == 0  # 4 MiB chunks: 2 writes, 2 reads, 1 misaligned read
    assert "engine    ok" in text and "routing" in text and "summary per data class" in text
    assert "the last committed: recovered" in text and "demo verified in" in text
    # one screen: a line per probe section (the full table is sfstore probe's), and where the data went
    assert "sfstore probe prints the full table" in text and "alignment.memory" not in text
    assert f"its data is in {tmp_path / 'data'}" in text and f"rm -rf {tmp_path / 'data'}" in text
    return lines


def test_demo_rejects_a_bad_size(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "sfstore.cli", "demo", "--data-dir", str(tmp_path), "--size", "lots"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1 and "--size" in out.stderr and "Traceback" not in out.stderr


def _ticks(text: str) -> list[re.Match[str]]:
    return [m for m in map(TICKER.match, text.splitlines()) if m]


def test_a_quiet_step_says_it_is_still_going() -> None:
    """A step that sleeps (really) through several intervals prints the ticker line each interval, counting
    the seconds since it began, and nothing once it has ended."""
    buf = io.StringIO()
    with redirect_stdout(buf):
        with still_going("sleeping", every=0.1):
            time.sleep(0.65)
        ended = buf.getvalue()
        time.sleep(0.35)
    ticks = _ticks(ended)
    assert len(ticks) >= 2 and all(m["step"] == "sleeping" and m["s"] == "0" for m in ticks), ended
    assert buf.getvalue() == ended  # the ticker stopped with the step


def test_the_seconds_count_from_the_steps_start() -> None:
    buf = io.StringIO()
    with redirect_stdout(buf), still_going("waiting", every=0.6):
        time.sleep(2.5)
    seconds = [int(m["s"]) for m in _ticks(buf.getvalue())]  # ticks at 0.6, 1.2, 1.8 ... s, whole seconds shown
    assert len(seconds) >= 3 and seconds == sorted(seconds) and seconds[0] == 0 and seconds[2] >= 1, buf.getvalue()


def test_a_step_that_prints_often_gets_no_ticker() -> None:
    """Quiet is what the ticker measures: a step that says something more often than the interval never
    shows it."""
    buf = io.StringIO()
    with redirect_stdout(buf), still_going("talking", every=1.0):
        for i in range(12):
            say(f"  line {i}")
            time.sleep(0.1)
    assert _ticks(buf.getvalue()) == [] and buf.getvalue().count("line") == 12


def test_the_ticker_defaults_and_refusals() -> None:
    assert 5 <= TICK_SECONDS < MAX_QUIET_S  # a tick well inside README's promise
    buf = io.StringIO()
    with redirect_stdout(buf), still_going("hidden", every=0.05, show=False):
        time.sleep(0.3)
    assert buf.getvalue() == ""
    with pytest.raises(ValueError, match="positive"), still_going("never", every=0):
        pass
