"""Name resolution confined to one root directory, free of check-then-use races.

Checking a name with ``realpath`` and then opening, renaming or removing it by name leaves a window: another
process that swaps a directory on the way for a symlink to somewhere else between the check and the use
sends the operation out of the root. :class:`Beneath` closes that window by never handing a full name to the
kernel. Every operation first opens the *parent directory* of its last component beneath the root — in one
``openat2(RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)`` call where the kernel has it, else one component at a
time with ``O_NOFOLLOW`` directory descriptors — and then acts on that last component relative to the
descriptor (``openat``, ``renameat``, ``unlinkat``, ``mkdirat``, ``linkat``, ``fstatat`` without following).
A directory descriptor keeps naming the directory it was opened on whatever is renamed meanwhile, so a swap
after the check can only make the operation fail, never leave.

Symlinks inside the root keep working: the kernel follows relative ones that stay beneath; absolute ones (and
those the kernel refuses for any other reason) are read with ``readlinkat`` and followed by this module, one
component at a time, keeping a stack of the directories walked so that ``..`` in a link's target climbs
physically and never above the root. A link that leads out raises
:class:`~sfstore.errors.PathEscapeError`. Recursive removal walks directory descriptors too, so a directory
swapped for a symlink half-way is removed as a link, never followed.

What stays outside the guarantee: a directory that is *moved* (renamed) out of the root while an operation
holds its descriptor is acted on where it now is (the kernel's ``RESOLVE_BENEATH`` has the same limit); that
needs write access both inside and outside the root, and moves only what was inside.

Errors are the operating system's: an ``OSError`` with ``errno`` and the host path as ``filename`` (callers
type them), or :class:`~sfstore.errors.PathEscapeError`.
"""

from __future__ import annotations

import errno
import functools
import os
import stat
import threading
from collections.abc import Callable
from typing import Any

from sfstore import errors, forks

__all__ = ["Beneath", "Location", "fold_parts", "open_at", "open_many_at", "stat_many_at"]

_O_PATH = getattr(os, "O_PATH", 0)
_DIR_FLAGS = _O_PATH | os.O_DIRECTORY | os.O_CLOEXEC
_MAX_HOPS = 40  # symlinks followed in one resolution (the kernel's MAXSYMLINKS)
_RETRIES = 8  # re-resolutions when a name changes kind between two system calls

# openat2 refusals that this module's own walk settles: EXDEV (would leave the root, or an absolute symlink),
# ELOOP (a magic link), EAGAIN (a concurrent rename under RESOLVE_BENEATH), and the codes of a kernel or a
# sandbox without openat2 (ENOSYS, EPERM, EINVAL/E2BIG for unknown flags).
_WALK_INSTEAD = frozenset(
    {errno.EXDEV, errno.ELOOP, errno.EAGAIN, errno.ENOSYS, errno.EPERM, errno.EINVAL, errno.E2BIG}
)


def _native_function(name: str) -> Any:
    """The native helper's function ``name``, or ``None`` without the helper (or in a build without it)."""
    try:
        from sfstore import _native
    except ImportError:
        return None
    return getattr(_native, name, None)


def _native_openat2() -> Any:
    return _native_function("open_beneath")


# Lookups of names beneath one directory descriptor, for callers that hold one (a tier's directory): openat2 in the
# native helper, many names in one call (one release of the GIL for a batch). None without the helper; a kernel
# without openat2 (before 5.6) switches them off for the process, and the callers go name by name with a walk.
_open_at = _native_openat2()
_open_many = _native_function("open_files_beneath")
_stat_many = _native_function("stat_files_beneath")


def _no_openat2() -> None:
    global _open_at, _open_many, _stat_many
    _open_at = _open_many = _stat_many = None


def open_at(dirfd: int, rel: str, flags: int) -> int | None:
    """``rel`` opened beneath the directory ``dirfd`` (``openat2(RESOLVE_BENEATH)``): its descriptor, or ``None``
    where the helper or the kernel has no such call (the caller walks instead); ``OSError`` for a failed open
    (``ENOENT``: not there; ``EXDEV``/``ELOOP``: a link out of the directory)."""
    call = _open_at
    if call is None:
        return None
    try:
        return int(call(dirfd, rel, flags, 0))
    except OSError as exc:
        if exc.errno != errno.ENOSYS:
            raise
        _no_openat2()
        return None


def open_many_at(dirfd: int, names: list[str], flags: int, size: int, direct: bool) -> list[tuple[int, ...]] | None:
    """Each of ``names`` opened beneath ``dirfd`` in one call: per name ``(fd, errno, mode, dev, ino, size,
    atime_ns, mtime_ns)`` (``fd`` < 0 where ``errno`` says why; a regular file of ``size`` bytes is switched to
    O_DIRECT with ``direct``); ``None`` where the helper or the kernel has no openat2 (nothing is left open).
    ``OSError`` when ``dirfd`` itself fails."""
    call = _open_many
    if call is None:
        return None
    got = [tuple(int(v) for v in g) for g in call(dirfd, names, flags, size, direct)]
    if any(g[1] == errno.ENOSYS for g in got):
        for g in got:
            if g[0] >= 0:
                os.close(g[0])
        _no_openat2()
        return None
    return got


def stat_many_at(dirfd: int, names: list[str], flags: int, leading: bool) -> list[int] | None:
    """The mode of what is at each of ``names`` beneath ``dirfd`` (``-errno`` where nothing is; with ``leading``,
    the list stops after the first miss), in one call; ``None`` where the helper or the kernel has no openat2."""
    call = _stat_many
    if call is None:
        return None
    modes = [int(m) for m in call(dirfd, names, flags, leading)]
    if any(m == -errno.ENOSYS for m in modes):
        _no_openat2()
        return None
    return modes


class Location:
    """A directory descriptor and a name in it: where an operation on one path acts.

    ``name`` is ``None`` when the path is the root itself. ``dirfd`` is closed by :meth:`close` (or the
    ``with`` block) unless it is the root's own descriptor.
    """

    __slots__ = ("_owned", "dirfd", "full", "name")

    def __init__(self, dirfd: int, name: str | None, full: str, owned: bool) -> None:
        self.dirfd, self.name, self.full, self._owned = dirfd, name, full, owned

    def detach(self) -> int:
        """A descriptor of the directory that the caller owns (a duplicate when this one is the root's)."""
        if self._owned:
            self._owned = False
            return self.dirfd
        return os.dup(self.dirfd)

    def close(self) -> None:
        if self._owned:
            self._owned = False
            os.close(self.dirfd)

    def __enter__(self) -> Location:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


def fold_parts(text: str, root: str) -> list[str]:
    """The components of the relative name ``text``, ``.`` and ``..`` folded lexically, repeated slashes
    counting once (``[]`` for the root itself).

    Raises :class:`~sfstore.errors.PathEscapeError` where ``..`` would climb above the root (``root`` names it
    in the message).
    """
    out: list[str] = []
    for part in text.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if not out:
                raise errors.PathEscapeError(f"path {text!r} climbs above {root}")
            out.pop()
        else:
            out.append(part)
    return out


class Beneath:
    """Operations on names relative to ``root`` that never act outside it (see the module notes).

    Parameters
    ----------
    root : str
        The root directory, absolute and with symlinks resolved (``os.path.realpath``).
    aliases : sequence of str, optional
        Other absolute spellings of the root (the path as the user gave it, before ``realpath``), so absolute
        names and absolute symlinks written with them resolve inside.

    Notes
    -----
    The root's descriptor is opened on first use and again in a forked child, so an instance works in
    ``DataLoader`` workers.
    """

    def __init__(self, root: str, aliases: tuple[str, ...] = ()) -> None:
        self.root = root
        self._aliases = tuple(a for a in {os.path.normpath(a) for a in aliases} if a != root)
        self._fd = -1
        self._lock = threading.Lock()
        self._openat2 = _native_openat2()
        forks.after_fork(self._after_fork_in_child)

    def _after_fork_in_child(self) -> None:
        # The child opens the root again on first use. The parent's descriptor, inherited, is left open as any
        # inherited descriptor is: the child's code may hold that number as its own.
        self._fd = -1
        self._lock = threading.Lock()

    # -- the root --------------------------------------------------------------------------------------------

    def root_fd(self) -> int:
        """The root's ``O_PATH`` descriptor (opened on first use; reopened in a forked child)."""
        if self._fd >= 0:
            return self._fd
        with self._lock:
            if self._fd < 0:
                self._fd = os.open(self.root, _DIR_FLAGS)
        return self._fd

    def close(self) -> None:
        """Close the root's descriptor (a later operation opens it again)."""
        with self._lock:
            fd, self._fd = self._fd, -1
            if fd >= 0:
                os.close(fd)

    def __del__(self) -> None:
        # Every FilePath has one of these: without this, each FilePath made and dropped (one per DCP
        # writer or reader, per DevicePath) would keep its root's descriptor open until the process ends.
        fd = getattr(self, "_fd", -1)
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass
            self._fd = -1

    # -- names -----------------------------------------------------------------------------------------------

    def parts(self, path: str | os.PathLike[str]) -> list[str]:
        """The components of ``path`` below the root, ``.`` and ``..`` folded (``[]`` for the root).

        ``path`` is relative to the root, or absolute inside it. Raises :class:`PathEscapeError` for a NUL
        byte, ``..`` above the root and an absolute path elsewhere.
        """
        text = os.fspath(path)
        if "\x00" in text:
            raise errors.PathEscapeError(f"path {text!r} contains a NUL byte")
        if os.path.isabs(text):
            rel = self._inside(text)
            if rel is None:
                raise errors.PathEscapeError(f"path {text!r} is outside the root {self.root}")
            return rel
        return fold_parts(text, f"the root {self.root}")

    def full(self, parts: list[str]) -> str:
        """The host path of root-relative ``parts`` (for messages)."""
        return os.path.join(self.root, *parts) if parts else self.root

    def _inside(self, absolute: str) -> list[str] | None:
        """Components below the root of an absolute name, or ``None`` if it names something outside.

        A name under the root (or an alias of it) is split as written. Any other is resolved with
        ``realpath`` (it may reach the root through a symlink elsewhere); that lookup only computes a name,
        which is then walked beneath the root like any other, so a race there cannot lead out either.
        """
        norm = os.path.normpath(absolute)
        for base in (self.root, *self._aliases):
            if norm == base:
                return []
            if norm.startswith(base.rstrip("/") + "/"):
                return [p for p in norm[len(base):].split("/") if p]
        head, tail = os.path.split(norm)
        real = os.path.join(os.path.realpath(head), tail) if tail else os.path.realpath(norm)
        if real == self.root:
            return []
        if real.startswith(self.root + "/"):
            return [p for p in real[len(self.root):].split("/") if p]
        return None

    # -- resolution ------------------------------------------------------------------------------------------

    def locate(
        self, path: str | os.PathLike[str], *, follow: bool = True, create_parents: bool = False
    ) -> Location:
        """Open the directory holding ``path``'s last component, beneath the root.

        With ``follow`` a symlink as the last component is followed (beneath the root) to the entry it names,
        so the location is that of a non-symlink or of a name that does not exist yet. ``create_parents``
        makes missing directories on the way (mode 0o777 less the umask). Raises :class:`PathEscapeError`
        where the resolution would leave the root.
        """
        parts = self.parts(path)
        return self._locate(parts, follow=follow, create=create_parents)

    def _locate(self, parts: list[str], *, follow: bool, create: bool) -> Location:
        full = self.full(parts)
        if not parts:
            return Location(self.root_fd(), None, full, owned=False)
        head, name = parts[:-1], parts[-1]
        dirfd = self._open_dir_fast(head, create)
        if dirfd is not None:
            if not follow:
                return Location(dirfd, name, full, owned=dirfd != self.root_fd())
            try:
                st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
            except OSError:
                st = None  # missing (or unreadable): the walk below decides, with the same calls
            if st is None or not stat.S_ISLNK(st.st_mode):
                return Location(dirfd, name, full, owned=dirfd != self.root_fd())
            if dirfd != self.root_fd():
                os.close(dirfd)
        return self._walk(parts, follow=follow, create=create)

    def _open_dir_fast(self, head: list[str], create: bool) -> int | None:
        """The directory ``head`` through one ``openat2``, or ``None`` where the walk must settle it."""
        if not head:
            return self.root_fd()
        if self._openat2 is None:
            return None
        try:
            return int(self._openat2(self.root_fd(), "/".join(head), _DIR_FLAGS, 0))
        except OSError as exc:
            if exc.errno in _WALK_INSTEAD or (create and exc.errno == errno.ENOENT):
                if exc.errno == errno.ENOSYS:
                    self._openat2 = None
                return None
            raise OSError(exc.errno, os.strerror(exc.errno or errno.EIO), self.full(head)) from None

    def _walk(self, parts: list[str], *, follow: bool, create: bool) -> Location:
        """Resolve ``parts`` one component at a time with ``O_NOFOLLOW`` descriptors (see the module notes)."""
        full = self.full(parts)
        root = self.root_fd()
        stack: list[tuple[int, str | None]] = [(root, None)]  # directories walked; [0] is the root's fd
        pending = list(reversed(parts))  # components still to walk, the next one last
        hops = changes = 0
        try:
            while True:
                if not pending:  # a symlink's target ended on a directory (".", "..", the root)
                    fd, name = stack.pop() if len(stack) > 1 else (root, None)
                    if name is None:
                        return Location(root, None, full, owned=False)
                    os.close(fd)
                    return self._finish(stack, name, full)
                part = pending.pop()
                if part in ("", "."):
                    continue
                if part == "..":
                    if len(stack) == 1:
                        raise errors.PathEscapeError(
                            f"path {full!r} leads outside the root {self.root} (through '..' above it)"
                        )
                    os.close(stack.pop()[0])
                    continue
                top = stack[-1][0]
                last = not pending
                if last and not follow:
                    return self._finish(stack, part, full)
                try:
                    st = os.stat(part, dir_fd=top, follow_symlinks=False)
                except FileNotFoundError:
                    if last:
                        return self._finish(stack, part, full)
                    if not create:
                        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), full) from None
                    try:
                        os.mkdir(part, dir_fd=top)
                    except FileExistsError:
                        pass
                    except OSError as exc:
                        raise OSError(exc.errno, exc.strerror, full) from None
                    pending.append(part)
                    continue
                except OSError as exc:
                    raise OSError(exc.errno, exc.strerror, full) from None
                if stat.S_ISLNK(st.st_mode):
                    hops += 1
                    if hops > _MAX_HOPS:
                        raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), full)
                    try:
                        target = os.readlink(part, dir_fd=top)
                    except OSError as exc:
                        if exc.errno not in (errno.EINVAL, errno.ENOENT):
                            raise OSError(exc.errno, exc.strerror, full) from None
                        changes += 1  # no longer a link: look at it again
                        if changes > _RETRIES:
                            raise OSError(errno.EAGAIN, "the name kept changing while resolved", full) from None
                        pending.append(part)
                        continue
                    if target.startswith("/"):
                        inside = self._inside(target)
                        if inside is None:
                            raise errors.PathEscapeError(
                                f"path {full!r} leads outside the root {self.root} (a symlink to {target})"
                            )
                        while len(stack) > 1:
                            os.close(stack.pop()[0])
                        pending.extend(reversed(inside))
                    else:
                        pending.extend(reversed(target.split("/")))
                    continue
                if last:
                    return self._finish(stack, part, full)
                if not stat.S_ISDIR(st.st_mode):
                    raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), full)
                try:
                    fd = os.open(part, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=top)
                except OSError as exc:
                    if exc.errno not in (errno.ENOTDIR, errno.ELOOP, errno.ENOENT):
                        raise OSError(exc.errno, exc.strerror, full) from None
                    changes += 1  # replaced since the stat (by a symlink, a file, nothing): look again
                    if changes > _RETRIES:
                        raise OSError(errno.EAGAIN, "the name kept changing while resolved", full) from None
                    pending.append(part)
                    continue
                stack.append((fd, part))
        except BaseException:
            for fd, _ in stack[1:]:
                os.close(fd)
            raise

    def _finish(self, stack: list[tuple[int, str | None]], name: str, full: str) -> Location:
        fd = stack[-1][0]
        for other, _ in stack[1:-1]:
            os.close(other)
        del stack[1:]
        return Location(fd, name, full, owned=fd != self.root_fd())

    # -- opening ---------------------------------------------------------------------------------------------

    def open(self, path: str | os.PathLike[str], flags: int, mode: int = 0o644) -> int:
        """``os.open`` of ``path`` beneath the root (symlinks inside followed); ``O_CLOEXEC`` is added.

        Pass ``O_NONBLOCK`` to open something that may be a FIFO without waiting for a writer, ``O_NOFOLLOW``
        to refuse a symlink as the last component (ELOOP; links on the way are followed beneath the root).
        """
        parts = self.parts(path)
        if flags & os.O_NOFOLLOW and parts:
            with self._locate(parts, follow=False, create=False) as loc:
                try:
                    return os.open(loc.name or ".", flags | os.O_CLOEXEC, mode, dir_fd=loc.dirfd)
                except OSError as exc:
                    raise OSError(exc.errno, exc.strerror, loc.full) from None
        if self._openat2 is not None:
            try:
                return int(self._openat2(self.root_fd(), "/".join(parts) or ".", flags, mode))
            except OSError as exc:
                if exc.errno not in _WALK_INSTEAD:
                    raise OSError(exc.errno, os.strerror(exc.errno or errno.EIO), self.full(parts)) from None
                if exc.errno == errno.ENOSYS:
                    self._openat2 = None
        return self._open_walked(parts, flags, mode)

    def _open_walked(self, parts: list[str], flags: int, mode: int) -> int:
        for _ in range(_RETRIES):
            with self._locate(parts, follow=True, create=False) as loc:
                if loc.name is None:
                    return os.open(".", flags | os.O_CLOEXEC, mode, dir_fd=loc.dirfd)
                try:
                    fd = os.open(loc.name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=loc.dirfd)
                except OSError as exc:
                    if exc.errno == errno.ELOOP:  # became a symlink since it was located: follow it
                        continue
                    raise OSError(exc.errno, exc.strerror, loc.full) from None
                if flags & _O_PATH and stat.S_ISLNK(os.fstat(fd).st_mode):
                    os.close(fd)
                    continue
                return fd
        # EAGAIN, not ELOOP: the name exists (it is being swapped), so it must not read as absent
        raise OSError(errno.EAGAIN, "the name kept changing into a symlink while it was opened", self.full(parts))

    def open_dir(self, path: str | os.PathLike[str]) -> int:
        """A readable descriptor of the directory ``path`` (for ``os.scandir``, ``fsync``)."""
        return self.open(path, os.O_RDONLY | os.O_DIRECTORY)

    # -- metadata --------------------------------------------------------------------------------------------

    def stat(self, path: str | os.PathLike[str], *, follow: bool = True) -> os.stat_result:
        """``stat`` (``follow``) or ``lstat`` of ``path``; opens nothing that could block (``O_PATH``)."""
        if follow:
            fd = self.open(path, _O_PATH | os.O_CLOEXEC) if _O_PATH else self.open(path, os.O_RDONLY | os.O_NONBLOCK)
            try:
                return os.fstat(fd)
            finally:
                os.close(fd)
        with self.locate(path, follow=False) as loc:
            if loc.name is None:
                return os.fstat(loc.dirfd)
            try:
                return os.stat(loc.name, dir_fd=loc.dirfd, follow_symlinks=False)
            except OSError as exc:
                raise OSError(exc.errno, exc.strerror, loc.full) from None

    def scandir(self, path: str | os.PathLike[str]) -> list[tuple[str, os.stat_result | None]]:
        """Names in the directory ``path`` with their ``lstat`` (``None`` for one removed while listing)."""
        fd = self.open_dir(path)
        out: list[tuple[str, os.stat_result | None]] = []
        try:
            with os.scandir(fd) as it:
                for de in it:
                    try:
                        st: os.stat_result | None = de.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        st = None
                    out.append((de.name, st))
        finally:
            os.close(fd)
        return out

    def listdir(self, path: str | os.PathLike[str]) -> list[str]:
        """Names in the directory ``path`` (no ``stat`` of each: :meth:`scandir` gives those)."""
        fd = self.open_dir(path)
        try:
            return os.listdir(fd)
        finally:
            os.close(fd)

    def utime(self, path: str | os.PathLike[str], times: tuple[float, float] | None = None) -> None:
        """Set the access and modification times of ``path`` (its target, if a symlink inside the root)."""
        with self.locate(path, follow=True) as loc:
            if loc.name is None:
                fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=loc.dirfd)
                try:
                    os.utime(fd, times)
                finally:
                    os.close(fd)
                return
            try:
                os.utime(loc.name, times, dir_fd=loc.dirfd, follow_symlinks=False)
            except OSError as exc:
                raise OSError(exc.errno, exc.strerror, loc.full) from None

    # -- namespace -------------------------------------------------------------------------------------------

    def _entry(self, path: str | os.PathLike[str], what: str, *, create_parents: bool = False) -> Location:
        loc = self.locate(path, follow=False, create_parents=create_parents)
        if loc.name is None:
            loc.close()
            raise errors.InvalidRequestError(f"refusing to {what} the root {self.root}")
        return loc

    def _remove(self, path: str | os.PathLike[str], what: str, call: Callable[..., None]) -> None:
        """``call(name, dir_fd=)`` (``os.unlink`` or ``os.rmdir``) on the entry ``path``; errors name ``path``."""
        with self._entry(path, what) as loc:
            try:
                call(loc.name or "", dir_fd=loc.dirfd)
            except OSError as exc:
                raise OSError(exc.errno, exc.strerror, loc.full) from None

    def unlink(self, path: str | os.PathLike[str]) -> None:
        """Remove the entry ``path`` (a symlink: the link itself); not a directory."""
        self._remove(path, "unlink", os.unlink)

    def rmdir(self, path: str | os.PathLike[str]) -> None:
        """Remove the empty directory ``path`` (a symlink to one is refused with ENOTDIR)."""
        self._remove(path, "remove", os.rmdir)

    def mkdir(
        self, path: str | os.PathLike[str], mode: int = 0o777, *, parents: bool = False, exist_ok: bool = False
    ) -> None:
        """Make the directory ``path`` (``parents``: and missing ones above it, as ``os.makedirs``)."""
        with self._entry(path, "create", create_parents=parents) as loc:
            try:
                os.mkdir(loc.name or "", mode, dir_fd=loc.dirfd)
            except FileExistsError:
                if not exist_ok or not self._is_dir_at(loc):
                    raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), loc.full) from None
            except OSError as exc:
                raise OSError(exc.errno, exc.strerror, loc.full) from None

    def _is_dir_at(self, loc: Location) -> bool:
        try:
            fd = os.open(loc.name or ".", _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=loc.dirfd)
        except OSError:
            # A symlink: a directory if it leads to one inside the root.
            try:
                return stat.S_ISDIR(self.stat(loc.full).st_mode)
            except (OSError, errors.PathEscapeError):
                return False
        os.close(fd)
        return True

    def _two(
        self, src: str | os.PathLike[str], dst: str | os.PathLike[str], what: str, call: Callable[..., None]
    ) -> None:
        """``call(src_name, dst_name, src_dir_fd=, dst_dir_fd=)`` on the entries ``src`` and ``dst`` (``dst``
        may be replaced); errors name both."""
        with self._entry(src, what) as a, self._entry(dst, "replace") as b:
            try:
                call(a.name or "", b.name or "", src_dir_fd=a.dirfd, dst_dir_fd=b.dirfd)
            except OSError as exc:
                raise OSError(exc.errno, exc.strerror, a.full, None, b.full) from None

    def rename(self, src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        """``rename(2)`` of the entry ``src`` to ``dst`` (a symlink: the link itself), both beneath the root."""
        self._two(src, dst, "move", os.rename)

    def link(self, src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        """Hard-link the entry ``src`` as ``dst`` (fails with EEXIST if ``dst`` exists)."""
        self._two(src, dst, "link", functools.partial(os.link, follow_symlinks=False))

    def rmtree(self, path: str | os.PathLike[str], maxdepth: int | None = None) -> None:
        """Remove ``path`` and what it holds, walking directory descriptors (symlinks removed, never followed).

        With ``maxdepth``, entries more than ``maxdepth`` levels below ``path`` stay, and so do the directories
        holding them (directories that cannot be removed are left quietly). A non-directory is unlinked.
        """
        with self._entry(path, "remove") as loc:
            self.rmtree_at(loc.dirfd, loc.name or "", loc.full, maxdepth)

    def rmtree_at(self, dirfd: int, name: str, full: str, maxdepth: int | None = None) -> None:
        """:meth:`rmtree` of the entry ``name`` of the directory descriptor ``dirfd`` (``full`` names it in
        errors); acts on descriptors alone, so it serves directories the caller opened beneath the root."""
        self._remove_at(dirfd, name, full, 1, maxdepth, missing_ok=False)

    def _remove_at(
        self, dirfd: int, name: str, full: str, depth: int, maxdepth: int | None, *, missing_ok: bool
    ) -> None:
        """Remove the entry ``name`` of ``dirfd``: a directory with what it holds (entries ``depth`` levels
        below and deeper, past ``maxdepth``, stay), anything else (a symlink, never followed) unlinked.
        ``missing_ok``: an entry gone meanwhile is no error."""
        try:
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dirfd)
        except FileNotFoundError as exc:
            if missing_ok:
                return
            raise OSError(exc.errno, exc.strerror, full) from None
        except OSError as exc:
            if exc.errno not in (errno.ENOTDIR, errno.ELOOP):  # replaced by a non-directory: unlink it
                raise OSError(exc.errno, exc.strerror, full) from None
            self._unlink_at(dirfd, name, full, missing_ok=missing_ok)
            return
        try:
            self._clear(fd, full, depth, maxdepth)
        finally:
            os.close(fd)
        try:
            os.rmdir(name, dir_fd=dirfd)
        except OSError as exc:
            if maxdepth is None and exc.errno != errno.ENOENT:
                raise OSError(exc.errno, exc.strerror, full) from None

    def _clear(self, dirfd: int, full: str, depth: int, maxdepth: int | None) -> None:
        with os.scandir(dirfd) as it:
            entries = [(de.name, de.is_dir(follow_symlinks=False)) for de in it]
        for name, is_dir in entries:
            child = os.path.join(full, name)
            if is_dir:
                if maxdepth is not None and depth >= maxdepth:
                    continue
                self._remove_at(dirfd, name, child, depth + 1, maxdepth, missing_ok=True)
            else:
                self._unlink_at(dirfd, name, child, missing_ok=True)

    @staticmethod
    def _unlink_at(dirfd: int, name: str, full: str, *, missing_ok: bool) -> None:
        try:
            os.unlink(name, dir_fd=dirfd)
        except FileNotFoundError as exc:
            if not missing_ok:
                raise OSError(exc.errno, exc.strerror, full) from None
        except OSError as exc:
            raise OSError(exc.errno, exc.strerror, full) from None

    def fsync_dir(self, path: str | os.PathLike[str]) -> None:
        """fsync the directory ``path``, so creates and renames in it are durable."""
        fd = self.open_dir(path)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
