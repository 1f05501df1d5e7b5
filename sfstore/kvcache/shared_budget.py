"""A byte budget for a shared KV tier's directory, kept by every process and node that uses it, with no server.

The state lives in the directory and nowhere else, written with operations that NFS makes safe between nodes
(create, rename within a directory, unlink, ``utime``, ``readdir``). One namespace's root (the tier's directory
for the default namespace, ``ns/<name>/`` beneath it for another) holds::

    <xx>/<key hex>.kvb         block files (the shared tier's)
    <xx>/<key hex>.<B>.<m>.kvc chunk files: runs of m blocks (:mod:`sfstore.kvcache.shared_chunks`)
    <xx>/.evicting-*           a block being evicted: renamed away from its name, then unlinked
    .sfkv/writers/<id>.json    one record per process that writes here: host, pid, bytes it added and evicted,
                               heartbeat, budget (rewritten atomically at most once a heartbeat)
    .sfkv/scan.json            the last full scan: bytes held then, and each record's net bytes at that moment
    .sfkv/quarantine/<n>.json  a process that quarantined this tier (its I/O missed a deadline): host, pid,
                               since, until, reason (:mod:`sfstore.kvcache.deadline`; ended ones are ignored)

Bytes held are estimated without listing the directory: the last scan's total plus, for each record, what it
added less what it evicted since that scan. A record torn or unreadable counts as absent; a scan older than
``rescan_s`` (or none) is made again, so a process started afresh recomputes what is held from the files
themselves. Counts err towards too many bytes (two writers of one block both count it; a file a reader dropped
as corrupt is not subtracted by anyone), which evicts a little early, never late; the next scan corrects them.

Eviction is least recently used, approximately: a reader sets a block file's access time when it reads a hit
(at most once per ``touch_s`` per file), a scan lists the oldest files, and an evictor renames each victim to a
hidden ``.evicting-*`` name in its own directory before unlinking it. A reader that opened the file before the
rename reads the whole block (the open file outlives its name); one that looks it up after misses cleanly. A
rename succeeds for one evictor only, so a block is counted as evicted once. An evictor killed between the two
steps leaves an ``.evicting-*`` file no lookup finds; :meth:`SharedBudget.gc` removes it.

Namespaces partition the directory: a namespace's accounting, scans and evictions see only its own root (the
default namespace's scan reads only the two-hex-digit subdirectories), so one namespace's writes never evict
another's blocks, and its keys are never looked up in another's root.
"""

from __future__ import annotations

import heapq
import json
import os
import re
import secrets
import socket
import stat
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from sfstore import defaults, errors, forks, quarantine_records, records, temp_names
from sfstore.paths.file import FilePath
from sfstore.temp_names import pid_alive

__all__ = [
    "SharedBudget", "WriterRecord", "check_namespace", "namespace_prefix", "list_namespaces", "EVICTING", "META",
]

META = ".sfkv"  # the accounting directory in a namespace's root
NAMESPACES = "ns"  # the default namespace's root holds the others' roots under this name
EVICTING = ".evicting-"
EvictOutcome = Literal["evicted", "gone", "kept"]  # what became of one eviction candidate
_RECORD_VERSION = 1
_RECORD_MAX = 64 << 10  # a record longer than this is not one of ours
_SUB = re.compile(r"^[0-9a-f]{2}$")
_NAMESPACE = defaults.SETTINGS["kvcache_namespace"]  # what a namespace may be called: the setting says it
_O_PATH = getattr(os, "O_PATH", os.O_RDONLY)
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def check_namespace(name: object) -> str:
    """``name`` if it is a valid cache namespace (``""``: the default one), else :class:`~sfstore.errors.ConfigError`.

    A namespace is 1 to 64 letters, digits, ``.``, ``_`` or ``-``, not starting with ``.``, ``_`` or ``-``."""
    if not isinstance(name, str):
        raise errors.ConfigError(f"cache_namespace must be a str, not {type(name).__name__}")
    if name and not _is_namespace(name):
        raise errors.ConfigError(f"cache_namespace {name!r}: {_NAMESPACE.pattern_text}")
    return name


def _is_namespace(name: str) -> bool:
    return re.fullmatch(_NAMESPACE.pattern or "", name) is not None


def namespace_prefix(name: str) -> str:
    """The namespace's root relative to the tier's directory (``""`` for the default namespace)."""
    return f"{NAMESPACES}/{check_namespace(name)}/" if name else ""


def list_namespaces(fp: FilePath, prefix: str = "") -> list[str]:
    """The namespaces present under the tier directory ``prefix`` of ``fp`` (``""`` first, the default one)."""
    try:
        names = fp.listdir(prefix + NAMESPACES)
    except OSError:
        names = []
    return ["", *sorted(n for n in names if _is_namespace(n))]


@dataclass(frozen=True)
class WriterRecord:
    """What one writer says of itself: bytes it ``added`` and ``evicted`` since it started (cumulative)."""

    id: str
    host: str
    pid: int
    added: int
    evicted: int
    heartbeat: float  # wall-clock seconds (comparable between nodes, roughly)
    started: float
    budget: int

    @property
    def net(self) -> int:
        return self.added - self.evicted

    def to_json(self) -> bytes:
        return json.dumps({"v": _RECORD_VERSION, "id": self.id, "host": self.host, "pid": self.pid,
                           "added": self.added, "evicted": self.evicted, "heartbeat": self.heartbeat,
                           "started": self.started, "budget": self.budget}).encode()

    @classmethod
    def parse(cls, data: bytes) -> WriterRecord | None:
        """The record in ``data``, or ``None`` for anything torn or foreign."""
        try:
            d = json.loads(data)
            if not isinstance(d, dict) or d.get("v") != _RECORD_VERSION:
                return None
            rec = cls(str(d["id"]), str(d["host"]), int(d["pid"]), int(d["added"]), int(d["evicted"]),
                      float(d["heartbeat"]), float(d["started"]), int(d["budget"]))
        except (ValueError, TypeError, KeyError, UnicodeDecodeError):
            return None
        return rec if rec.added >= 0 and rec.evicted >= 0 else None


@dataclass
class _Scan:
    """A full listing of one namespace's root."""

    total: int = 0
    files: int = 0
    candidates: list[tuple[int, str, str, int, int]] = field(default_factory=list)  # (used ns, sub, name, ino, size)
    evicting: list[tuple[str, str]] = field(default_factory=list)
    temporaries: list[tuple[str, str, os.stat_result]] = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class _Base:
    """The last scan as ``scan.json`` has it."""

    total: int
    files: int
    time: float  # wall clock
    nets: dict[str, int]
    key: tuple[int, int, int] = (0, 0, 0)  # the file's (inode, mtime, size): re-parsed only when it changes


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname() or "host")[:64]


class SharedBudget:
    """The byte budget of one namespace's root in a shared tier's directory.

    Parameters
    ----------
    fp : FilePath
        The file path the tier's directory is under.
    prefix : str
        The namespace's root relative to ``fp``'s root (``""`` or ending in ``/``).
    budget : int
        Bytes the namespace may hold (0: unbounded; usage is still recorded, for the processes that bound it).
    heartbeat_s : float
        Most seconds between rewrites of this process's record while it writes.
    refresh_s : float
        Most seconds this process's estimate goes without re-reading the other writers' records.
    rescan_s : float
        A scan older than this is made again before eviction relies on it.
    stale_s : float
        A record whose heartbeat is older than this belongs to a writer that is gone (:meth:`gc` removes it).
    touch_s : float
        A read hit sets the file's access time when it is older than this (an LRU of this resolution).
    """

    def __init__(
        self, fp: FilePath, prefix: str = "", budget: int = 0, *, namespace: str = "", heartbeat_s: float = 1.0,
        refresh_s: float = 0.25, rescan_s: float = 300.0, stale_s: float = 600.0, touch_s: float = 30.0,
    ) -> None:
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
            raise errors.ConfigError(f"the shared tier's budget must be an int >= 0 (0: unbounded), not {budget!r}")
        self.fp = fp
        self.prefix = prefix
        self.namespace = check_namespace(namespace)
        self.budget = budget
        self.heartbeat_s, self.refresh_s, self.rescan_s = heartbeat_s, refresh_s, rescan_s
        self.stale_s, self.touch_s = stale_s, touch_s
        self.host = _host()
        self._new_identity()
        self.started = time.time()
        self.evictions = 0  # blocks this process evicted to keep the budget
        self.bytes_evicted = 0
        self.errors = 0  # accounting that failed (records, scans): the tier went on without it
        self._lock = threading.Lock()  # the counters and cached state below
        self._enforcing = threading.Lock()
        self._dirty = False
        self._others: dict[str, WriterRecord] = {}
        self._base: _Base | None = None
        self._refreshed = -1e18
        self._flushed = -1e18
        self._registered = False
        self._changed = False
        self._held: int | None = None
        self._candidates: list[tuple[int, str, str, int, int]] = []
        self._last_scan: float = -1e18  # monotonic end of this process's last scan
        self._scan_seconds: float | None = None
        self._scanning = False
        self._serial = 0
        forks.after_fork(self._in_forked_child)

    def _in_forked_child(self) -> None:
        # a forked child is another writer (its own record, nothing counted yet), and the parent's threads
        # (a background scan, one holding a lock) do not exist in it
        self._lock = threading.Lock()
        self._enforcing = threading.Lock()
        self._scanning = False
        self._new_identity()
        self._registered = False

    def _new_identity(self) -> None:
        self.pid = os.getpid()
        self.id = f"{self.host}-{self.pid}-{secrets.token_hex(4)}"
        self.added = 0
        self.evicted = 0

    # -- paths -----------------------------------------------------------------------------------------------------
    def _rel(self, *parts: str) -> str:
        return self.prefix + "/".join(parts)

    def _open_dir(self, rel: str, create: bool = False) -> int:
        """A readable descriptor of ``rel`` (beneath the file path's root); ``create``: made when missing."""
        try:
            return self.fp.open_dir(rel or ".")
        except FileNotFoundError:
            if not create:
                raise
        self.fp.mkdir(rel, parents=True, exist_ok=True)
        return self.fp.open_dir(rel)

    @property
    def root(self) -> str:
        """The namespace's root on the host (for messages)."""
        return os.path.join(self.fp.root, self.prefix)

    # -- records ---------------------------------------------------------------------------------------------------
    def _record(self) -> WriterRecord:
        return WriterRecord(self.id, self.host, self.pid, self.added, self.evicted, time.time(), self.started,
                            self.budget)

    def register(self) -> None:
        """Make sure this process's record is in the directory (before its first write: gc then knows the
        temporary files it writes are a live writer's)."""
        if not self._registered:
            self.flush(force=True)

    def added_bytes(self, nbytes: int) -> None:
        """Count a block file this process published."""
        with self._lock:
            self.added += nbytes
            self._changed = True
        self.flush()

    def removed_bytes(self, nbytes: int) -> None:
        """Count a block file this process removed (an explicit eviction, a corrupt file dropped)."""
        with self._lock:
            self.evicted += nbytes
            self._changed = True

    def flush(self, force: bool = False) -> None:
        """Rewrite this process's record (atomically) when it changed and a heartbeat passed, or ``force``."""
        now = time.monotonic()
        with self._lock:  # no I/O under the lock: stats() takes it, and must not wait for a stalled mount
            if not force and (not self._changed or now - self._flushed < self.heartbeat_s):
                return
            self._flushed, self._changed = now, False
            check = self._registered
        if check and not self._record_present():
            # gc removed it (a heartbeat older than stale_s) and rescanned: what this process added is in that
            # scan's total, so it starts over under a new name with nothing counted
            with self._lock:
                self._new_identity()
        with self._lock:
            rec = self._record()
        self._write_record(rec)
        self._registered = True

    def _record_present(self) -> bool:
        try:
            self.fp.os_stat(self._rel(META, "writers", f"{self.id}.json"), follow=False)
        except FileNotFoundError:
            return False
        except OSError:
            return True  # unknown: keep the name
        return True

    def _write_record(self, rec: WriterRecord) -> None:
        fd = self._open_dir(self._rel(META, "writers"), create=True)
        try:
            records.write_atomically(fd, f"{rec.id}.json", rec.to_json())
        finally:
            os.close(fd)

    def read_records(self) -> list[WriterRecord]:
        """Every writer record that parses (torn or foreign ones are skipped)."""
        return [r for _name, r, _st in self._records() if r is not None]

    def _records(self) -> Iterator[tuple[str, WriterRecord | None, os.stat_result | None]]:
        for _fd, name, data, st in self._entries(META, "writers"):
            if not name.startswith(".") and name.endswith(".json"):
                yield name, (WriterRecord.parse(data) if data is not None else None), st

    def _entries(self, *parts: str) -> Iterator[tuple[int, str, bytes | None, os.stat_result | None]]:
        """Each entry of the metadata directory ``parts`` (none when it is not there): the directory's descriptor
        (open while the entry is looked at, for an unlink), the name, its bytes (``None`` unless a small regular
        file) and status."""
        try:
            fd = self._open_dir(self._rel(*parts))
        except OSError:
            return
        try:
            for name in os.listdir(fd):
                data, st = records.read_small(fd, name, _RECORD_MAX)
                yield fd, name, data, st
        finally:
            os.close(fd)

    # -- the last scan ---------------------------------------------------------------------------------------------
    def _read_base(self) -> _Base | None:
        try:
            fd = self._open_dir(self._rel(META))
        except OSError:
            return None
        try:
            data, st = records.read_small(fd, "scan.json", _RECORD_MAX)
        finally:
            os.close(fd)
        if data is None or st is None:
            return None
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        if self._base is not None and self._base.key == key:
            return self._base
        try:
            d = json.loads(data)
            nets = {str(k): int(v) for k, v in dict(d["nets"]).items()}
            return _Base(int(d["total"]), int(d["files"]), float(d["time"]), nets, key)
        except (ValueError, TypeError, KeyError, UnicodeDecodeError):
            return None  # torn: as if there were no scan

    def _write_base(self, total: int, files: int, nets: dict[str, int]) -> None:
        fd = self._open_dir(self._rel(META), create=True)
        try:
            records.write_atomically(fd, "scan.json", json.dumps(
                {"v": 1, "total": total, "files": files, "time": time.time(), "nets": nets,
                 "by": self.id}).encode())
        finally:
            os.close(fd)

    # -- the estimate ----------------------------------------------------------------------------------------------
    def refresh(self) -> None:
        """Re-read the last scan and the other writers' records."""
        base = self._read_base()
        others = {r.id: r for r in self.read_records() if r.id != self.id}
        with self._lock:
            self._base, self._others = base, others
            self._refreshed = time.monotonic()

    def estimate(self, refresh: bool = False) -> int:
        """Bytes the namespace holds, as the records and the last scan have it (re-read when older than
        ``refresh_s``, or ``refresh``)."""
        if refresh or time.monotonic() - self._refreshed >= self.refresh_s:
            self.refresh()
        return self._compute()

    def _compute(self) -> int:
        """The estimate from what was read last (no I/O)."""
        with self._lock:
            base = self._base
            nets = base.nets if base is not None else {}
            held = base.total if base is not None else 0
            held += sum(r.net - nets.get(r.id, 0) for r in self._others.values())
            held += self.added - self.evicted - nets.get(self.id, 0)
            self._held = max(0, held)
            return self._held

    def held(self) -> int | None:
        """The last estimate (no I/O), ``None`` before the first."""
        return self._held

    def _scan_due(self) -> bool:
        base = self._base
        return base is None or time.time() - base.time > self.rescan_s

    # -- scans -----------------------------------------------------------------------------------------------------
    def scan(self, keep: int | None = None) -> _Scan:
        """List the namespace's root: bytes and files held, the ``keep`` least recently used block files (all
        of them with ``None``), and leftovers (``.evicting-*`` files, temporary files)."""
        t0 = time.monotonic()
        out = _Scan()
        cands: list[tuple[int, str, str, int, int]] = []
        try:
            top = self._open_dir(self.prefix.rstrip("/"))
        except FileNotFoundError:
            return out
        try:
            for sub in os.listdir(top):
                if not _SUB.match(sub):
                    continue
                try:
                    fd = os.open(sub, _DIR, dir_fd=top)
                except OSError:
                    continue
                try:
                    with os.scandir(fd) as it:
                        for de in it:
                            name = de.name
                            if name.startswith(EVICTING):
                                out.evicting.append((sub, name))
                                continue
                            try:
                                st = de.stat(follow_symlinks=False)
                            except OSError:
                                continue
                            if self.fp.is_temporary(name):
                                out.temporaries.append((sub, name, st))
                            elif (name.endswith((".kvb", ".kvc")) and not name.startswith(".")
                                  and stat.S_ISREG(st.st_mode)):
                                out.total += st.st_size
                                out.files += 1
                                cands.append((max(st.st_atime_ns, st.st_mtime_ns), sub, name, st.st_ino,
                                              st.st_size))
                finally:
                    os.close(fd)
        finally:
            os.close(top)
        out.candidates = sorted(cands) if keep is None else heapq.nsmallest(keep, cands)
        out.seconds = time.monotonic() - t0
        return out

    def rescan(self) -> _Scan:
        """Scan and publish the result as the new base of every writer's estimate."""
        nets = {r.id: r.net for r in self.read_records()}  # before the listing: a block written meanwhile is
        # counted twice (too many bytes), never missed
        with self._lock:
            nets[self.id] = self.added - self.evicted
        found = self.scan(keep=None if self.budget <= 0 else max(1024, self._base.files // 8 if self._base else 0))
        self._write_base(found.total, found.files, nets)
        with self._lock:
            self._candidates = list(reversed(found.candidates))  # popped from the end: the oldest first
            self._last_scan = time.monotonic()
            self._scan_seconds = found.seconds
        self.refresh()
        return found

    def _rescan_in_background(self) -> None:
        with self._lock:
            if self._scanning:
                return
            self._scanning = True

        def run() -> None:
            try:
                self.rescan()
            except OSError:
                self.errors += 1  # the next enforcement tries again
            finally:
                with self._lock:
                    self._scanning = False
                self._dirty = True

        # a daemon thread: a scan stuck in a stalled mount must not hold the interpreter's exit
        threading.Thread(target=run, name="sfstore-kv-scan", daemon=True).start()

    def _refill(self) -> bool:
        """Candidates for eviction from a new scan: made here when scans of this root are quick, else in the
        background (``False``: none yet)."""
        quick = (self._scan_seconds is not None and self._scan_seconds < 0.2) or \
            (self._scan_seconds is None and (self._base is None or self._base.files < 20000))
        if not quick:
            self._rescan_in_background()
            return False
        self.rescan()
        return bool(self._candidates)

    # -- eviction --------------------------------------------------------------------------------------------------
    def enforce(self) -> int:
        """Evict least recently used blocks until the estimate is within the budget; how many were evicted.

        One thread of a process evicts at a time; a call while another evicts asks it for one more pass."""
        if self.budget <= 0:
            return 0
        self._dirty = True
        if not self._enforcing.acquire(blocking=False):
            return 0
        n = 0
        try:
            while self._dirty:
                self._dirty = False
                n += self._enforce_pass()
        finally:
            self._enforcing.release()
        if n:
            self.flush()
        return n

    def _enforce_pass(self) -> int:
        held = self.estimate()
        refills = 0
        if self._scan_due():  # no scan yet, or an old one: files no live record counts may be there
            self._refill()
            held = self.estimate()
            refills += 1
        n = 0
        while held > self.budget:
            with self._lock:
                cand = self._candidates.pop() if self._candidates else None
            if cand is None:
                # a scan gives the exact bytes and every file as a candidate: a second one in a pass only
                # when the first's were used or evicted by others meanwhile
                if refills >= 2 or not self._refill():
                    break
                refills += 1
                held = self.estimate()
                continue
            outcome, size = self._evict_one(cand)
            if outcome != "kept":
                # a block another evictor removed meanwhile is freed all the same: counting only our own
                # evictions, two processes evicting from the same scan would each free the budget's excess
                held -= size
                n += outcome == "evicted"
        self._compute()
        return n

    def _evict_one(self, cand: tuple[int, str, str, int, int]) -> tuple[EvictOutcome, int]:
        """Evict one candidate if it is still the file the scan saw, unused since: rename, then unlink.

        Returns what became of it and the bytes that left the namespace: ``"evicted"`` (by this call),
        ``"gone"`` (removed by someone else since the scan: the scan's size) or ``"kept"`` (used, replaced
        or not ours to move: 0)."""
        used, sub, name, ino, size = cand
        try:
            pfd = self.fp.open_fd(self._rel(sub), _O_PATH | os.O_DIRECTORY)
        except FileNotFoundError:
            return "gone", size
        except OSError:
            return "kept", 0
        try:
            try:
                st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
            except FileNotFoundError:
                return "gone", size
            except OSError:
                return "kept", 0
            if st.st_ino != ino or max(st.st_atime_ns, st.st_mtime_ns) > used or not stat.S_ISREG(st.st_mode):
                return "kept", 0
            with self._lock:
                self._serial += 1
                hidden = f"{EVICTING}{self.id}-{self._serial}-{name}"
            try:
                os.rename(name, hidden, src_dir_fd=pfd, dst_dir_fd=pfd)
            except FileNotFoundError:
                return "gone", size  # another evictor won the rename
            except OSError:
                return "kept", 0  # not ours to move
            try:
                now = os.stat(hidden, dir_fd=pfd, follow_symlinks=False)
                if now.st_ino != ino:  # a writer published the block again between the stat and the rename
                    try:
                        os.link(hidden, name, src_dir_fd=pfd, dst_dir_fd=pfd, follow_symlinks=False)
                    except OSError:
                        pass  # the name is taken again: the block is there
                    os.unlink(hidden, dir_fd=pfd)
                    return "kept", 0
                os.unlink(hidden, dir_fd=pfd)
            except OSError:
                pass  # left for gc: no lookup finds a hidden name
            with self._lock:
                self.evicted += st.st_size
                self.evictions += 1
                self.bytes_evicted += st.st_size
                self._changed = True
            return "evicted", int(st.st_size)
        finally:
            os.close(pfd)

    # -- reads -----------------------------------------------------------------------------------------------------
    def touch(self, fd: int, st: os.stat_result) -> None:
        """Note a read hit of the open block file ``fd`` (its status ``st``): set its access time when it is
        older than ``touch_s`` (the modification time stays: it is when the block was published)."""
        if time.time() - max(st.st_atime, st.st_mtime) < self.touch_s:
            return
        try:
            os.utime(fd, ns=(time.time_ns(), st.st_mtime_ns))
        except OSError:
            pass  # another user's file, a read-only mount: the LRU is approximate

    # -- at the end ------------------------------------------------------------------------------------------------
    def settle(self) -> None:
        """At close: publish this process's counts, then evict to the budget counted from a scan of the files.

        A scan, not the records: the last writer to close is the one that leaves the namespace within budget,
        and another node's latest record may not be visible here yet (an NFS client's caches), while its files,
        listed and stat'ed, are (a file listed but gone is skipped: a scan counts too much, never too little).
        """
        if not self._registered:
            return
        self.flush(force=True)
        if self.budget > 0:
            self.rescan()
            self.enforce()
            self.flush(force=True)

    # -- quarantine records ----------------------------------------------------------------------------------------
    def write_quarantine(self, name: str, record: dict[str, Any]) -> None:
        """Write a quarantine record (:func:`sfstore.quarantine_records.parse_quarantine`'s fields) as
        ``.sfkv/quarantine/<name>.json``, atomically."""
        fd = self._open_dir(self._rel(META, "quarantine"), create=True)
        try:
            records.write_atomically(fd, f"{name}.json", quarantine_records.encode_quarantine(record))
        finally:
            os.close(fd)

    def remove_quarantine(self, name: str) -> None:
        """Remove the quarantine record ``name`` (nothing when it is not there)."""
        try:
            self.fp.unlink(self._rel(META, "quarantine", f"{name}.json"))
        except FileNotFoundError:
            pass

    def quarantines(self, *, clean: bool = False, local_dir: str | None = None) -> list[dict[str, Any]]:
        """The quarantines of this namespace's tier in force now, by any process of any node: the records in
        ``.sfkv/quarantine/``, and this host's own (``local_dir``, default
        :func:`sfstore.quarantine_records.quarantine_dir`) that name this root (a process writes both; one whose
        write to the shared directory is stuck, the stalled mount being what quarantined it, has only the local
        one). ``clean``: remove the shared records
        that ended (or whose process, on this host, is dead), torn ones a minute old, and temporary files a
        minute old or whose writer, on this host, is dead."""
        found: dict[str, dict[str, Any]] = {}
        now = time.time()
        for fd, name, data, st in self._entries(META, "quarantine"):
            rec = (quarantine_records.parse_quarantine(data) if data is not None and not name.startswith(".")
                   and name.endswith(".json") else None)
            if rec is not None and quarantine_records.quarantine_in_force(rec, now):
                found[name[:-len(".json")]] = {"name": name[:-len(".json")], **rec}
            elif clean and (rec is not None or (st is not None and now - st.st_mtime > 60.0) or (
                    name.startswith(".") and self._temporary_gone(name, 0.0, 60.0))):
                _unlink_entry(fd, name)
        mine = os.path.normpath(self.root)
        for rec in quarantine_records.read_quarantine_records(local_dir or quarantine_records.quarantine_dir()):
            if rec["target"] == mine and rec["namespace"] == self.namespace:
                old = found.get(rec["name"])
                if old is None or old["written"] < rec["written"]:
                    found[rec["name"]] = rec
        return sorted(found.values(), key=lambda r: (r["since"], r["name"]))

    # -- gc and du -------------------------------------------------------------------------------------------------
    def gc(self, budget: int | None = None, *, grace_s: float = 600.0) -> dict[str, Any]:
        """Repair and enforce now, from a full scan: remove ``.evicting-*`` leftovers, temporary files of
        writers that are gone (their pid is dead on this host, or older than ``grace_s``), torn and stale
        records (quarantine records that ended, too); evict the least recently used blocks until the bytes held
        are within ``budget`` (default: this object's; 0: unbounded); publish the scan. Returns what it found
        and did."""
        limit = self.budget if budget is None else budget
        out: dict[str, Any] = {"namespace": self.namespace, "budget": limit, "evicting_removed": 0,
                               "temporaries_removed": 0, "records_removed": 0, "evicted": 0, "bytes_evicted": 0}
        now = time.time()
        live: dict[int, list[WriterRecord]] = {}
        removed_records = 0
        for wfd, name, data, st in self._entries(META, "writers"):
            rec = WriterRecord.parse(data) if data is not None and not name.startswith(".") else None
            age = now - st.st_mtime if st is not None else 0.0
            if rec is None:
                gone = name.startswith(".") and self._temporary_gone(name, age, grace_s)
                gone = gone or (not name.startswith(".") and age > 60.0)  # torn or foreign, settled
            else:
                gone = now - rec.heartbeat > self.stale_s or (
                    rec.host == self.host and not pid_alive(rec.pid))  # ours: alive
                if not gone:
                    live.setdefault(rec.pid, []).append(rec)
            if gone:
                removed_records += _unlink_entry(wfd, name)
        out["records_removed"] = removed_records
        try:  # a scan's base or a record whose writer was killed mid-write
            for name in self.fp.listdir(self._rel(META)):
                if name.startswith(".") and self._temporary_gone(name, 0.0, grace_s):
                    out["temporaries_removed"] += self._unlink_at(META, name)
        except OSError:
            pass
        nets = {r.id: r.net for recs in live.values() for r in recs}
        found = self.scan(keep=None)
        for sub, name in found.evicting:
            out["evicting_removed"] += self._unlink_at(sub, name)
        for sub, name, st in found.temporaries:
            if self._temporary_gone(name, now - st.st_mtime, grace_s):
                out["temporaries_removed"] += self._unlink_at(sub, name)
        total = found.total
        out["bytes_before"], out["files_before"] = found.total, found.files
        files = found.files
        if limit > 0:
            for cand in found.candidates:
                if total <= limit:
                    break
                outcome, size = self._evict_one(cand)
                if outcome != "kept":
                    total -= size
                    files -= 1
                if outcome == "evicted":
                    out["evicted"] += 1
                    out["bytes_evicted"] += size
        # gc's evictions are in the new total; the estimate must not subtract them again
        with self._lock:
            if self._registered:
                nets[self.id] = self.added - self.evicted
        self._write_base(total, files, nets)
        out["bytes_after"], out["files_after"] = total, files
        out["writers"] = len(nets)
        out["quarantined"] = self.quarantines(clean=True)  # the ended ones' records are removed
        self.refresh()
        return out

    def _temporary_gone(self, name: str, age: float, grace_s: float) -> bool:
        """Whether a temporary file belongs to a writer that is gone: it is older than ``grace_s``, or its name
        says this host and a pid that is dead here."""
        if age > grace_s:
            return True
        tn = temp_names.parse(name)
        if tn is None or tn.host != temp_names.host():
            return False  # not a temporary name, or another node's writer: its pid means nothing here (the grace
            # period decides)
        return temp_names.is_leftover(tn, name)

    def _unlink_at(self, *parts: str) -> int:
        try:
            self.fp.unlink(self._rel(*parts))
        except OSError:
            return 0  # gone already (another gc, the evictor itself), or not removable: nothing to count
        return 1

    def du(self) -> dict[str, Any]:
        """Bytes and files the namespace holds (a full scan), the estimate writers keep, the budget, the
        writers whose records are live, and the quarantines of this tier in force (:meth:`quarantines`)."""
        found = self.scan(keep=0)
        now = time.time()
        recs = self.read_records()
        live = [r for r in recs if now - r.heartbeat <= self.stale_s]
        budgets = sorted({r.budget for r in live if r.budget > 0})
        return {"namespace": self.namespace, "root": self.root, "bytes": found.total, "files": found.files,
                "estimate": self.estimate(refresh=True), "budget": self.budget, "writer_budgets": budgets,
                "writers": len(live), "evicting": len(found.evicting), "temporaries": len(found.temporaries),
                "quarantined": self.quarantines()}


def _unlink_entry(dirfd: int, name: str) -> bool:
    """Remove ``name`` from the directory ``dirfd``: whether it was removed (gone already, or not ours: not)."""
    try:
        os.unlink(name, dir_fd=dirfd)
    except OSError:
        return False
    return True
