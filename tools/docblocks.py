"""List and run the fenced code blocks of markdown files, so that no example in README or docs/ rots.

Standard library only: it also runs in a fresh virtual environment made from a built wheel.

``python tools/docblocks.py extract FILE...`` lists every fenced block: file, line of its opening fence,
language, and the marker before it, if any.

``python tools/docblocks.py run FILE... [--repeat N]`` checks them:

* a ```` ```python ```` block is written to a file and run with this interpreter in a fresh subprocess; every
  block of one markdown file runs in the same working directory (a temporary one) with the same
  ``SFSTORE_DATA_DIR`` (a temporary one), in order, and ``--repeat N`` runs the whole sequence N times, so that
  the second run meets the first run's data, as a user who runs an example twice does;
* a ```` ```toml ```` block is parsed (``tomllib``) and checked with ``sfstore config check`` (a non-zero exit
  is a failure), or where this sfstore has no such command, read by ``sfstore.router.Router`` as a config file;
* a ```` ```json ```` block is parsed;
* other languages (``bash``, ``text``, ...) are listed, not run.

A block that cannot run on an ordinary machine (it needs a GPU, vLLM, a cluster's mounts, root) is marked by an
HTML comment on the line right before its fence::

    <!-- docblock: compile-only (needs a GPU) -->

It is then only compiled (Python) or parsed (JSON), and the reason is printed. A marked TOML block is parsed and,
where there is ``sfstore config check``, checked with it: the only problems allowed are about the absolute paths
it names that do not exist on this machine (a cluster's mounts, a device). Each subprocess gets a
clean environment: no ``SFSTORE_*`` variable but the data directory, and ``XDG_CONFIG_HOME`` and ``HF_HOME`` in
the temporary directory (Hugging Face's offline mode is not set: it refuses fsspec URLs such as ``sf://``; the
examples fetch nothing).

The exit status is 0 when every block passed, 1 when one failed (each failure names the file and the block's
line), 2 for a usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10, where sfstore depends on tomli
    import tomli as tomllib

__all__ = ["Block", "extract", "main", "run_file"]

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`]*?)[ \t]*$")
_MARKER = re.compile(r"^\s*<!--\s*docblock:\s*(?P<kind>[a-z-]+)\s*(?:\((?P<reason>.*)\))?\s*-->\s*$")
_KINDS = ("compile-only",)
_RUN_LANGUAGES = ("python", "toml", "json")
#: reads a config file as sfstore.open() does, where there is no `sfstore config check`
_ROUTER_CHECK = "import sys; from sfstore.router import Router; Router(sys.argv[1]).close()"
#: the most output of a failed block shown
_TAIL = 4000


@dataclass(frozen=True)
class Block:
    """One fenced block of a markdown file.

    Attributes
    ----------
    path : str
        The markdown file.
    line : int
        Line of the opening fence (1-based).
    language : str
        The first word of the fence's info string, lower case (``""`` when none).
    code : str
        The block's text, the fence's indentation removed.
    marker : str or None
        ``"compile-only"`` when the line before the fence marks it so.
    reason : str
        The marker's reason (``""`` without one).
    """

    path: str
    line: int
    language: str
    code: str
    marker: str | None = None
    reason: str = ""

    @property
    def where(self) -> str:
        """``FILE:LINE`` of the opening fence."""
        return f"{self.path}:{self.line}"


class DocBlockError(ValueError):
    """A markdown file whose blocks cannot be read (an unclosed fence, an unknown marker)."""


def extract(path: str) -> list[Block]:
    """The fenced blocks of the markdown file ``path``, in order.

    Parameters
    ----------
    path : str
        A markdown file (UTF-8).

    Returns
    -------
    list of Block

    Raises
    ------
    DocBlockError
        A fence is never closed, or a ``docblock:`` marker names an unknown kind.
    """
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, info = m.group("indent"), m.group("fence"), m.group("info")
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines):
            close = _FENCE.match(lines[i])
            if close and close.group("fence")[0] == fence[0] and len(close.group("fence")) >= len(fence) \
                    and not close.group("info"):
                break
            text = lines[i]
            body.append(text[len(indent):] if text.startswith(indent) else text.lstrip(" \t"))
            i += 1
        else:
            raise DocBlockError(f"{path}:{start + 1}: the fence opened here is never closed")
        i += 1
        marker, reason = None, ""
        j = start - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        if j >= 0 and "docblock:" in lines[j]:
            mm = _MARKER.match(lines[j])
            if not mm or mm.group("kind") not in _KINDS:
                raise DocBlockError(f"{path}:{j + 1}: a docblock marker must read "
                                    f"'<!-- docblock: compile-only (why) -->', not {lines[j].strip()!r}")
            marker, reason = mm.group("kind"), (mm.group("reason") or "").strip()
            if not reason:
                raise DocBlockError(f"{path}:{j + 1}: a docblock marker must say why, in brackets")
        language = info.split()[0].lower() if info.split() else ""
        blocks.append(Block(path, start + 1, language, "\n".join(body) + "\n", marker, reason))
    return blocks


def _clean_env(data_dir: str, home: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SFSTORE_")}
    if env.get("PYTHONPATH"):  # the blocks run in another directory: relative entries would point elsewhere
        env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) if p else os.getcwd()
                                            for p in env["PYTHONPATH"].split(os.pathsep))
    env.update({
        "SFSTORE_DATA_DIR": data_dir,
        "XDG_CONFIG_HOME": os.path.join(home, "config"),
        "HF_HOME": os.path.join(home, "hf"),
        "PYTHONDONTWRITEBYTECODE": "1",
    })
    return env


def _tail(text: str) -> str:
    return text if len(text) <= _TAIL else "...\n" + text[-_TAIL:]


class _Runner:
    """Runs one markdown file's blocks in its own working and data directories."""

    def __init__(self, python: str, timeout: float, keep: bool, show: bool = False) -> None:
        self.python = python
        self.show = show
        self.timeout = timeout
        self.keep = keep
        self.base = tempfile.mkdtemp(prefix="docblocks-")
        self.work = os.path.join(self.base, "work")
        self.data = os.path.join(self.base, "data")
        os.makedirs(self.work)
        os.makedirs(self.data)
        self.env = _clean_env(self.data, self.base)
        self._config_check: bool | None = None

    def close(self) -> None:
        if self.keep:
            print(f"kept {self.base}")
        else:
            shutil.rmtree(self.base, ignore_errors=True)

    def has_config_check(self) -> bool:
        """Whether this sfstore has ``sfstore config check`` (asked once)."""
        if self._config_check is None:
            try:
                done = subprocess.run([self.python, "-m", "sfstore.cli", "config", "check", "--help"],
                                      cwd=self.work, env=self.env, capture_output=True, text=True, timeout=120)
                self._config_check = done.returncode == 0
            except (OSError, subprocess.TimeoutExpired):
                self._config_check = False
        return self._config_check

    def _check_elsewhere(self, block: Block, path: str, parsed: dict[str, object]) -> tuple[bool, str]:
        """A marked TOML block (a cluster's config): ``sfstore config check`` may only find fault with the paths
        it names that this machine lacks (a mount, a device); any other problem (a bad value, a misspelt key)
        fails the block."""
        if not self.has_config_check():
            return True, f"parsed only ({block.reason})"
        done = subprocess.run([self.python, "-m", "sfstore.cli", "config", "check", path], cwd=self.work,
                              env=self.env, capture_output=True, text=True, timeout=self.timeout)
        if done.returncode == 0:
            return True, f"parsed and checked with sfstore config check ({block.reason})"
        output = done.stdout + done.stderr
        absent = _absent_paths(parsed)
        errors = [line for line in output.splitlines() if line.lower().startswith("error")]
        other = [line for line in errors if not any(p in line for p in absent)]
        if not errors or other:
            return False, (f"sfstore config check found more than the paths this machine lacks "
                           f"({', '.join(sorted(absent)) or 'none'}):\n{_tail(output)}")
        return True, (f"parsed and checked with sfstore config check: only the paths this machine lacks are "
                      f"missing ({block.reason})")

    def run(self, block: Block, attempt: int) -> tuple[bool, str]:
        """Check ``block``; (passed, what to print)."""
        stem = f"block_L{block.line}"
        if block.language == "python":
            try:
                compile(block.code, f"{block.where}", "exec")
            except SyntaxError as exc:
                return False, f"does not compile: {exc}"
            if block.marker:
                return True, f"compiled only ({block.reason})"
            script = os.path.join(self.work, f"{stem}.py")
            Path(script).write_text(block.code, encoding="utf-8")
            t0 = time.monotonic()
            try:
                done = subprocess.run([self.python, script], cwd=self.work, env=self.env, capture_output=True,
                                      text=True, timeout=self.timeout)
            except subprocess.TimeoutExpired as exc:
                out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
                return False, f"timed out after {self.timeout:g} s\n{_tail(out)}"
            took = time.monotonic() - t0
            if done.returncode != 0:
                return False, (f"exit status {done.returncode} ({took:.1f} s)\n--- stdout\n{_tail(done.stdout)}"
                               f"--- stderr\n{_tail(done.stderr)}")
            shown = f"\n{_tail(done.stdout)}" if self.show and done.stdout else ""
            return True, f"ran ({took:.1f} s){shown}"
        if block.language == "toml":
            try:
                parsed = tomllib.loads(block.code)
            except tomllib.TOMLDecodeError as exc:
                return False, f"is not TOML: {exc}"
            path = os.path.join(self.work, f"{stem}.toml")
            Path(path).write_text(block.code, encoding="utf-8")
            if block.marker:
                return self._check_elsewhere(block, path, parsed)
            if self.has_config_check():
                command, what = [self.python, "-m", "sfstore.cli", "config", "check", path], "sfstore config check"
            else:  # an sfstore without the command: its router still reads the file (keys, values, classes)
                command, what = [self.python, "-c", _ROUTER_CHECK, path], "sfstore.router.Router (no config check)"
            done = subprocess.run(command, cwd=self.work, env=self.env, capture_output=True, text=True,
                                  timeout=self.timeout)
            if done.returncode != 0:
                return False, f"{what}: exit status {done.returncode}\n{_tail(done.stdout + done.stderr)}"
            return True, f"parsed and checked with {what}"
        if block.language == "json":
            try:
                json.loads(block.code)
            except json.JSONDecodeError as exc:
                return False, f"is not JSON: {exc}"
            return True, "parsed"
        return True, "not run"


def _absent_paths(value: object) -> set[str]:
    """The absolute paths among ``value``'s strings (a parsed TOML document) that do not exist here."""
    if isinstance(value, dict):
        return set().union(*(_absent_paths(v) for v in value.values())) if value else set()
    if isinstance(value, list):
        return set().union(*(_absent_paths(v) for v in value)) if value else set()
    if isinstance(value, str) and value.startswith("/") and not os.path.exists(value):
        return {value}
    return set()


def run_file(path: str, *, repeat: int = 1, python: str = sys.executable, timeout: float = 600.0,
             keep: bool = False, only: Sequence[int] = (), show: bool = False) -> list[str]:
    """Check every block of ``path`` (see the module's description); the failures, each naming its block.

    Parameters
    ----------
    path : str
        A markdown file.
    repeat : int
        How many times the file's sequence of blocks runs (in the same directories).
    python : str
        The interpreter the Python blocks and ``sfstore config check`` run with.
    timeout : float
        Seconds one block may run.
    keep : bool
        Keep the temporary directories (their path is printed).
    only : sequence of int
        Check only the blocks opened on these lines (all when empty).
    show : bool
        Print what each Python block wrote to stdout.

    Returns
    -------
    list of str
        One entry per failed block and run: ``FILE:LINE (run N): why``.
    """
    blocks = [b for b in extract(path) if not only or b.line in only]
    runner = _Runner(python, timeout, keep, show)
    failures: list[str] = []
    try:
        for attempt in range(1, repeat + 1):
            for block in blocks:
                if block.language not in _RUN_LANGUAGES:
                    if attempt == 1:
                        print(f"{block.where}: {block.language or 'plain'} block, not run", flush=True)
                    continue
                ok, what = runner.run(block, attempt)
                label = f"{block.where}: {block.language}" + (f" (run {attempt})" if repeat > 1 else "")
                print(f"{label}: {'ok' if ok else 'FAILED'}, {what}", flush=True)
                if not ok:
                    failures.append(f"{block.where} (run {attempt}): {what}")
    finally:
        runner.close()
    return failures


def main(argv: Sequence[str] | None = None) -> int:
    """``python tools/docblocks.py extract|run FILE...``; the exit status (see the module's description)."""
    parser = argparse.ArgumentParser(prog="docblocks", description="List or run the fenced code blocks of "
                                                                   "markdown files.")
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("extract", help="list every fenced block: file:line, language, marker")
    ex.add_argument("files", nargs="+", metavar="FILE")
    rn = sub.add_parser("run", help="run the python blocks, parse (and check) the toml and json blocks")
    rn.add_argument("files", nargs="+", metavar="FILE")
    rn.add_argument("--repeat", type=int, default=1, metavar="N",
                    help="run each file's blocks N times in the same directories (default 1)")
    rn.add_argument("--timeout", type=float, default=600.0, metavar="S", help="seconds per block (default 600)")
    rn.add_argument("--python", default=sys.executable, help="interpreter for the blocks (default: this one)")
    rn.add_argument("--line", type=int, action="append", default=[], metavar="N",
                    help="only the block whose fence opens on line N (repeatable)")
    rn.add_argument("--keep", action="store_true", help="keep the temporary directories")
    rn.add_argument("--show", action="store_true", help="print what each python block writes to stdout")
    args = parser.parse_args(argv)
    try:
        if args.command == "extract":
            for name in args.files:
                for b in extract(name):
                    mark = f"  [{b.marker}: {b.reason}]" if b.marker else ""
                    print(f"{b.where}\t{b.language or '-'}{mark}")
            return 0
        if args.repeat < 1:
            parser.error("--repeat must be at least 1")
        failures: list[str] = []
        for name in args.files:
            failures += run_file(name, repeat=args.repeat, python=args.python, timeout=args.timeout,
                                 keep=args.keep, only=args.line, show=args.show)
    except (OSError, DocBlockError) as exc:
        print(f"docblocks: {exc}", file=sys.stderr)
        return 2
    if failures:
        print(f"\n{len(failures)} block run(s) failed:", file=sys.stderr)
        for f in failures:
            print(f"  {f.splitlines()[0]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
