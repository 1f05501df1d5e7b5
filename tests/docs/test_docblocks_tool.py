"""tools/docblocks.py itself: it finds every block with its line and marker, and a block that is broken fails the
run, naming the file and line (a checker that passes everything would keep no example from rotting)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCBLOCKS = ROOT / "tools" / "docblocks.py"


def _docblocks(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(DOCBLOCKS), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)


def _page(tmp_path: Path, text: str) -> str:
    page = tmp_path / "page.md"
    page.write_text(text, encoding="utf-8")
    return str(page)


def test_extract_lists_language_line_and_marker(tmp_path: Path) -> None:
    page = _page(tmp_path, "# t\n\n```python\nx = 1\n```\n\n<!-- docblock: compile-only (needs a GPU) -->\n"
                           "~~~python\nimport cupy\n~~~\n\n- a list item:\n\n  ```toml\n  a = 1\n  ```\n\n"
                           "```\nplain\n```\n")
    done = _docblocks("extract", page)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"{page}:3\tpython", f"{page}:8\tpython  [compile-only: needs a GPU]",
                                        f"{page}:14\ttoml", f"{page}:18\t-"]


def test_passing_blocks_pass_and_compile_only_is_not_run(tmp_path: Path) -> None:
    page = _page(tmp_path, "```python\nprint('hello')\n```\n\n<!-- docblock: compile-only (needs a GPU) -->\n"
                           "```python\nraise SystemExit(3)\n```\n\n```json\n{\"a\": [1, 2]}\n```\n\n"
                           "```toml\n[settings]\nqueue_depth = 64\n```\n\n```bash\nexit 1\n```\n")
    done = _docblocks("run", page)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{page}:6: python: ok, compiled only (needs a GPU)" in done.stdout
    assert f"{page}:19: bash block, not run" in done.stdout


@pytest.mark.parametrize(("block", "why"), [
    ("```python\nraise RuntimeError('broken example')\n```\n", "broken example"),
    ("```python\ndef f(:\n```\n", "does not compile"),
    ("<!-- docblock: compile-only (needs a GPU) -->\n```python\ndef f(:\n```\n", "does not compile"),
    ("```toml\n[classes.hot]\ntarget = { kind = \"image\",\n  path = \"x\" }\n```\n", "is not TOML"),
    ("```toml\n[settings]\nqueue_depth = \"abc\"\n```\n", "queue_depth"),
    ("```toml\n[clases.dataset]\nroot = \"x\"\n```\n", "clases"),
    ("```json\n{\"a\": 1,}\n```\n", "is not JSON"),
])
def test_a_broken_block_fails_naming_its_line(tmp_path: Path, block: str, why: str) -> None:
    page = _page(tmp_path, "# title\n\n" + block)
    done = _docblocks("run", page)
    assert done.returncode == 1, done.stdout + done.stderr
    line = 4 if block.startswith("<!--") else 3
    assert f"{page}:{line} (run 1)" in done.stderr
    assert why in done.stdout


def test_repeat_meets_the_first_runs_data(tmp_path: Path) -> None:
    """The second run shares the first's data directory (and only it: not the caller's)."""
    code = ("import os, pathlib\nd = pathlib.Path(os.environ['SFSTORE_DATA_DIR'])\n"
            "assert d != pathlib.Path.home() / '.local/share/sfstore'\n"
            "print('seen' if (d / 'mark').exists() else 'first')\n(d / 'mark').write_text('x')\n")
    page = _page(tmp_path, f"```python\n{code}```\n")
    done = _docblocks("run", page, "--repeat", "2", "--show")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.index("first") < done.stdout.index("seen")


def test_a_marker_must_say_why(tmp_path: Path) -> None:
    page = _page(tmp_path, "<!-- docblock: compile-only -->\n```python\nx = 1\n```\n")
    done = _docblocks("run", page)
    assert done.returncode == 2 and "must say why" in done.stderr


def test_an_unclosed_fence_is_an_error(tmp_path: Path) -> None:
    page = _page(tmp_path, "```python\nx = 1\n")
    done = _docblocks("extract", page)
    assert done.returncode == 2 and f"{page}:1" in done.stderr


def _has_config_check() -> bool:
    done = subprocess.run([sys.executable, "-m", "sfstore.cli", "config", "check", "--help"], capture_output=True,
                          text=True, timeout=120)
    return done.returncode == 0


@pytest.mark.parametrize(("settings", "passes"), [("queue_depth = 64", True), ('queue_depth = "deep"', False),
                                                  ('kvcache_shared_bytez = "2t"', False)])
def test_a_cluster_config_may_only_lack_its_mounts(tmp_path: Path, settings: str, passes: bool) -> None:
    """A marked TOML block names mounts this machine lacks: the config check may find those missing, nothing else."""
    if not _has_config_check():
        pytest.skip("this sfstore has no 'sfstore config check' yet: a marked TOML block is only parsed")
    page = _page(tmp_path, "<!-- docblock: compile-only (names a cluster's mounts) -->\n```toml\n"
                           f'root = "{tmp_path}/no-such-mount"\n[settings]\n{settings}\n```\n')
    done = _docblocks("run", page)
    assert (done.returncode == 0) == passes, done.stdout + done.stderr
