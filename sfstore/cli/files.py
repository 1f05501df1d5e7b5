"""``sfstore ls``, ``cp``, ``cat`` and ``rm``: files beneath the ``sf://`` root, and copies to and from local paths."""

from __future__ import annotations

import argparse
import datetime
import errno
import os
import posixpath
import stat
import sys
import time
from collections.abc import Callable
from typing import IO, TYPE_CHECKING, Any

from sfstore import errors, records
from sfstore.cli.common import Subparsers, human, message
from sfstore.errors import SfstoreError

if TYPE_CHECKING:
    from sfstore.fs import SFFileSystem

__all__ = ["add_ls", "add_cp", "add_cat", "add_rm", "Progress"]


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
        rate = human(self.bytes / elapsed) + "/s"
        pct = 100.0 * self.bytes / self.total_bytes if self.total_bytes else 100.0
        width = 24
        fill = int(width * pct / 100)
        bar = "#" * fill + "-" * (width - fill)
        return (f"[{bar}] {pct:5.1f}%  {human(self.bytes)} / {human(self.total_bytes)}  "
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
                f"{self.verb} {self.files} file{'s' if self.files != 1 else ''}, {human(self.bytes)} in "
                f"{elapsed:.2f} s ({human(self.bytes / elapsed)}/s)\n"
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


def add_ls(sub: Subparsers) -> None:
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


def add_cp(sub: Subparsers) -> None:
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


def add_cat(sub: Subparsers) -> None:
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
            print(f"sfstore rm: error: {message(exc)}", file=sys.stderr)
            failed += 1
    return 1 if failed else 0


def add_rm(sub: Subparsers) -> None:
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
