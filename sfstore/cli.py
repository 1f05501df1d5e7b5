"""The ``sfstore`` command.

Subcommands are added by ``_add_<name>(subparsers)`` functions listed in :data:`SUBCOMMANDS`; each sets
``func`` on its parser to a callable taking the parsed arguments and returning the exit status.

::

    sfstore --version
    sfstore probe [--json] [--config FILE] [--data-dir PATH]   (exit 1 when the configuration is bad)
    sfstore config check [FILE]                                (every problem of a config and SFSTORE_*)
    sfstore demo [--data-dir PATH] [--size 64m]
    sfstore ls [PATH] [-l] [-R] [--root DIR] [--config FILE]
    sfstore cp SRC DST [-r] [--root DIR] [--config FILE]     (local paths <-> sf:// URLs; - is stdin/stdout)
    sfstore cat URL... [--root DIR] [--config FILE]          (the files' bytes to stdout, streamed)
    sfstore rm [-r] [-f] URL... [--root DIR] [--config FILE] (remove files; -r: directories too)
    sfstore nvme list [--json]
    sfstore nvme discover -t rdma -a ADDR [-s PORT] [-n NQN] [--hostnqn NQN] [--json]
    sfstore nvme connect -t rdma -a ADDR [-s PORT] -n NQN [--hostnqn NQN] [--json]
    sfstore nvme disconnect (NAME | -n NQN [-t T -a ADDR -s PORT])
    sfstore kv du [DIR] [--namespace N] [--budget BYTES] [--json]   (the shared KV tier: bytes per namespace)
    sfstore kv gc [DIR] [--namespace N] [--budget BYTES] [--grace S] [--json]
"""

from __future__ import annotations

import argparse
import datetime
import errno
import json
import os
import posixpath
import stat
import sys
import time
from collections.abc import Callable, Sequence
from typing import IO, TYPE_CHECKING, Any, TextIO

import sfstore
from sfstore import errors, records
from sfstore.errors import SfstoreError

if TYPE_CHECKING:
    from sfstore.fs import SFFileSystem

__all__ = ["build_parser", "main"]

Subparsers = Any  # argparse's _SubParsersAction is private


def _cmd_probe(args: argparse.Namespace) -> int:
    import warnings

    from sfstore.config_check import check
    from sfstore.environment import ConfigProblem
    from sfstore.errors import ConfigWarning
    from sfstore.probe import format_table, probe

    # The configuration first, whole: each bad value, key or variable named at the top and again at the end of
    # the table, and the exit status 1, so a bad configuration cannot pass as a report with "ok" beside it.
    # A misspelt SFSTORE_* name is an error here: the setting it was meant to be is not in force.
    config_file, problems = check(args.config, unknown_variables="error")
    checked_clean = not any(p.severity == "error" for p in problems)
    # Where each data class goes (the router sits above the probe, so the command joins the two). The router is
    # opened first: a config file's data_dir is a setting it sets, which the probe's data_dir check then reads.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)  # printed below, with the other problems
        try:
            router = sfstore.open(args.config)
            routing: dict[str, Any] = router.describe()
            routing_text = router.format()
        except SfstoreError as exc:
            routing = {"status": "error", "reason": str(exc)}
            routing_text = f"error: {exc}"
            if checked_clean:
                problems.append(ConfigProblem("error", "sfstore.open()", "", str(exc)))
        report = probe(data_dir=args.data_dir)
    for name, c in routing.get("classes", {}).items():
        # A missing root is among the problems already; a read-only one is news (a warning: reads work).
        if c.get("error") and (c.get("severity") == "warning" or checked_clean):
            problems.append(ConfigProblem(c["severity"], "routing", f"classes.{name}", c["error"]))
        elif c.get("read_only"):
            problems.append(ConfigProblem("warning", "routing", f"classes.{name}",
                                          f"the root of data class {name!r} ({c['root']}): {c['read_only']}"))
    section = report["data_dir"]
    known = any(p.key == "data_dir" and str(section.get("path")) in p.message for p in problems)
    if section.get("status") == "error" and not known:  # the data directory is a setting (SFSTORE_DATA_DIR)
        problems.append(ConfigProblem("error", f"data_dir {section.get('path')}", "data_dir",
                                      str(section.get("reason"))))
    n_err = sum(p.severity == "error" for p in problems)
    routing["configuration"] = {
        "file": config_file,
        "status": "error" if n_err else "warning" if problems else "ok",
        "problems": [{"severity": p.severity, "source": p.source, "key": p.key, "line": p.line,
                      "message": p.message} for p in problems],
    }
    report["routing"] = routing
    if args.json:
        json.dump(report, sys.stdout, indent=2, sort_keys=False, default=str)
        sys.stdout.write("\n")
    else:
        block: list[str] = []
        if problems:
            n_warn = len(problems) - n_err
            count = ", ".join(f"{n} {what}(s)" for n, what in ((n_err, "error"), (n_warn, "warning")) if n)
            block = [f"configuration  {'error' if n_err else 'warning'}  ({count})"]
            block += ["    " + str(p) for p in problems]
        print("\n".join(block + [format_table({k: v for k, v in report.items() if k != "routing"}), "routing"]
                        + ["    " + line for line in routing_text.splitlines()] + block))
    if n_err:
        print(f"sfstore probe: the configuration has {n_err} error(s), listed above", file=sys.stderr)
        return 1
    return 0


def _add_probe(sub: Subparsers) -> None:
    p = sub.add_parser("probe", help="report the I/O engine, memory, data directory, RDMA, NFS, NVMe-oF, GDS, GPUs",
                       description="Report what this host offers sfstore. Absent hardware is reported as absent.")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--config", metavar="FILE", default=None,
                   help="sfstore config file (default: SFSTORE_CONFIG, ./sfstore.toml, ~/.config/sfstore/)")
    p.add_argument("--data-dir", metavar="PATH", default=None,
                   help="data directory to check (default: the data_dir setting, SFSTORE_DATA_DIR)")
    p.set_defaults(func=_cmd_probe)


def _cmd_config_check(args: argparse.Namespace) -> int:
    import warnings

    from sfstore.config_check import check, report
    from sfstore.errors import ConfigWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        config_file, problems = check(args.file, unknown_variables="error")  # a misspelt name sets nothing
    print(report(config_file, problems))
    return 1 if any(p.severity == "error" for p in problems) else 0


def _add_config(sub: Subparsers) -> None:
    p = sub.add_parser("config", help="check a configuration: the config file and every SFSTORE_* variable",
                       description="Commands on sfstore's configuration.")
    csub = p.add_subparsers(dest="config_command", metavar="COMMAND")
    q = csub.add_parser(
        "check", help="validate a config file and the SFSTORE_* variables; exit 1 on any error",
        description="Validate FILE (default: the config that applies: SFSTORE_CONFIG, ./sfstore.toml, "
                    "~/.config/sfstore/sfstore.toml) and every SFSTORE_* environment variable: TOML syntax, "
                    "unknown or misspelt keys and variables, bad values, [classes.*] tables, roots that do not "
                    "exist. Every problem is printed; the exit status is 1 when any is an error (an SFSTORE_* "
                    "name sfstore does not read is one), else 0.")
    q.add_argument("file", metavar="FILE", nargs="?", default=None, help="the config file to check")
    q.set_defaults(func=_cmd_config_check)

    def usage(args: argparse.Namespace) -> int:
        p.print_help(sys.stderr)
        return 2

    p.set_defaults(func=usage)


def _cmd_demo(args: argparse.Namespace) -> int:
    from sfstore.defaults import SETTINGS
    from sfstore.demo import run_demo

    size = SETTINGS["buffer_size"].parse(args.size, "--size")
    return run_demo(data_dir=args.data_dir, size=size, show_probe=not args.no_probe, config=args.config,
                    json_out=args.json, shards=args.shards)


def _add_demo(sub: Subparsers) -> None:
    p = sub.add_parser("demo", help="show what sfstore does, on the embedded default data directory",
                       description="A training job (dataset over sf://, DataLoader, save_async, a crash and a "
                                   "resume) and an inference job (KV-cache reuse across tiers), hot blocks, then a "
                                   "per-path summary. Everything read back is verified.")
    p.add_argument("--config", metavar="FILE", default=None,
                   help="sfstore config file: run on a real cluster's paths (default: the embedded default)")
    p.add_argument("--json", metavar="FILE", default=None, help="also write the summary as JSON")
    p.add_argument("--shards", type=int, default=32, help="dataset shards of 512 samples (default 32)")
    p.add_argument("--data-dir", metavar="PATH", default=None,
                   help="data directory (default: the data_dir setting, SFSTORE_DATA_DIR)")
    p.add_argument("--size", default="64m", help="bytes for the file path's round trip (default 64m)")
    p.add_argument("--no-probe", action="store_true", help="skip the probe table")
    p.set_defaults(func=_cmd_demo)


# -- ls and cp ---------------------------------------------------------------------------------------------

_SMALL_FILE = 1 << 20  # sf:// -> local: files up to this size are read in pipelined batches (FilePath.read_many)
_BATCH_FILES = 256
_BATCH_BYTES = 64 << 20


def _is_sf(path: str) -> bool:
    return path.startswith("sf://") or path.startswith("sf::")


def _refuse_other_schemes(*paths: str, local: bool = False) -> None:
    """Refuse a URL of another scheme (``s3://b/x``) before it is taken for a name beneath the root (or, for
    ``cp``, for a local path: ``local``)."""
    from sfstore.fs import other_scheme

    for path in paths:
        scheme = other_scheme(path)
        if scheme is not None:
            takes = "sf:// URLs and local paths" if local else "sf:// URLs and paths beneath the sf:// root"
            raise errors.InvalidRequestError(f"{path}: {scheme}:// URLs are not supported here; this command "
                                             f"takes {takes}")


def _sf_url(path: str) -> str:
    """An ``sf://`` URL for a command's PATH argument: a URL as it is, a path as one beneath the root."""
    _refuse_other_schemes(path)
    return path if _is_sf(path) else "sf://" + path.lstrip("/")


def _open_fs(args: argparse.Namespace) -> SFFileSystem:
    from sfstore.fs import SFFileSystem

    return SFFileSystem(root=args.root, config=args.config)


def _local_error(exc: OSError, context: str, path: str) -> SfstoreError:
    if isinstance(exc, SfstoreError):
        return exc
    return errors.os_error(exc.errno or errno.EIO, context, exc.filename or path)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover - the loop always returns


class Progress:
    """A plain-text progress bar of bytes and files on ``stream`` (stderr).

    On a terminal it redraws one line in place (``\\r``) at most ten times a second; elsewhere (a pipe, a log)
    it prints only the final line. It is an fsspec callback too: ``relative_update(n)`` adds ``n`` bytes.
    """

    def __init__(self, total_bytes: int, total_files: int, stream: IO[str] | None = None, verb: str = "copied"):
        self.total_bytes, self.total_files, self.verb = total_bytes, total_files, verb
        self.bytes = 0
        self.files = 0
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._start = time.monotonic()
        self._drawn = 0.0
        self._width = 0

    def set_size(self, size: int) -> None:
        """fsspec callback protocol: ignored (the totals are known up front)."""

    def relative_update(self, inc: int = 1) -> None:
        self.bytes += inc
        self._draw()

    def file_done(self) -> None:
        self.files += 1
        self._draw()

    def _line(self) -> str:
        elapsed = max(time.monotonic() - self._start, 1e-9)
        rate = _human(self.bytes / elapsed) + "/s"
        pct = 100.0 * self.bytes / self.total_bytes if self.total_bytes else 100.0
        width = 24
        fill = int(width * pct / 100)
        bar = "#" * fill + "-" * (width - fill)
        return (f"[{bar}] {pct:5.1f}%  {_human(self.bytes)} / {_human(self.total_bytes)}  "
                f"{self.files}/{self.total_files} files  {rate}")

    def _draw(self, force: bool = False) -> None:
        if not self.tty:
            return
        now = time.monotonic()
        if not force and now - self._drawn < 0.1:
            return
        self._drawn = now
        line = self._line()
        self.stream.write("\r" + line.ljust(self._width))
        self._width = len(line)
        self.stream.flush()

    def finish(self, ok: bool = True) -> None:
        """The final line: the bar on a terminal, a summary elsewhere. After a failure (``ok=False``) no summary
        is written (the error says what happened); a bar drawn on a terminal is ended so the error starts a line."""
        elapsed = max(time.monotonic() - self._start, 1e-9)
        if not ok:
            if self.tty and self._width:
                self.stream.write("\n")
                self.stream.flush()
            return
        if self.tty:
            self._draw(force=True)
            self.stream.write("\n")
        else:
            self.stream.write(
                f"{self.verb} {self.files} file{'s' if self.files != 1 else ''}, {_human(self.bytes)} in "
                f"{elapsed:.2f} s ({_human(self.bytes / elapsed)}/s)\n"
            )
        self.stream.flush()


def _ls_line(fs: SFFileSystem, info: dict[str, Any], long: bool) -> str:
    url = fs.unstrip_protocol(info["name"])
    if info["type"] == "directory" and not url.endswith("/"):
        url += "/"
    if not long:
        return url
    kind = {"directory": "d", "file": "-"}.get(info["type"], "?")
    if info.get("islink"):
        kind = "l"
    when = datetime.datetime.fromtimestamp(info.get("mtime", 0)).strftime("%Y-%m-%d %H:%M")
    return f"{kind} {info.get('size') or 0:>14} {when} {url}"


def _os_errors_typed(func: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Turn a stray ``OSError`` of a local path into sfstore's typed error (printed without a traceback)."""

    def run(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except (SfstoreError, BrokenPipeError):  # a closed stdout is main's to answer (`sfstore ls | head`)
            raise
        except OSError as exc:
            raise _local_error(exc, "cannot access", str(exc.filename or "")) from None

    return run


@_os_errors_typed
def _cmd_ls(args: argparse.Namespace) -> int:
    path = _sf_url(args.path)
    fs = _open_fs(args)
    info = fs.info(path)
    if info["type"] != "directory":
        entries = [info]
    elif args.recursive:
        found = fs.find(info["name"], withdirs=True, detail=True)  # root-relative names, as info's
        entries = [found[k] for k in sorted(found) if k != info["name"]]
    else:
        entries = fs.ls(path, detail=True)
    for entry in entries:
        print(_ls_line(fs, entry, args.long))
    return 0


def _add_ls(sub: Subparsers) -> None:
    p = sub.add_parser("ls", help="list sf:// paths (the dataset root)",
                       description="List a directory (or a file) under the sf:// root as sf:// URLs; "
                                   "directories end with '/'.")
    p.add_argument("path", nargs="?", default="sf://", metavar="PATH",
                   help="sf:// URL or root-relative path (default: the root)")
    p.add_argument("-l", "--long", action="store_true", help="type, size, modification time")
    p.add_argument("-R", "--recursive", action="store_true", help="everything below PATH")
    _add_root_options(p)
    p.set_defaults(func=_cmd_ls)


def _add_root_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--root", metavar="DIR", default=None,
                   help="directory sf:// names (default: SFSTORE_ROOT, the config file's root, SFSTORE_DATA_DIR)")
    p.add_argument("--config", metavar="FILE", default=None, help="sfstore config file (default: SFSTORE_CONFIG)")


def _local_tree(src: str) -> tuple[list[str], list[tuple[str, int]], list[str]]:
    """Directories and (file, size) pairs below ``src`` as paths relative to it, and skipped symlinked dirs."""
    dirs: list[str] = []
    files: list[tuple[str, int]] = []
    skipped: list[str] = []

    def fail(exc: OSError) -> None:
        raise _local_error(exc, "cannot read", str(exc.filename or src))

    for top, dirnames, filenames in os.walk(src, onerror=fail):
        rel = os.path.relpath(top, src)
        rel = "" if rel == "." else rel
        for d in sorted(dirnames):
            full = os.path.join(top, d)
            if os.path.islink(full):
                skipped.append(full)
            else:
                dirs.append(os.path.join(rel, d))
        dirnames[:] = sorted(d for d in dirnames if not os.path.islink(os.path.join(top, d)))
        for f in sorted(filenames):
            full = os.path.join(top, f)
            try:
                st = os.stat(full)
            except OSError as exc:
                raise _local_error(exc, "cannot read", full) from None
            if stat.S_ISREG(st.st_mode):
                files.append((os.path.join(rel, f), st.st_size))
            else:
                skipped.append(full)
    return dirs, files, skipped


def _sf_tree(fs: SFFileSystem, src: str) -> tuple[list[str], list[tuple[str, int]], list[str]]:
    base = fs.name_of(src)
    found = fs.find(base, withdirs=True, detail=True)  # root-relative names (find spells them as it is given)
    dirs: list[str] = []
    files: list[tuple[str, int]] = []
    skipped: list[str] = []
    for name in sorted(found):
        if name == base:
            continue
        rel = name[len(base) + 1:] if base else name
        info = found[name]
        if info["type"] == "directory":
            dirs.append(rel)
        elif info["type"] == "file":
            files.append((rel, int(info["size"])))
        else:
            skipped.append(fs.unstrip_protocol(name))
    return dirs, files, skipped


def _write_local(path: str, data: bytes) -> None:
    """Write ``data`` to the local ``path`` through a temporary name in its directory, then rename; an existing
    FIFO, device, socket or symlink (``/dev/stdout``) is written in place instead."""
    from sfstore.fs import open_in_place, write_all, writes_in_place

    if writes_in_place(os.path.abspath(path)):
        fd = open_in_place(os.path.abspath(path))
        try:
            write_all(fd, data, path)
        finally:
            os.close(fd)
        return
    head, tail = os.path.split(os.path.abspath(path))
    try:
        dirfd = os.open(head, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            records.write_atomically(dirfd, tail, data, kind="part")
        finally:
            os.close(dirfd)
    except OSError as exc:  # named as the file asked for, never its temporary name
        raise errors.os_error(exc.errno or errno.EIO, "cannot write", path) from None


@_os_errors_typed
def _cmd_cp(args: argparse.Namespace) -> int:
    src, dst = args.src, args.dst
    _refuse_other_schemes(src, dst, local=True)
    if not _is_sf(src) and not _is_sf(dst):
        raise errors.InvalidRequestError("one of SRC and DST must be an sf:// URL (local to local: use cp)")
    fs = _open_fs(args)
    if src == "-" or dst == "-":
        return _cp_std(fs, args)

    # What the source is.
    if _is_sf(src):
        src_info = fs.info(src)
        src_is_dir = src_info["type"] == "directory"
        src_base = posixpath.basename(fs.name_of(src)) or "root"
    else:
        try:
            src_is_dir = stat.S_ISDIR(os.stat(src).st_mode)
        except OSError as exc:
            raise _local_error(exc, "cannot read", src) from None
        src_base = os.path.basename(os.path.normpath(os.path.abspath(src)))
    if src_is_dir and not args.recursive:
        raise errors.InvalidRequestError(f"{src} is a directory (not copied; use -r)")

    # Where it goes: into DST when DST is an existing directory (or ends with '/'), else DST itself.
    if _is_sf(dst):
        dst_is_dir = dst.endswith("/") or fs.isdir(dst)
        join: Callable[..., str] = posixpath.join
        target = fs.name_of(dst)
    else:
        dst_is_dir = dst.endswith(os.sep) or os.path.isdir(dst)
        join = os.path.join
        target = os.path.abspath(dst)
    if dst_is_dir:
        target = join(target, src_base)

    # The plan: directories to make, files to copy (relative to the source), for the progress totals.
    if src_is_dir:
        dirs, files, skipped = _sf_tree(fs, src) if _is_sf(src) else _local_tree(src)
        dirs = ["", *dirs]
    else:
        size = int(src_info["size"]) if _is_sf(src) else os.stat(src).st_size
        dirs, files, skipped = [], [("", size)], []
    for s in skipped:
        print(f"sfstore cp: skipped {s} (not a regular file or directory)", file=sys.stderr)

    def src_of(rel: str) -> str:
        if _is_sf(src):
            return posixpath.join(fs.name_of(src), rel) if rel else fs.name_of(src)
        return os.path.join(src, rel) if rel else src

    def dst_of(rel: str) -> str:
        return join(target, rel.replace(os.sep, "/") if join is posixpath.join else rel) if rel else target

    progress = Progress(sum(n for _, n in files), len(files))
    ok = False
    try:
        for rel in dirs:
            if _is_sf(dst):
                fs.makedirs(dst_of(rel), exist_ok=True)
            else:
                try:
                    os.makedirs(dst_of(rel), exist_ok=True)
                except OSError as exc:
                    raise _local_error(exc, "cannot make directory", dst_of(rel)) from None
        if not _is_sf(src):  # local -> sf://
            for rel, _ in files:
                try:
                    fs.put_file(src_of(rel), dst_of(rel), callback=progress)
                except OSError as exc:
                    raise _local_error(exc, "cannot copy", src_of(rel)) from None
                progress.file_done()
        elif _is_sf(dst):  # sf:// -> sf://
            for rel, _ in files:
                fs.cp_file(src_of(rel), dst_of(rel), callback=progress)
                progress.file_done()
        else:  # sf:// -> local: small files in pipelined batches, large ones streamed
            batch: list[str] = []
            batch_bytes = 0

            def flush() -> None:
                nonlocal batch, batch_bytes
                if not batch:
                    return
                got = fs.cat([src_of(r) for r in batch], on_error="raise")
                assert isinstance(got, dict)
                for r in batch:
                    data = got[fs.name_of(src_of(r))]
                    assert isinstance(data, bytes)
                    _write_local(dst_of(r), data)
                    progress.relative_update(len(data))
                    progress.file_done()
                batch, batch_bytes = [], 0

            for rel, size in files:
                if size <= _SMALL_FILE:
                    batch.append(rel)
                    batch_bytes += size
                    if len(batch) >= _BATCH_FILES or batch_bytes >= _BATCH_BYTES:
                        flush()
                    continue
                try:
                    fs.get_file(src_of(rel), dst_of(rel), callback=progress)
                except OSError as exc:
                    raise _local_error(exc, "cannot copy", src_of(rel)) from None
                progress.file_done()
            flush()
        ok = True
    finally:
        progress.finish(ok)
    return 0


def _cp_std(fs: SFFileSystem, args: argparse.Namespace) -> int:
    """``sfstore cp sf://x -`` (the file to stdout) and ``sfstore cp - sf://x`` (stdin into the file)."""
    if args.recursive:
        raise errors.InvalidRequestError("-r copies directories: stdin and stdout ('-') hold one file")
    progress = Progress(0, 1)
    ok = False
    try:
        if args.dst == "-":
            info = fs.info(args.src)
            if info["type"] == "directory":
                raise errors.InvalidRequestError(f"{args.src} is a directory: it cannot be written to stdout")
            progress.total_bytes = int(info["size"])
            out = sys.stdout.buffer
            out.flush()
            fs.get_file(args.src, None, callback=progress, outfile=out)
            out.flush()
        else:
            if args.dst.endswith("/") or fs.isdir(args.dst):
                raise errors.InvalidRequestError(f"{args.dst} is a directory: stdin needs a file name to go to")
            progress.total_bytes = fs.put_fd(sys.stdin.buffer.fileno(), args.dst, name="<stdin>", callback=progress)
        progress.file_done()
        ok = True
    finally:
        progress.finish(ok)
    return 0


def _add_cp(sub: Subparsers) -> None:
    p = sub.add_parser("cp", help="copy between local paths and sf:// (datasets in and out), with progress",
                       description="Copy SRC to DST; one of them is an sf:// URL. As with cp, a DST that is an "
                                   "existing directory (or ends with '/') receives SRC inside it. Every file is "
                                   "written to a temporary name and renamed into place, except an existing "
                                   "FIFO, device or symlink (and /dev/stdout and the like): those are written "
                                   "in place. '-' is stdout as DST, stdin as SRC. Progress (bytes, files) "
                                   "goes to stderr.")
    p.add_argument("src", metavar="SRC", help="local path, sf:// URL, or - (stdin)")
    p.add_argument("dst", metavar="DST", help="local path, sf:// URL, or - (stdout)")
    p.add_argument("-r", "--recursive", action="store_true", help="copy directories and what they hold")
    _add_root_options(p)
    p.set_defaults(func=_cmd_cp)


class _Stdout:
    """A sink for :meth:`SFFileSystem.get_file` writing each block to file descriptor 1 as it arrives (a pipe
    takes it in pieces), so ``cat`` holds one or two readahead blocks, never a whole file."""

    def write(self, data: Any) -> None:
        from sfstore.fs import write_all

        write_all(1, data, "<stdout>")


@_os_errors_typed
def _cmd_cat(args: argparse.Namespace) -> int:
    urls = [_sf_url(u) for u in args.urls]
    fs = _open_fs(args)
    # Every name is checked before the first byte goes out: a missing file fails the command with nothing
    # written, rather than after the files before it (a reader such as tarfile would see a short stream).
    for url in urls:
        if fs.info(url)["type"] == "directory":
            raise errors.InvalidRequestError(f"{url} is a directory: cat writes files")
    sys.stdout.flush()
    sink = _Stdout()
    try:
        for url in urls:
            fs.get_file(url, None, outfile=sink)
    except OSError as exc:
        if exc.errno == errno.EPIPE:  # the reader stopped early (`| head`, a webdataset pipe closed): not an error
            return 0
        raise
    return 0


def _add_cat(sub: Subparsers) -> None:
    p = sub.add_parser("cat", help="write sf:// files to stdout (for pipes: webdataset's pipe:, tar, ...)",
                       description="Write the bytes of each sf:// file to stdout, in order, streamed in "
                                   "blocks. A missing file (or a directory) is an error before anything is "
                                   "written. For webdataset: "
                                   "WebDataset('pipe:sfstore cat sf://shards/train-{000000..000099}.tar').")
    p.add_argument("urls", nargs="+", metavar="URL", help="sf:// URL or root-relative path")
    _add_root_options(p)
    p.set_defaults(func=_cmd_cat)


# -- rm ----------------------------------------------------------------------------------------------------


@_os_errors_typed
def _cmd_rm(args: argparse.Namespace) -> int:
    urls = [_sf_url(u) for u in args.urls]
    fs = _open_fs(args)
    failed = 0
    for given, url in zip(args.urls, urls, strict=True):
        try:
            if fs.name_of(url) == "":
                raise errors.InvalidRequestError(f"{given}: refusing to remove the sf:// root")
            if not args.recursive and not any(c in url for c in "*?[") and fs.isdir(url):
                raise errors.InvalidRequestError(f"{given} is a directory (not removed; use -r)")
            fs.rm(url, recursive=args.recursive)
        except SfstoreError as exc:
            if args.force and isinstance(exc, FileNotFoundError):
                continue
            print(f"sfstore rm: error: {_message(exc)}", file=sys.stderr)
            failed += 1
    return 1 if failed else 0


def _add_rm(sub: Subparsers) -> None:
    p = sub.add_parser("rm", help="remove sf:// files (and with -r, directories)",
                       description="Remove each sf:// file; with -r, directories and everything below them "
                                   "(symlinks are removed, never followed). A directory without -r is refused, "
                                   "and so is the sf:// root. Each PATH is tried; the exit status is 1 if any "
                                   "failed.")
    p.add_argument("urls", nargs="+", metavar="PATH", help="sf:// URL or root-relative path (globs: quote them)")
    p.add_argument("-r", "-R", "--recursive", action="store_true", help="remove directories and what they hold")
    p.add_argument("-f", "--force", action="store_true", help="a missing PATH is not an error")
    _add_root_options(p)
    p.set_defaults(func=_cmd_rm)


# -- nvme --------------------------------------------------------------------------------------------------


def _nvme_target(args: argparse.Namespace) -> Any:
    from sfstore.nvme import NvmeofTarget

    return NvmeofTarget(args.transport, args.traddr or "", args.trsvcid or "", args.nqn or "", hostnqn=args.hostnqn)


def _print_controllers(ctrls: Sequence[Any]) -> None:
    from sfstore.probe import grid

    rows = []
    for c in ctrls:
        address = f"{c.traddr}:{c.trsvcid}" if c.trsvcid else (c.traddr or "-")
        namespaces = [f"{n.device} ({_human(n.capacity)}, {n.lba_size} B blocks)" for n in c.namespaces]
        rows.append([c.name, c.transport, address, c.subsysnqn, c.state, namespaces])
    for line in grid(["CONTROLLER", "TRANSPORT", "ADDRESS", "SUBSYSNQN", "STATE", "NAMESPACES"], rows, indent=""):
        print(line)


def _cmd_nvme_list(args: argparse.Namespace) -> int:
    from sfstore import nvme

    ctrls = nvme.list_controllers()
    if args.json:
        json.dump([c.to_dict() for c in ctrls], sys.stdout, indent=2)
        sys.stdout.write("\n")
    elif not ctrls:
        print("no NVMe controllers")
    else:
        _print_controllers(ctrls)
    return 0


def _cmd_nvme_discover(args: argparse.Namespace) -> int:
    from sfstore import nvme
    from sfstore.probe import grid

    target = _nvme_target(args)
    entries = nvme.discover(target, timeout=args.timeout)
    if args.nqn:
        entries = [e for e in entries if e["subsysnqn"] == args.nqn]
    if args.json:
        json.dump(entries, sys.stdout, indent=2)
        sys.stdout.write("\n")
    elif not entries:
        print(f"no subsystems offered at {target.transport} {target.traddr}:{target.trsvcid}"
              + (f" with NQN {args.nqn}" if args.nqn else ""))
    else:
        for line in grid(["SUBTYPE", "TRANSPORT", "TRADDR", "TRSVCID", "SUBSYSNQN"],
                          [[e["subtype"], e["transport"], e["traddr"], e["trsvcid"], e["subsysnqn"]]
                           for e in entries], indent=""):
            print(line)
    return 0


def _cmd_nvme_connect(args: argparse.Namespace) -> int:
    from sfstore import nvme

    ctrl = nvme.connect(_nvme_target(args), timeout=args.timeout)
    if args.json:
        json.dump(ctrl.to_dict(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        _print_controllers([ctrl])
    return 0


def _cmd_nvme_disconnect(args: argparse.Namespace) -> int:
    from sfstore import nvme

    if args.name and (args.nqn or args.traddr):
        raise errors.InvalidRequestError("give a controller NAME or -n NQN (with -t/-a/-s), not both")
    if args.name:
        what, names = args.name, [args.name]
    elif not args.nqn:
        raise errors.InvalidRequestError("name the controller (nvme0) or its subsystem (-n NQN)")
    elif args.traddr:
        target = _nvme_target(args)
        what, names = str(target), [target]
    else:  # every controller of the subsystem, wherever it is connected
        what = args.nqn
        names = [c.name for c in nvme.list_controllers() if c.subsysnqn == args.nqn]
    done = [n for n in names if nvme.disconnect(n)]
    if done:
        print(f"disconnected {what}")
    else:
        print(f"nothing to disconnect: no controller of {what} is connected")
    return 0


def _add_nvme_target_options(p: argparse.ArgumentParser, nqn_required: bool) -> None:
    p.add_argument("-t", "--transport", default="rdma", choices=["rdma", "tcp", "loop"],
                   help="fabrics transport (default rdma)")
    p.add_argument("-a", "--traddr", metavar="ADDR", default=None, help="target address (rdma, tcp)")
    p.add_argument("-s", "--trsvcid", metavar="PORT", default=None, help="target port (default 4420)")
    p.add_argument("-n", "--nqn", "--subsysnqn", dest="nqn", metavar="NQN", required=nqn_required, default=None,
                   help="subsystem NQN" + ("" if nqn_required else " (discover: show only this subsystem)"))
    p.add_argument("--hostnqn", metavar="NQN", default=None, help="this host's NQN (default /etc/nvme/hostnqn)")


def _add_nvme(sub: Subparsers) -> None:
    p = sub.add_parser("nvme", help="NVMe over Fabrics: list, discover, connect, disconnect controllers",
                       description="NVMe-oF controllers through libnvme (the block path's transport). "
                                   "discover, connect and disconnect need root and the nvme-fabrics module.")
    nsub = p.add_subparsers(dest="nvme_command", metavar="ACTION", required=True)

    q = nsub.add_parser("list", help="NVMe controllers of this host with their namespaces (from sysfs)",
                        description="List this host's NVMe controllers (local PCIe and NVMe-oF) with their "
                                    "transport, address, subsystem NQN, state and namespaces, read from sysfs. "
                                    "Needs no root.")
    q.add_argument("--json", action="store_true", help="print JSON")
    q.set_defaults(func=_cmd_nvme_list)

    q = nsub.add_parser("discover", help="the subsystems a target offers (its discovery log page)",
                        description="Ask an NVMe-oF target's discovery controller (-t, -a, -s) which subsystems "
                                    "it offers, and print its discovery log page; -n shows one subsystem. Needs "
                                    "root and the nvme-fabrics module.")
    _add_nvme_target_options(q, nqn_required=False)
    q.add_argument("--timeout", type=float, default=30.0, metavar="SECONDS", help="default 30")
    q.add_argument("--json", action="store_true", help="print JSON")
    q.set_defaults(func=_cmd_nvme_discover)

    q = nsub.add_parser("connect", help="connect a subsystem (idempotent) and wait for its namespaces",
                        description="Connect the subsystem -n NQN at -t/-a/-s and wait (--timeout) until its "
                                    "namespaces appear as /dev/nvmeXnY; an existing connection is reused. The "
                                    "block path (BlockPath) then opens the namespace. Needs root and the "
                                    "nvme-fabrics module.")
    _add_nvme_target_options(q, nqn_required=True)
    q.add_argument("--timeout", type=float, default=30.0, metavar="SECONDS", help="default 30")
    q.add_argument("--json", action="store_true", help="print the controller as JSON")
    q.set_defaults(func=_cmd_nvme_connect)

    q = nsub.add_parser("disconnect", help="disconnect a controller (by name) or a subsystem's controllers",
                        description="Disconnect one controller by NAME (nvme0), or with -n NQN every controller "
                                    "of that subsystem (narrowed to one target with -t/-a/-s). Needs root.")
    q.add_argument("name", nargs="?", metavar="NAME", default=None, help="controller name (nvme0)")
    _add_nvme_target_options(q, nqn_required=False)
    q.set_defaults(func=_cmd_nvme_disconnect)


def _kv_budgets(args: argparse.Namespace) -> list[tuple[str, Any]]:
    """One :class:`~sfstore.kvcache.shared_budget.SharedBudget` per namespace the command names (all that are
    there without ``--namespace``) of the shared directory ``DIR`` (default: the router's, as
    ``KVCacheStore.from_router`` uses it), with that directory relative to the budget's file path."""
    from sfstore import defaults
    from sfstore.kvcache.shared_budget import SharedBudget, check_namespace, list_namespaces, namespace_prefix
    from sfstore.paths.file import FilePath

    budget = (defaults.SETTINGS["kvcache_shared_bytes"].parse(args.budget, "--budget") if args.budget is not None
              else int(defaults.get("kvcache_shared_bytes")))
    if args.dir is not None:
        if not os.path.isdir(args.dir):
            raise errors.os_error(errno.ENOENT, "no shared KV directory", os.path.abspath(args.dir))
        fp: Any = FilePath(args.dir, create=False)
        top = ""
    else:
        kv_path = sfstore.open(args.config).path("kvcache")
        fp, top = getattr(kv_path, "fp", None) or kv_path, "shared/"
    names = [check_namespace(args.namespace)] if args.namespace is not None else list_namespaces(fp, top)
    return [(top, SharedBudget(fp, top + namespace_prefix(n), budget, namespace=n)) for n in names]


def _kv_each(args: argparse.Namespace, call: Callable[[str, Any], dict[str, Any]]) -> list[dict[str, Any]]:
    """``call(top, budget)`` for each namespace, with a failed system call as a typed error (naming the path)."""
    try:
        return [call(top, b) for top, b in _kv_budgets(args)]
    except SfstoreError:
        raise
    except OSError as exc:
        raise errors.os_error(exc.errno or errno.EIO, exc.strerror or "shared KV directory",
                              str(exc.filename or args.dir or "")) from None


def _cmd_kv_du(args: argparse.Namespace) -> int:
    from sfstore.probe import grid, quarantine_rows

    rows = _kv_each(args, lambda top, b: {**b.du(), "directory": os.path.join(b.fp.root, top)})
    if args.json:
        json.dump(rows, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    print(f"shared KV directory {rows[0]['directory']}")
    for line in grid(["NAMESPACE", "BYTES", "FILES", "ESTIMATE", "BUDGET", "WRITERS", "LEFTOVERS"], [
            [r["namespace"] or "(default)", _human(r["bytes"]), r["files"], _human(r["estimate"]),
             _human(r["budget"]) if r["budget"] else "unbounded", r["writers"], r["evicting"] + r["temporaries"]]
            for r in rows], indent=""):
        print(line)
    over = [r for r in rows if r["budget"] and r["bytes"] > r["budget"]]
    if over:
        print(f"over budget: {', '.join(r['namespace'] or '(default)' for r in over)} (sfstore kv gc enforces it)")
    quarantined = [[r["namespace"] or "(default)", *row] for r in rows for row in quarantine_rows(r["quarantined"])]
    if quarantined:
        print("quarantined by processes whose I/O to it missed its deadline:")
        for line in grid(["NAMESPACE", "HOST", "PID", "TIER", "TARGET", "SINCE", "LEFT", "STUCK", "REASON"],
                          quarantined, indent="  "):
            print(line)
    return 0


def _cmd_kv_gc(args: argparse.Namespace) -> int:
    from sfstore.probe import grid

    rows = _kv_each(args, lambda _top, b: b.gc(grace_s=args.grace))
    if args.json:
        json.dump(rows, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    for line in grid(["NAMESPACE", "BEFORE", "AFTER", "EVICTED", "BUDGET", "LEFTOVERS REMOVED", "RECORDS REMOVED"], [
            [r["namespace"] or "(default)", _human(r["bytes_before"]), _human(r["bytes_after"]), r["evicted"],
             _human(r["budget"]) if r["budget"] else "unbounded", r["evicting_removed"] + r["temporaries_removed"],
             r["records_removed"]] for r in rows], indent=""):
        print(line)
    return 0


def _add_kv(sub: Subparsers) -> None:
    p = sub.add_parser("kv", help="the KV cache's shared directory: bytes held per namespace, and its budget",
                       description="The shared tier of KVCacheStore: du shows the bytes each cache namespace holds "
                                   "and its budget; gc repairs (leftovers of killed writers and evictors, stale "
                                   "records) and evicts least recently read blocks down to the budget now.")
    ksub = p.add_subparsers(dest="kv_command", metavar="ACTION", required=True)
    for name, func, text in (("du", _cmd_kv_du, "bytes and files held per namespace, the estimate writers keep, "
                                                 "the budget"),
                             ("gc", _cmd_kv_gc, "remove leftovers and evict down to the budget now")):
        q = ksub.add_parser(name, help=text)
        q.add_argument("dir", nargs="?", metavar="DIR", default=None,
                       help="the shared directory (default: the kvcache class's, as KVCacheStore.from_router uses)")
        q.add_argument("--namespace", "-n", metavar="N", default=None, help="only this cache namespace")
        q.add_argument("--budget", metavar="BYTES", default=None,
                       help="bytes per namespace, e.g. 64g (default: kvcache_shared_bytes; 0: unbounded)")
        q.add_argument("--config", metavar="FILE", default=None, help="sfstore config file (without DIR)")
        q.add_argument("--json", action="store_true", help="print JSON")
        if name == "gc":
            q.add_argument("--grace", type=float, default=600.0, metavar="SECONDS",
                           help="remove temporary files older than this whatever their writer (default 600)")
        q.set_defaults(func=func)


SUBCOMMANDS: list[Callable[[Subparsers], None]] = [_add_probe, _add_config, _add_demo, _add_ls, _add_cp, _add_cat,
                                                   _add_rm, _add_nvme, _add_kv]


def _message(exc: SfstoreError) -> str:
    """What went wrong, for a person: an OS error as ``cannot open sf://x: No such file or directory`` (what was
    asked, the path as given, the reason), without Python's ``[Errno 2]`` prefix."""
    if isinstance(exc, OSError) and exc.strerror and exc.filename is not None:
        what, sep, why = str(exc.strerror).rpartition(": ")
        return f"{what} {exc.filename}: {why}" if sep else f"{exc.filename}: {exc.strerror}"
    if isinstance(exc, OSError) and exc.strerror:
        return str(exc.strerror)
    return str(exc)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand."""
    parser = argparse.ArgumentParser(
        prog="sfstore", description="Direct storage paths for AI jobs on RDMA clusters.")
    parser.add_argument("--version", action="version", version=f"sfstore {sfstore.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``sfstore`` command; return its exit status (0 ok, 1 error, 2 usage)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] | None = getattr(args, "func", None)
    if func is None:
        parser.print_help(sys.stderr)
        return 2
    import warnings

    from sfstore.errors import SfstoreWarning

    shown = warnings.showwarning

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int, file: TextIO | None = None,
             line: str | None = None) -> None:
        # sfstore's own warnings (an unknown SFSTORE_* variable, ...) speak to the user, not about a source line.
        if issubclass(category, SfstoreWarning):
            print(f"sfstore {args.command}: warning: {message}", file=sys.stderr)
        else:
            shown(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    try:
        return func(args)
    except SfstoreError as exc:
        print(f"sfstore {args.command}: error: {_message(exc)}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `sfstore probe | head`
        return 0
    finally:
        warnings.showwarning = shown


if __name__ == "__main__":
    sys.exit(main())
