"""Every fenced block of README.md and docs/**/*.md runs or parses (tools/docblocks.py): Python blocks run in a fresh
process each, TOML blocks are parsed and checked as a config file, JSON blocks parsed. README's quick starts run
twice in a row in the same data directory, as a user who runs them again would. One test per file, so a failure
names the file; the output names the block's line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCBLOCKS = ROOT / "tools" / "docblocks.py"
PAGES = ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").rglob("*.md"))]


def _run(page: str, repeat: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(DOCBLOCKS), "run", page, "--repeat", str(repeat)], cwd=ROOT,
                          capture_output=True, text=True, timeout=1800)


@pytest.mark.parametrize("page", PAGES)
def test_every_block_runs(page: str) -> None:
    done = _run(page, 2 if page == "README.md" else 1)
    if done.returncode != 0 or "FAILED" in done.stdout:
        pytest.fail(f"{page}: a block failed (exit status {done.returncode})\n{done.stdout[-12000:]}\n"
                    f"{done.stderr[-4000:]}", pytrace=False)


def test_readme_has_the_four_quick_starts() -> None:
    """README's quick starts are there to be run: three Python blocks and a TOML config, each at most ten lines."""
    from tools import docblocks

    blocks = [b for b in docblocks.extract(str(ROOT / "README.md")) if b.language in ("python", "toml")]
    assert [b.language for b in blocks] == ["python", "python", "python", "toml"]
    for b in blocks:
        lines = [line for line in b.code.splitlines() if line.strip()]
        assert len(lines) <= 10, f"README.md:{b.line}: a quick start of {len(lines)} lines (at most 10)"
    assert sum(1 for b in blocks if b.marker) == 1  # only the cluster's config names what this machine lacks
