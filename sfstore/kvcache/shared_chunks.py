"""The shared tier's chunk files: runs of consecutive blocks of one prompt in one file, laid out layer-major.

On NFS every open and close is a round trip to the server, so a file per block makes a long prompt's hit pay
for tens of them. The shared tier therefore stores the blocks whose chain it knows (:mod:`sfstore.kvcache.chains`)
in chunks of ``B = kvcache_chunk_tokens / block_tokens`` blocks: the chunk ``c`` of a prompt holds its blocks
``[cB, cB + B)``, and a run of its first ``m`` blocks is the file::

    <xx>/<key of the run's last block, hex>.<B>.<m>.kvc

(``xx``: that key's first byte, as block files'). The last key names everything before it (keys are chained
prefix hashes), so a name is exact: another prompt that shares the chunk's first blocks and then differs has
other last keys. A hit of ``n`` blocks opens ``ceil(n / B)`` files; a lookup asks for each chunk's longest run
first, and only at the chunk where the prompt's stored prefix ends for the shorter ones.

A file is a header of whole 4096-byte pages (magic, checksum kind, ``B``, geometry fingerprint, ``m``, layers,
the position of its first block, a layer's bytes per block, the ``m`` keys, a checksum per block per layer, and
the header's own xxh3-64), then the body, layer-major: layer ``l`` of the run is one contiguous range, block by
block, so a layer of every block of a chunk is one read and each block's slice of it is verified on its own.
The slices' checksums are xxh3-64 for blocks put from host memory and kvsum64 for blocks put from GPU memory
(computed on the GPU, so a GPU-direct read of a layer's slice is verified where it lands: per-layer ranges are
what the device path moves, GPU-direct where its route allows). Either kind is read into either memory.

A prompt's last, partial chunk is stored as a shorter run (``m < B``); when the prompt grows, the longer run is
written and the shorter one removed. So that a prompt which shares only the first blocks of a stored chunk (a
shorter prompt, or one that differs after them) still finds them, the first run written from a chunk's first
block is pointed to by a symbolic link named after that block's key::

    <xx>/<key of the chunk's first block, hex>.<B>.first  ->  ../<yy>/<the run's file name>

A reader whose own runs of a chunk are not there reads the link (a name, never followed), verifies the run's
header, and takes the blocks its keys share with that run: one more open at most, at the chunk where its stored
prefix ends. The link moves to a longer run of the same prompt; a dangling one is replaced.

A run is written only from its chunk's first block: the blocks of a put that start inside a chunk whose first
blocks the caller does not give (nor the pinned tier, see :class:`~sfstore.kvcache.store.KVCacheStore`) are
stored as block files, which reads look for where no run holds a block.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from sfstore.buffers import RegisteredBuffer, RegisteredBufferPool
from sfstore.checksums import SHARED_CHUNK_SUMS, SumKind, kvsum64, xxh3_64, xxh3_64_many
from sfstore.device_verdict import damaged_on_storage, warn_disagreement
from sfstore.kvcache.deadline import late
from sfstore.kvcache.geometry import KEY_BYTES, KVGeometry
from sfstore.paths.base import PathFuture, Range
from sfstore.paths.file import set_blocking
from sfstore.temp_names import temp_name

if TYPE_CHECKING:
    from sfstore.kvcache.tiers import SharedTier
    from sfstore.paths.device import DevicePath

__all__ = ["ChunkRun", "ChunkFiles", "chunk_header_bytes", "CHUNK_SUFFIX"]

CHUNK_SUFFIX = ".kvc"
_MAGIC = b"SFKVCHK1"
# magic, checksum kind's code, reserved, blocks per chunk, fingerprint, blocks in the file, layers, first block's
# position, a layer's bytes per block
_HDR = struct.Struct("<8sHHI16sIIQQ")
_SUM = struct.Struct("<Q")
_PAGE = 4096
_LAYERS_IN_FLIGHT = 2  # layer-by-layer reads: steps (the headers', then a layer's each) submitted at a time

Entry = tuple[int, tuple[bytes, ...], int]  # (index in the caller's batch, chain, position in it)
# a batch submitted to a path: its future, the error submitting it raised, or None for an empty batch
_Started = PathFuture | OSError | None
# one path's share of a read step: (future or error, the files, the bytes each wants)
_Leg = tuple[PathFuture | OSError, list[int], list[int]]


def chunk_header_bytes(geom: KVGeometry, m: int) -> int:
    """Bytes of a run's header (whole pages) for ``m`` blocks."""
    raw = _HDR.size + m * KEY_BYTES + m * geom.num_layers * _SUM.size + _SUM.size
    return -(-raw // _PAGE) * _PAGE


@dataclass(frozen=True)
class ChunkRun:
    """The first ``m`` blocks of the chunk that starts at position ``start`` of ``chain``; or, with ``last``, a run
    a chunk's link points to, whose keys after the chunk's first one are known only once its header is read."""

    chain: tuple[bytes, ...]
    start: int
    m: int
    per_chunk: int
    last: bytes | None = None

    @property
    def pointed(self) -> bool:
        return self.last is not None

    @property
    def keys(self) -> tuple[bytes, ...]:
        return self.chain[self.start:self.start + self.m]

    @property
    def rel(self) -> str:
        """The file's name under the tier's directory."""
        h = (self.last if self.last is not None else self.chain[self.start + self.m - 1]).hex()
        return f"{h[:2]}/{h}.{self.per_chunk}.{self.m}{CHUNK_SUFFIX}"

    @property
    def link(self) -> str:
        """The name of its chunk's link."""
        h = self.chain[self.start].hex()
        return f"{h[:2]}/{h}.{self.per_chunk}.first"


def parse_name(name: str) -> int | None:
    """The blocks a chunk file's name says it holds (``None``: not a chunk file's name)."""
    parts = name.split(".")
    if len(parts) != 4 or "." + parts[3] != CHUNK_SUFFIX or len(parts[0]) != 2 * KEY_BYTES or name.startswith("."):
        return None
    try:
        m = int(parts[2])
        return m if m > 0 and int(parts[1]) >= m else None
    except ValueError:
        return None


def encode_header(geom: KVGeometry, run: ChunkRun, sums: Sequence[int], kind: SumKind = SumKind.XXH3) -> bytes:
    body = _HDR.pack(_MAGIC, SHARED_CHUNK_SUMS.code(kind), 0, run.per_chunk, geom.fingerprint(), run.m,
                     geom.num_layers, run.start, geom.layer_bytes)
    body += b"".join(run.keys) + b"".join(_SUM.pack(s) for s in sums)
    return body + _SUM.pack(xxh3_64(body))


def decode_header(view: memoryview, geom: KVGeometry, run: ChunkRun) -> tuple[list[int], int, SumKind] | None:
    """``(per-slice checksums ([layer][block]), blocks the caller may take, their kind)`` when the header is intact and
    describes ``run``: all ``m`` of an exact run; of a pointed run, those whose keys the caller's chain shares
    (its last key must be the one its name says)."""
    m, layers = run.m, geom.num_layers
    end = _HDR.size + m * KEY_BYTES + m * layers * _SUM.size
    if len(view) < end + _SUM.size or view[:8] != _MAGIC or _SUM.unpack_from(view, end)[0] != xxh3_64(view[:end]):
        return None
    _mg, code, _r, per, fp, mm, ll, start, lb = _HDR.unpack_from(view)
    kind = SHARED_CHUNK_SUMS.kind(code)
    if (kind is None or per != run.per_chunk or fp != geom.fingerprint()
            or mm != m or ll != layers or start != run.start or lb != geom.layer_bytes):
        return None
    at = _HDR.size
    keys = [bytes(view[at + i * KEY_BYTES:at + (i + 1) * KEY_BYTES]) for i in range(m)]
    if run.last is None:
        if keys != list(run.keys):
            return None
        shared = m
    else:
        if keys[-1] != run.last or keys[0] != run.chain[run.start]:
            return None
        mine = run.chain[run.start:run.start + m]
        shared = next((i for i, (a, b) in enumerate(zip(keys, mine, strict=False)) if a != b), min(m, len(mine)))
    at += m * KEY_BYTES
    return [_SUM.unpack_from(view, at + i * _SUM.size)[0] for i in range(m * layers)], shared, kind


def slice_sums(kind: SumKind, views: Sequence[memoryview]) -> list[int]:
    """The checksums of kind ``kind`` of host ``views``."""
    return xxh3_64_many(views) if kind is SumKind.XXH3 else [kvsum64(v) for v in views]


@dataclass
class _Open:
    run: ChunkRun
    fd: int
    st: os.stat_result
    entries: list[int] = field(default_factory=list)  # indices into the caller's entries
    kind: SumKind = SumKind.XXH3  # its slices' checksums (known once its header is read)


class ChunkFiles:
    """The chunk files of one shared tier (see the module): presence, reads, writes, removal.

    Runs on the tier's worker threads (the tier's guard is the caller's); uses the tier's directory descriptor,
    its file path (reads as one batch of ranges, atomic writes) and its budget.
    """

    def __init__(self, tier: SharedTier, per_chunk: int) -> None:
        self.tier = tier
        self.geom = tier.geom
        self.per_chunk = per_chunk
        self.header_bytes = chunk_header_bytes(self.geom, per_chunk)
        self._bufs = RegisteredBufferPool(self.header_bytes + per_chunk * self.geom.block_bytes)
        self._heads = RegisteredBufferPool(self.header_bytes)
        # On NFS a file is read whole (one READ per rsize, not one per block and layer), then its slices copied
        # out; on a local filesystem each wanted slice is read straight into its destination (no copy).
        self.read_whole = tier.fp.mount.fstype.startswith("nfs")

    def close(self) -> None:
        self._bufs.close()
        self._heads.close()

    # -- which run holds a block ------------------------------------------------------------------------------
    def _runs_for(self, chain: tuple[bytes, ...], pos: int) -> list[ChunkRun]:
        """The runs that hold the block at ``pos``, longest first (each ends at or after it)."""
        start = pos - pos % self.per_chunk
        last = min(start + self.per_chunk, len(chain)) - 1
        return [ChunkRun(chain, start, e - start + 1, self.per_chunk) for e in range(last, pos - 1, -1)]

    def resolve(self, entries: Sequence[Entry]) -> list[ChunkRun | None]:
        """For each entry the longest run on disk that holds its block (``None``: none does). Each chunk's longest
        possible run is looked up first, in one batch for all chunks; only chunks where it is missing have their
        shorter runs looked up, in a second batch."""
        groups: dict[tuple[int, int], list[int]] = {}
        for j, (_i, chain, pos) in enumerate(entries):
            groups.setdefault((id(chain), pos // self.per_chunk), []).append(j)
        out: list[ChunkRun | None] = [None] * len(entries)
        cands = {g: self._runs_for(entries[js[0]][1], min(entries[j][2] for j in js)) for g, js in groups.items()}
        first = list(groups)
        found = self.tier._regular([cands[g][0].rel for g in first])
        second = [g for g, f in zip(first, found, strict=True) if not f and len(cands[g]) > 1]
        chosen: dict[tuple[int, int], ChunkRun] = {g: cands[g][0] for g, f in zip(first, found, strict=True) if f}
        if second:
            names = [r.rel for g in second for r in cands[g][1:]]
            more = iter(self.tier._regular(names))
            for g in second:
                for r in cands[g][1:]:
                    if next(more) and g not in chosen:
                        chosen[g] = r
        for g in first:  # the chunk's link: a run of another prompt (or a longer one) that starts as this one
            if g not in chosen:
                run = self._pointed(cands[g][0])
                if run is not None:
                    chosen[g] = run
        for g, js in groups.items():
            run = chosen.get(g)
            if run is None:
                continue
            for j in js:
                if entries[j][2] < run.start + run.m:
                    out[j] = run
        return out

    def shared_blocks(self, run: ChunkRun) -> int:
        """How many of a pointed run's blocks the caller's chain shares (0 when its header does not verify):
        its header is read (an open of the file)."""
        hb = chunk_header_bytes(self.geom, run.m)
        try:
            fd = self.tier._open(run.rel, _READ_FLAGS)
        except OSError:
            return 0
        self.tier.counters.add(opens=1)
        try:
            head = os.pread(fd, hb, 0)
        except OSError:
            return 0
        finally:
            os.close(fd)
        decoded = decode_header(memoryview(head), self.geom, run)
        return decoded[1] if decoded is not None else 0

    def present(self, entries: Sequence[Entry]) -> list[bool]:
        """Whether a run on disk holds each entry's block (a pointed run's header is read to tell)."""
        runs = self.resolve(entries)
        shared: dict[str, int] = {}
        out = []
        for (_i, _c, pos), run in zip(entries, runs, strict=True):
            if run is None:
                out.append(False)
                continue
            if run.pointed:
                if run.rel not in shared:
                    shared[run.rel] = self.shared_blocks(run)
                out.append(pos - run.start < shared[run.rel])
            else:
                out.append(True)
        return out

    def _pointed(self, mine: ChunkRun) -> ChunkRun | None:
        """The run the link of ``mine``'s chunk names (``None``: no link, or not a chunk file's name)."""
        sub, base = mine.link.split("/")
        try:
            pfd = self.tier._open(sub, _O_PATH | os.O_DIRECTORY)
        except OSError:
            return None
        try:
            target = os.readlink(base, dir_fd=pfd)
        except OSError:
            return None
        finally:
            os.close(pfd)
        up, where, name = [*target.split("/"), "", "", ""][:3]
        m = parse_name(name)
        if up != ".." or m is None or m > self.per_chunk or where != name[:2] or target.count("/") != 2:
            return None
        try:
            last = bytes.fromhex(name.split(".")[0])
        except ValueError:
            return None
        return ChunkRun(mine.chain, mine.start, m, self.per_chunk, last=last)

    # -- reads ------------------------------------------------------------------------------------------------
    def read(self, entries: Sequence[Entry], targets: Sequence[memoryview],
             on_layer: Callable[[list[int], int], None] | None = None) -> list[str]:
        """Read each entry's block into its target (a block-sized view) from the run that holds it: every file
        opened first, then all their ranges (the header and each wanted block's slice of each layer) read and
        each verified. A status per entry (``"missing"`` where no run holds it; ``"corrupt"`` for each entry of a
        file that fails verification: it is removed).

        ``on_layer(indices, layer)``: read layer by layer instead (one batch of headers, then one batch per
        layer, two in flight at a time), and call it once layer ``layer`` of the entries at ``indices`` is in
        their targets and verified, while the later layers are still being read."""
        return self._reading(entries, lambda files, out, lost, heads: self._read_steps(
            entries, targets, files, out, lost, heads, on_layer))

    def _open_runs(self, entries: Sequence[Entry], out: list[str],
                   lost: list[tuple[ChunkRun, os.stat_result]]) -> list[_Open]:
        """Open the file of each run that holds an entry's block, once per file, each with the entries it
        answers; a file that cannot be opened answers its entries with a miss's status."""
        files: dict[str, _Open] = {}
        try:
            for j, run in enumerate(self.resolve(entries)):
                if run is None:
                    continue
                f = files.get(run.rel)
                if f is None:
                    status, opened, st = self._open(run)
                    if opened is None:
                        out[j] = status
                        if status == "corrupt" and st is not None:
                            lost.append((run, st))
                        continue
                    f = files[run.rel] = opened
                f.entries.append(j)
        except BaseException:
            for f in files.values():
                os.close(f.fd)
            raise
        return list(files.values())

    def _reading(self, entries: Sequence[Entry],
                 step: Callable[[list[_Open], list[str], list[tuple[ChunkRun, os.stat_result]],
                                 list[RegisteredBuffer]], None],
                 ) -> list[str]:
        """Open the runs ``entries`` are in, then ``step(files, statuses, lost runs, buffers)``; every file closed
        and buffer released after, whatever happened, and the runs found damaged dropped. A status per entry (a
        hit past the deadline is a ``"timeout"``)."""
        out = ["missing"] * len(entries)
        lost: list[tuple[ChunkRun, os.stat_result]] = []
        bufs: list[RegisteredBuffer] = []
        files: list[_Open] = []
        try:
            files = self._open_runs(entries, out, lost)
            step(files, out, lost, bufs)
        finally:
            self._close_all(files, bufs, lost)
        if late():
            return [s if s != "hit" else "timeout" for s in out]
        return out

    def _close_all(self, files: list[_Open], bufs: list[RegisteredBuffer],
                   lost: list[tuple[ChunkRun, os.stat_result]]) -> None:
        for f in files:
            os.close(f.fd)
        for b in bufs:
            b.release()
        for run, st in lost:  # (after the close: NFS renames a file still open where it is unlinked)
            self._drop(run, st)

    def _header(self, f: _Open, hv: memoryview, entries: Sequence[Entry], out: list[str]) -> list[int] | None:
        """The checksums in run ``f``'s header (``hv``), with ``f.entries`` narrowed to the blocks the run shares
        with the caller's prompt (the others are ``"missing"``); ``None``: the header fails verification."""
        decoded = decode_header(hv, self.geom, f.run)
        if decoded is None:
            return None
        sums, shared, f.kind = decoded
        for j in f.entries:
            if entries[j][2] - f.run.start >= shared:  # another prompt's blocks there: this one's are not stored
                out[j] = "missing"
        f.entries = [j for j in f.entries if entries[j][2] - f.run.start < shared]
        return sums

    def _verify(self, f: _Open, sums: list[int], layers: range, entries: Sequence[Entry],
                targets: Sequence[memoryview], hv: memoryview) -> bool:
        """Whether each of ``f.entries``' slices of ``layers`` matches its checksum; read whole (``hv``: the file),
        the verified slices are copied into their targets (by a read still awaited only)."""
        lb, m, hb = self.geom.layer_bytes, f.run.m, chunk_header_bytes(self.geom, f.run.m)
        at = [(j, layer, hb + (layer * m + entries[j][2] - f.run.start) * lb) for j in f.entries for layer in layers]
        if self.read_whole:
            views = [hv[o:o + lb] for _j, _layer, o in at]
        else:  # read in place
            views = [targets[j][layer * lb:(layer + 1) * lb] for j, layer, _o in at]
        try:
            want = [sums[layer * m + entries[j][2] - f.run.start] for j, layer, _o in at]
            good = slice_sums(f.kind, views) == want
            if good and self.read_whole and not late():  # only a read still awaited copies out
                for (j, layer, _o), v in zip(at, views, strict=True):
                    targets[j][layer * lb:(layer + 1) * lb] = v
        finally:
            for v in views:
                v.release()
        return good

    def _read_steps(self, entries: Sequence[Entry], targets: Sequence[memoryview], files: list[_Open],
                    out: list[str], lost: list[tuple[ChunkRun, os.stat_result]], heads: list[RegisteredBuffer],
                    on_layer: Callable[[list[int], int], None] | None) -> None:
        """:meth:`read`'s ranges in steps, each one batch of the file path, verified as it lands. At once (no
        ``on_layer``): one step with each file's header and wanted slices (read whole: the whole file). Layer by
        layer: the headers, then one step per layer (a range per file read whole, else one per wanted block),
        ``_LAYERS_IN_FLIGHT`` steps submitted at a time, in order (enough to keep the disk busy, few enough that a
        layer's batch is not spread behind the later ones), each layer announced once verified."""
        lb, layers = self.geom.layer_bytes, self.geom.num_layers
        by_layer = on_layer is not None
        bufs: list[RegisteredBuffer] = []  # a file's header, or the whole file read whole
        for _f in files:
            bufs.append(self._bufs.acquire() if self.read_whole else self._heads.acquire())
            heads.append(bufs[-1])
        # (ranges, the file of each, whether it holds the headers, the layers it completes)
        steps: list[tuple[list[Range], list[int], bool, range]] = []
        for i, wanted in enumerate([range(0)] + [range(x, x + 1) for x in range(layers)] if by_layer
                                   else [range(layers)]):
            ranges: list[Range] = []
            owners: list[int] = []
            for n, f in enumerate(files):
                hb, m = chunk_header_bytes(self.geom, f.run.m), f.run.m
                if self.read_whole:
                    if i == 0:  # the header (and, at once, the whole body with it)
                        ranges.append(Range.read(0, hb + (0 if by_layer else m * self.geom.block_bytes), bufs[n],
                                                 0, f.fd))
                        owners.append(n)
                    if by_layer and wanted:
                        at = hb + wanted.start * m * lb
                        ranges.append(Range.read(at, m * lb, bufs[n], at, f.fd))
                        owners.append(n)
                    continue
                if i == 0:
                    ranges.append(Range.read(0, hb, bufs[n], 0, f.fd))
                    owners.append(n)
                for j in f.entries:
                    k = entries[j][2] - f.run.start
                    for layer in wanted:
                        ranges.append(Range.read(hb + (layer * m + k) * lb, lb, targets[j], layer * lb, f.fd))
                        owners.append(n)
            steps.append((ranges, owners, i == 0, wanted))
        depth = _LAYERS_IN_FLIGHT if by_layer else 1
        pending: list[_Started] = [None] * len(steps)
        try:
            for i in range(min(depth, len(steps))):  # (in the try: an error waits for these)
                pending[i] = self._start(steps[i][0])
            sums_of: dict[int, list[int]] = {}  # the files still good, and their checksums
            for i, (ranges, owners, header, wanted) in enumerate(steps):
                fut, pending[i] = pending[i], None
                results = self._finish(fut, len(ranges))
                if i + depth < len(steps):
                    pending[i + depth] = self._start(steps[i + depth][0])
                failed = {n for n, r, got in zip(owners, ranges, results, strict=True) if got != r.length}
                ready: list[int] = []
                for n, f in enumerate(files):
                    if not header and n not in sums_of:
                        continue  # failed at an earlier step
                    if n in failed:
                        self.tier.fp.file_failed()
                        for j in f.entries:
                            out[j] = "unreadable"
                        sums_of.pop(n, None)
                        continue
                    with memoryview(bufs[n]) as hv:
                        if header:
                            self.tier.fp.file_done()
                            sums = self._header(f, hv[:chunk_header_bytes(self.geom, f.run.m)], entries, out)
                        else:
                            sums = sums_of[n]
                        if sums is not None and (not wanted or self._verify(f, sums, wanted, entries, targets, hv)):
                            sums_of[n] = sums
                            ready.extend(f.entries)
                            continue
                    lost.append((f.run, f.st))
                    for j in f.entries:
                        out[j] = "corrupt"
                    sums_of.pop(n, None)
                if on_layer is not None and wanted and ready and not late():
                    on_layer(ready, wanted.stop - 1)
            for n in sums_of:
                self.tier.budget.touch(files[n].fd, files[n].st)
                for j in files[n].entries:
                    out[j] = "hit"
        finally:
            for fut in pending:  # (an error above: no read may still write once the files close)
                if fut is not None:
                    self._finish(fut, 0)

    def _start(self, ranges: list[Range]) -> _Started:
        """Submit ``ranges`` as one batch of the file path; the future, or the error (an empty batch: ``None``)."""
        if not ranges:
            return None
        try:
            return self.tier.fp.submit(ranges, data_class="kvcache.shared")
        except OSError as exc:
            return exc

    def _finish(self, fut: _Started, n: int) -> list[int | None]:
        """Each range's bytes moved (``None``: it failed) of a batch :meth:`_start` submitted."""
        if fut is None or isinstance(fut, OSError):
            return [None] * n
        try:
            return [r if r >= 0 else None for r in fut.results()]
        except OSError:
            return [None] * n

    def _open(self, run: ChunkRun) -> tuple[str, _Open | None, os.stat_result | None]:
        """Open a run's file for reading: ``("open", file, status)`` for a regular file of the run's size (made
        blocking, O_DIRECT where the file path uses it); else a miss's status, and the status of a regular file
        of another size (corrupt: to remove)."""
        try:
            fd = self.tier._open(run.rel, _READ_FLAGS)
        except OSError as exc:
            return ("missing" if exc.errno == errno.ENOENT else "unreadable"), None, None
        self.tier.counters.add(opens=1)
        try:
            st = os.fstat(fd)
            want = chunk_header_bytes(self.geom, run.m) + run.m * self.geom.block_bytes
            if not stat.S_ISREG(st.st_mode) or st.st_size != want:
                os.close(fd)
                regular = stat.S_ISREG(st.st_mode)
                return ("corrupt" if regular else "unreadable"), None, (st if regular else None)
            set_blocking(fd, direct=self.tier.fp.direct)
        except OSError:
            os.close(fd)
            self.tier.fp.file_failed()
            return "unreadable", None, None
        return "open", _Open(run, fd, st), st

    def _submit(self, ranges: list[Range]) -> list[int | None]:
        return self._finish(self._start(ranges), len(ranges))

    def _drop(self, run: ChunkRun, st: os.stat_result) -> None:
        sub, base = run.rel.split("/")
        gone = self.tier._unlink_if(sub, base, lambda now: (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino))
        if gone is not None and stat.S_ISREG(gone.st_mode):
            self.tier.budget.removed_bytes(gone.st_size)

    # -- writes -----------------------------------------------------------------------------------------------
    def plan(self, entries: Sequence[Entry]) -> tuple[list[tuple[ChunkRun, list[int]]], list[int]]:
        """The runs a batch of blocks makes: for each chunk whose blocks in the batch start at its first block and
        follow each other, ``(run, the entries in its order)``; and the entries of the other chunks (skipped)."""
        groups: dict[tuple[int, int], dict[int, int]] = {}
        for j, (_i, chain, pos) in enumerate(entries):
            groups.setdefault((id(chain), pos // self.per_chunk), {})[pos] = j
        runs: list[tuple[ChunkRun, list[int]]] = []
        skipped: list[int] = []
        for (_cid, c), by_pos in groups.items():
            chain = entries[next(iter(by_pos.values()))][1]
            start = c * self.per_chunk
            m = 0
            while start + m in by_pos and m < self.per_chunk:
                m += 1
            if m == 0:
                skipped += list(by_pos.values())
                continue
            run = ChunkRun(chain, start, m, self.per_chunk)
            runs.append((run, [by_pos[start + k] for k in range(m)]))
            skipped += [j for p, j in by_pos.items() if p >= start + m]
        return runs, skipped

    def build(self, run: ChunkRun, sources: Sequence[memoryview]) -> RegisteredBuffer:
        """The file of ``run`` in a registered buffer (the caller releases it): its blocks (``sources``, in order)
        copied layer-major after the header, each slice's xxh3-64 in the header."""
        lb, layers = self.geom.layer_bytes, self.geom.num_layers
        hb = chunk_header_bytes(self.geom, run.m)
        buf = self._bufs.acquire()
        try:
            with memoryview(buf) as v:
                for layer in range(layers):
                    for k, src in enumerate(sources):
                        at = hb + (layer * run.m + k) * lb
                        v[at:at + lb] = src[layer * lb:(layer + 1) * lb]
                body = [v[hb + i * lb:hb + (i + 1) * lb] for i in range(layers * run.m)]
                sums = xxh3_64_many(body)
                for b in body:
                    b.release()
                hdr = encode_header(self.geom, run, sums)
                v[:len(hdr)] = hdr
                v[len(hdr):hb] = bytes(hb - len(hdr))
        except BaseException:
            buf.release()
            raise
        return buf

    def write(self, run: ChunkRun, buf: RegisteredBuffer, body: Any = None, device: DevicePath | None = None) -> bool:
        """Publish ``run`` from ``buf`` (made by :meth:`build`; or its header, with the GPU ``body`` written
        through ``device``: made by :meth:`build_device`); ``False`` when it, or a longer run of its chunk, is there
        already. Shorter runs of the chunk are removed once it is published."""
        longer = self._runs_for(run.chain, run.start + run.m - 1)  # runs ending at or after this one's last block
        if any(self.tier._regular([r.rel for r in longer])):
            return False
        size = chunk_header_bytes(self.geom, run.m) + run.m * self.geom.block_bytes
        self.tier._register()
        with memoryview(buf) as v, self.tier.fp.open_writer(self.tier.prefix + run.rel, fsync=self.tier.fsync) as w:
            if body is None:
                w.write(v[:size])
            else:  # the header from host memory, the body on the device path's route (GPU-direct with cuFile)
                hb = chunk_header_bytes(self.geom, run.m)
                w.write(v[:hb])
                w.write_through(cast("DevicePath", device), body, size - hb, data_class="kvcache.shared")
            if late():
                raise _LateWrite
        self.tier._published(size)
        self._point(run)
        shorter = [ChunkRun(run.chain, run.start, m, self.per_chunk) for m in range(1, run.m)]
        for r, there in zip(shorter, self.tier._regular([r.rel for r in shorter]), strict=True):
            if there:
                self._remove_run(r)
        return True

    def _point(self, run: ChunkRun) -> None:
        """Make the chunk's link name ``run`` when there is none, it dangles, or it names a shorter run of the same
        prompt (best effort: a link is an aid to other prompts' lookups, never needed for this one's)."""
        sub, base = run.link.split("/")
        target = "../" + run.rel  # read as a name (never followed); as a path, the run's file beside the link's
        try:
            try:
                pfd = self.tier._open(sub, _O_PATH | os.O_DIRECTORY)
            except FileNotFoundError:  # the first key's subdirectory (the run is in its last key's)
                with contextlib.suppress(FileExistsError):
                    os.mkdir(sub, 0o777, dir_fd=self.tier._dir())
                pfd = self.tier._open(sub, _O_PATH | os.O_DIRECTORY)
        except OSError:
            return
        try:
            try:
                now = os.readlink(base, dir_fd=pfd)
            except FileNotFoundError:
                now = None
            except OSError:
                return  # something else at the name: left alone
            if now is not None:
                name = now.rpartition("/")[2]
                m = parse_name(name)
                keep = m is not None and (
                    m >= run.m or name.split(".")[0] != run.chain[run.start + m - 1].hex())
                if keep and self.tier._regular([now.removeprefix("../")])[0]:
                    return
            tmp = temp_name(base, "tmp")  # a writer killed before the rename leaves what gc removes
            os.symlink(target, tmp, dir_fd=pfd)
            try:
                os.rename(tmp, base, src_dir_fd=pfd, dst_dir_fd=pfd)
            except OSError:
                os.unlink(tmp, dir_fd=pfd)
        except OSError:
            pass
        finally:
            os.close(pfd)

    # -- GPU blocks: the device path ---------------------------------------------------------------------------
    def build_device(self, run: ChunkRun, blocks: Sequence[Any], device: DevicePath) -> tuple[RegisteredBuffer, Any]:
        """The file of ``run`` for GPU ``blocks`` (in order): ``(header, body)``, the header in a registered host
        buffer (the caller releases it), the body a GPU buffer the blocks are copied into layer-major, each
        slice's kvsum64 computed there. Made on the caller's thread, so a write past its deadline never reads
        the caller's blocks."""
        rt = device.runtime
        lb, layers = self.geom.layer_bytes, self.geom.num_layers
        body = rt.scratch(blocks[0], run.m * self.geom.block_bytes)
        for k, block in enumerate(blocks):  # block k's layer L goes to row L * m + k of the body
            rt.copy_rows(body, k * lb, run.m * lb, block, 0, lb, lb, layers)
        sums = rt.checksums(body, [i * lb for i in range(layers * run.m)], lb)
        hdr = encode_header(self.geom, run, sums, SumKind.KV64)
        hb = chunk_header_bytes(self.geom, run.m)
        head = self._heads.acquire()
        with memoryview(head) as v:
            v[:len(hdr)] = hdr
            v[len(hdr):hb] = bytes(hb - len(hdr))
        return head, body

    def read_device(self, entries: Sequence[Entry], dests: Sequence[Any], device: DevicePath,
                    on_layer: Callable[[list[int], int], None] | None = None) -> list[str]:
        """Read each entry's block into its GPU buffer (``dests``) on the device path: the files' headers into
        host memory, then each file's range of a layer (all layers at once without ``on_layer``; one step per
        layer, ``_LAYERS_IN_FLIGHT`` at a time, with it) into a buffer of the file's body, its wanted slices
        verified there and only then copied into ``dests``.

        A file of GPU-put blocks (kvsum64) is read into GPU memory on the device path's route for it
        (GPU-direct where cuFile takes the file) and verified on the GPU; a file of host-put blocks (xxh3-64,
        which a GPU does not compute) is read by the file path into host memory, verified there and copied up
        (counted ``bytes_staged``). Statuses as :meth:`read`; ``on_layer`` as there (a later layer can still
        fail a block whose earlier layers were delivered)."""
        def step(files: list[_Open], out: list[str], lost: list[tuple[ChunkRun, os.stat_result]],
                 bufs: list[RegisteredBuffer]) -> None:
            staged = self._device_heads(files, entries, out, lost, bufs, dests, device)
            self._device_steps(entries, dests, device, staged, out, lost, on_layer)

        return self._reading(entries, step)

    def _device_heads(self, files: list[_Open], entries: Sequence[Entry], out: list[str],
                      lost: list[tuple[ChunkRun, os.stat_result]], bufs: list[RegisteredBuffer],
                      dests: Sequence[Any], device: DevicePath) -> list[tuple[_Open, list[int], Any]]:
        """Read and check the files' headers (one batch of the file path); for each good file that answers an
        entry, ``(file, its checksums, a buffer for its body)``: GPU memory for kvsum64 files, host memory else."""
        heads = [self._heads.acquire() for _f in files]
        bufs.extend(heads)
        sizes = [chunk_header_bytes(self.geom, f.run.m) for f in files]
        got = self._submit([Range.read(0, hb, h, 0, f.fd) for f, h, hb in zip(files, heads, sizes, strict=True)])
        good: list[tuple[_Open, list[int], Any]] = []
        for f, h, hb, n in zip(files, heads, sizes, got, strict=True):
            if n != hb:
                self.tier.fp.file_failed()
                for j in f.entries:
                    out[j] = "unreadable"
                continue
            self.tier.fp.file_done()
            with memoryview(h) as hv:
                sums = self._header(f, hv[:hb], entries, out)
            if sums is None:
                lost.append((f.run, f.st))
                for j in f.entries:
                    out[j] = "corrupt"
                continue
            if not f.entries:
                continue
            if f.kind is SumKind.KV64:
                set_blocking(f.fd, direct=False)  # kvikio reopens the file itself
                body = device.runtime.scratch(dests[f.entries[0]], f.run.m * self.geom.block_bytes)
            else:
                body = self._bufs.acquire()
                bufs.append(body)
            good.append((f, sums, body))
        return good

    def _device_steps(self, entries: Sequence[Entry], dests: Sequence[Any], device: DevicePath,
                      files: list[tuple[_Open, list[int], Any]], out: list[str],
                      lost: list[tuple[ChunkRun, os.stat_result]],
                      on_layer: Callable[[list[int], int], None] | None) -> None:
        """The body reads of :meth:`read_device`, step by step, each verified and delivered as it lands."""
        lb = self.geom.layer_bytes
        steps = ([range(x, x + 1) for x in range(self.geom.num_layers)] if on_layer is not None
                 else [range(self.geom.num_layers)])
        depth = _LAYERS_IN_FLIGHT if on_layer is not None else 1
        alive = set(range(len(files)))

        def start(wanted: range) -> list[_Leg]:
            """Submit each live file's range of ``wanted``: GPU bodies on the device path, host bodies on the
            file path; ``(future or error, the files, the bytes each wants)`` per path."""
            legs: list[_Leg] = []
            for gpu in (True, False):
                ranges: list[Range] = []
                owners: list[int] = []
                for g in sorted(alive):
                    f, _sums, body = files[g]
                    if (f.kind is SumKind.KV64) != gpu:
                        continue
                    hb, m = chunk_header_bytes(self.geom, f.run.m), f.run.m
                    at = wanted.start * m * lb
                    ranges.append(Range.read(hb + at, len(wanted) * m * lb, body, at, f.fd))
                    owners.append(g)
                if not ranges:
                    continue
                fut: PathFuture | OSError
                try:
                    fut = (device.submit(ranges, data_class="kvcache.shared") if gpu
                           else self.tier.fp.submit(ranges, data_class="kvcache.shared"))
                except OSError as exc:
                    fut = exc
                legs.append((fut, owners, [r.length for r in ranges]))
            return legs

        def finish(legs: list[_Leg]) -> set[int]:
            """The files whose ranges of a step all came in whole."""
            whole: set[int] = set()
            for fut, owners, lengths in legs:
                got = self._finish(fut, len(owners))
                whole.update(g for g, n, want in zip(owners, got, lengths, strict=True) if n == want)
            return whole

        pending: list[list[_Leg] | None] = [None] * len(steps)
        legs: list[_Leg] | None
        try:
            for i in range(min(depth, len(steps))):  # (in the try: an error waits for these)
                pending[i] = start(steps[i])
            for i, wanted in enumerate(steps):
                legs, pending[i] = cast("list[_Leg]", pending[i]), None  # submitted ``depth`` steps ahead
                whole = finish(legs)
                ready: list[int] = []
                for g in sorted(alive):
                    f, sums, body = files[g]
                    if g not in whole:
                        self.tier.fp.file_failed()
                        status = "unreadable"
                    elif self._deliver(f, sums, body, wanted, entries, dests, device):
                        ready.extend(f.entries)
                        continue
                    elif f.kind is SumKind.KV64 and not self._damaged(f, sums, wanted, entries):
                        self.tier.counters.add(device_verify_disagreed=1)
                        warn_disagreement(f"a shared-tier chunk file ({f.run.m} blocks)")
                        status = "unreadable"
                    else:
                        lost.append((f.run, f.st))
                        status = "corrupt"
                    for j in f.entries:
                        out[j] = status
                    alive.discard(g)
                if i + depth < len(steps):
                    pending[i + depth] = start(steps[i + depth])
                if on_layer is not None and ready and not late():
                    on_layer(ready, wanted.stop - 1)
            for g in alive:
                f = files[g][0]
                self.tier.budget.touch(f.fd, f.st)
                for j in f.entries:
                    out[j] = "hit"
        finally:
            for legs in pending:  # (an error above: no read may still write once the files close)
                if legs is not None:
                    finish(legs)

    def _damaged(self, f: _Open, sums: list[int], layers: range, entries: Sequence[Entry]) -> bool:
        """Whether the slices of ``layers`` of ``f.entries`` that failed in GPU memory fail in host memory too
        (:mod:`sfstore.device_verdict`): only then is the file damaged and dropped."""
        lb, m = self.geom.layer_bytes, f.run.m
        hb = chunk_header_bytes(self.geom, m)
        at = [layer * m + entries[j][2] - f.run.start for j in f.entries for layer in layers]
        return damaged_on_storage(f.fd, [(hb + s * lb, lb, sums[s]) for s in at])

    def _deliver(self, f: _Open, sums: list[int], body: Any, layers: range, entries: Sequence[Entry],
                 dests: Sequence[Any], device: DevicePath) -> bool:
        """Whether each of ``f.entries``' slices of ``layers`` in ``body`` (the file's body, GPU or host memory)
        matches its checksum; if so, and the read is still awaited, they are copied into their GPU buffers."""
        rt, lb, m = device.runtime, self.geom.layer_bytes, f.run.m
        at = [(j, layer, layer * m + entries[j][2] - f.run.start) for j in f.entries for layer in layers]
        if f.kind is SumKind.KV64:
            if rt.checksums(body, [s * lb for _j, _layer, s in at], lb) != [sums[s] for _j, _layer, s in at]:
                return False
            if not late():
                for j in f.entries:  # the layers of block j: rows layer * m + k of the body
                    k = entries[j][2] - f.run.start
                    rt.copy_rows(dests[j], layers.start * lb, lb, body, (layers.start * m + k) * lb, m * lb, lb,
                                 len(layers))
            return True
        with memoryview(body) as v:
            views = [v[s * lb:(s + 1) * lb] for _j, _layer, s in at]
            try:
                if xxh3_64_many(views) != [sums[s] for _j, _layer, s in at]:
                    return False
                if not late():
                    for (j, layer, _s), piece in zip(at, views, strict=True):
                        device.stage_to_gpu(dests[j], layer * lb, piece, "kvcache.shared")
            finally:
                for piece in views:
                    piece.release()
        return True

    # -- removal ----------------------------------------------------------------------------------------------
    def _remove_run(self, run: ChunkRun) -> bool:
        sub, base = run.rel.split("/")
        gone = self.tier._unlink_if(sub, base, lambda st: not stat.S_ISDIR(st.st_mode))
        if gone is not None and stat.S_ISREG(gone.st_mode):
            self.tier.budget.removed_bytes(gone.st_size)
            return True
        return False

    def remove(self, chain: tuple[bytes, ...], pos: int) -> bool:
        """Remove every run that holds the block at ``pos`` (its chunk's other blocks go with it)."""
        runs = self._runs_for(chain, pos)
        removed = False
        for r, there in zip(runs, self.tier._regular([r.rel for r in runs]), strict=True):
            if there:
                removed |= self._remove_run(r)
        return removed


_READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY
_O_PATH = getattr(os, "O_PATH", os.O_RDONLY)


class _LateWrite(Exception):
    """A write whose caller gave up on it (its deadline passed): discarded, not published."""
