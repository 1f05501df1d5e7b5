"""A gate in the shared tier's layer-by-layer chunk reads: each read's batches after its header's and its first
layer's wait until the test opens it, so a test can assert what a caller sees while the later layers are still
being read (an order, not a time)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from sfstore.kvcache.shared_chunks import ChunkFiles


class LayerGate:
    """Installed on :class:`ChunkFiles` by ``monkeypatch``; :meth:`open` lets every held batch through."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.opened = threading.Event()
        self.held_back = threading.Event()  # set once a read waits at the gate
        self._batches: dict[int, int] = {}  # thread -> batches it finished since its read started
        real_read, real_finish = ChunkFiles._read_steps, ChunkFiles._finish
        gate = self

        def read_steps(chunks: ChunkFiles, *args: Any) -> Any:
            if args[-1] is not None:  # on_layer: a layer-by-layer read
                gate._batches[threading.get_ident()] = 0
            else:
                gate._batches.pop(threading.get_ident(), None)
            return real_read(chunks, *args)

        def finish(chunks: ChunkFiles, fut: Any, n: int) -> Any:
            got = real_finish(chunks, fut, n)
            me = threading.get_ident()
            if me in gate._batches:
                gate._batches[me] += 1
                if gate._batches[me] > 2:  # the header batch and layer 0's pass; layer 1's waits
                    gate.held_back.set()
                    assert gate.opened.wait(20), "the test never opened the gate"
            return got

        monkeypatch.setattr(ChunkFiles, "_read_steps", read_steps)
        monkeypatch.setattr(ChunkFiles, "_finish", finish)

    def open(self) -> None:
        self.opened.set()
