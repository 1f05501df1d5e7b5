"""Load or recompute: whether handing back a cached prefix from a tier is expected to be faster than computing it.

A storage tier can be slower than the engine's prefill (a congested NFS server, a small model on a fast GPU):
loading from it then makes the time to first token worse than a miss would. :class:`LoadOrRecompute` keeps two
figures, each measured by the store and the engine themselves, never configured: each tier's load rate (bytes
per second of its hits, from the store's own reads) and the engine's prefill rate (tokens per second of the steps
that computed prompt tokens, from the engine's own misses). A hit from a tier is worth loading when its bytes
take less time at the tier's rate than its tokens at the prefill rate. Until both figures are known a hit is
loaded; a tier declined for ``probe_s`` is loaded once more, so a tier that recovers is noticed.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["LoadOrRecompute", "Decision"]

_WEIGHT = 0.3  # of the newest sample in a rate's moving average


@dataclass(frozen=True)
class Decision:
    """One decision: ``choice``, and the figures it was made from (``None``: not known yet)."""

    choice: Literal["load", "recompute"]
    load_s: float | None
    recompute_s: float | None
    why: str


class LoadOrRecompute:
    """Rates measured by a store and its engine, and the decision they give (see the module). Thread-safe."""

    def __init__(self, enabled: bool = True, probe_s: float = 10.0) -> None:
        self.enabled = enabled
        self.probe_s = probe_s
        self._lock = threading.Lock()
        self._rates: dict[str, float] = {}  # tier -> bytes per second of its loads
        self._last_load: dict[str, float] = {}  # tier -> monotonic time of its last load
        self._prefill: float | None = None  # tokens per second of the engine's prefill
        self.declined_blocks = 0
        self.decisions = {"load": 0, "recompute": 0}
        self.last: Decision | None = None

    def note_load(self, tier: str, nbytes: int, seconds: float) -> None:
        """A tier's read of ``nbytes`` of hits took ``seconds``."""
        if nbytes <= 0 or seconds <= 0:
            return
        rate = nbytes / seconds
        with self._lock:
            old = self._rates.get(tier)
            self._rates[tier] = rate if old is None else (1 - _WEIGHT) * old + _WEIGHT * rate
            self._last_load[tier] = time.monotonic()

    def note_prefill(self, tokens: int, seconds: float) -> None:
        """The engine computed ``tokens`` prompt tokens in ``seconds``."""
        if tokens <= 0 or seconds <= 0:
            return
        rate = tokens / seconds
        with self._lock:
            old = self._prefill
            self._prefill = rate if old is None else (1 - _WEIGHT) * old + _WEIGHT * rate

    def decide(self, bytes_by_tier: dict[str, int], tokens: int) -> Decision:
        """Whether to load ``tokens`` whose blocks are ``bytes_by_tier`` in the lower tiers, or recompute them."""
        with self._lock:
            if not self.enabled:
                return self._note(Decision("load", None, None, "load-or-recompute is off"))
            if self._prefill is None:
                return self._note(Decision("load", None, None, "the engine's prefill rate is not measured yet"))
            recompute_s = tokens / self._prefill
            load_s = 0.0
            now = time.monotonic()
            for tier, nbytes in bytes_by_tier.items():
                rate = self._rates.get(tier)
                if rate is None:
                    return self._note(Decision("load", None, recompute_s, f"the {tier} tier's rate is not measured"))
                if now - self._last_load.get(tier, now) >= self.probe_s:
                    return self._note(Decision("load", None, recompute_s,
                                               f"the {tier} tier is probed again (not loaded from for a while)"))
                load_s += nbytes / rate
            if load_s <= recompute_s:
                return self._note(Decision("load", load_s, recompute_s, "loading is faster"))
            return self._note(Decision("recompute", load_s, recompute_s, "recomputing is faster"))

    def _note(self, d: Decision) -> Decision:
        self.decisions[d.choice] += 1
        self.last = d
        return d

    def describe(self) -> dict[str, Any]:
        """The figures and the decisions so far (for ``stats()`` and the engine's metrics)."""
        with self._lock:
            last = self.last
            return {
                "enabled": self.enabled,
                "load_bytes_per_s": dict(self._rates),
                "prefill_tokens_per_s": self._prefill,
                "decisions": dict(self.decisions),
                "declined_blocks": self.declined_blocks,
                "last": None if last is None else {"choice": last.choice, "load_s": last.load_s,
                                                   "recompute_s": last.recompute_s, "why": last.why},
            }
