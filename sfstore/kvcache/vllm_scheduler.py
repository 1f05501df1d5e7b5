"""The scheduler side of sfstore's vLLM connector (:class:`~sfstore.kvcache.vllm.SfstoreConnector` delegates to it
in vLLM's scheduler process): it answers vLLM's lookups from the store (leading blocks stored, worth loading or
not), tracks each running request's blocks, and plans each step's loads and saves into the metadata the workers
receive (:class:`SfstoreConnectorMetadata`). Its state is the requests it tracks; the worker side
(:mod:`sfstore.kvcache.vllm`) moves the blocks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from sfstore._optional import require

# E402 below: the imports come after these checks, so that a missing package is named with the extra to install
require("vllm", "vllm", "sfstore's vLLM KV connector (sfstore.kvcache.vllm)")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata  # noqa: E402
from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402

from sfstore import errors  # noqa: E402
from sfstore.kvcache.held import HeldBlocks  # noqa: E402
from sfstore.kvcache.store import KVCacheStore  # noqa: E402

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

__all__ = ["BlockTransfer", "SfstoreConnectorMetadata", "RequestTracker", "LoadsAhead", "SchedulerSide",
           "NOTHING_TO_SAVE"]

NOTHING_TO_SAVE = 1 << 62  # a tracker's saved_blocks when the request has no token ids to key on


@dataclasses.dataclass
class BlockTransfer:
    """Blocks of one request to move this step: store keys and the vLLM block ids they pair with."""

    req_id: str
    keys: list[bytes]
    block_ids: list[int]
    # saves only, for vLLM's KV events: each block's tokens and the key of the block before it
    token_ids: list[list[int]] | None = None
    parents: list[bytes | None] | None = None


@dataclasses.dataclass
class SfstoreConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    loads: list[BlockTransfer] = dataclasses.field(default_factory=list)
    saves: list[BlockTransfer] = dataclasses.field(default_factory=list)
    # tokens the step computes (all requests): with the step's time, the engine's prefill rate
    computed_tokens: int = 0


@dataclasses.dataclass
class RequestTracker:
    """Scheduler-side state of one running request."""

    req_id: str
    token_ids: Sequence[int]  # the request's (growing) token list
    extra: tuple[str, ...]
    prompt_len: int
    block_ids: list[int] = dataclasses.field(default_factory=list)
    saved_blocks: int = 0  # leading blocks already in the store or sent to be saved
    # leading blocks the lookup found in the store (the last one too, which vLLM recomputes for its last token)
    stored_blocks: int = 0


class LoadsAhead(Protocol):
    """Blocks the scheduler of a process holds for a worker of the same process to take (the connector's, one per
    store): the scheduler side puts and drops, the worker side takes and counts itself in."""

    workers: int

    @property
    def blocks(self) -> int: ...

    def put(self, req_id: str, keys: list[bytes], held: HeldBlocks | None) -> None: ...

    def take(self, req_id: str, keys: list[bytes]) -> HeldBlocks | None: ...

    def drop(self, req_id: str) -> None: ...

    def add_worker(self, n: int) -> None: ...


class SchedulerSide:
    """vLLM's scheduler-side hooks of the connector over ``store`` (see the module).

    Parameters
    ----------
    store : KVCacheStore
    block_tokens : int
        Tokens per block.
    save_decode_tokens : bool
        Save blocks of generated tokens too (not only the prompt's).
    ahead : LoadsAhead
        Where loads are held for a worker of this process to take.
    hold : callable
        ``hold(keys)``: start holding ``keys`` in the pinned tier (``None`` where that failed).
    """

    def __init__(self, store: KVCacheStore, block_tokens: int, save_decode_tokens: bool, ahead: LoadsAhead,
                 hold: Callable[[list[bytes]], HeldBlocks | None]) -> None:
        self.store, self.block_tokens, self.save_decode_tokens = store, block_tokens, save_decode_tokens
        self._ahead, self._hold = ahead, hold
        # req_id -> (computed tokens, blocks stored, the keys looked up) of its last lookup
        self._lookups: dict[str, tuple[int, int, list[bytes]]] = {}
        self._trackers: dict[str, RequestTracker] = {}
        self._pending_loads: dict[str, BlockTransfer] = {}
        self._host_hits: dict[str, int] = {}  # req_id -> its blocks to load that were in the pinned tier

    @staticmethod
    def _extra(request: Any) -> tuple[str, ...]:
        """What besides the tokens changes a request's KV: cache salt, LoRA adapter, multimodal inputs."""
        out: list[str] = []
        salt = getattr(request, "cache_salt", None)
        if salt:
            out.append(f"salt:{salt}")
        lora = getattr(request, "lora_request", None)
        if lora is not None:
            out.append(f"lora:{lora.lora_name}")
        for f in getattr(request, "mm_features", None) or ():
            out.append(f"mm:{f.identifier}")
        return tuple(out)

    def _cacheable_tokens(self, request: Request) -> Sequence[int] | None:
        if request.prompt_token_ids is None:  # prompt embeddings: no token ids to key on
            return None
        tokens: Sequence[int] = request.all_token_ids
        return tokens

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        tokens = self._cacheable_tokens(request)
        if tokens is None:
            return 0, False
        # never the whole sequence: vLLM computes at least its last token
        limit = (request.num_tokens - 1) // self.block_tokens * self.block_tokens
        if limit <= num_computed_tokens:
            return 0, False
        # The lookup covers every full block, the last one too (vLLM recomputes its last token, so that block is
        # never loaded): one more name in the same call to the shared tier, and the save that follows need not ask
        # again whether the block it recomputes is stored already.
        full = min(len(tokens), request.num_tokens) // self.block_tokens * self.block_tokens
        keys = self.store.keys_for(list(tokens[:max(full, limit)]), self._extra(request))
        found = self.store.leading_stored(keys) * self.block_tokens
        self._lookups[request.request_id] = (num_computed_tokens, found // self.block_tokens, keys)
        hit = max(0, min(found, limit) - num_computed_tokens)
        if hit > 0 and self.store.load_or_recompute.enabled:
            hit = self._worth_loading(keys, num_computed_tokens, hit)
        return hit, False

    def _worth_loading(self, prompt_keys: list[bytes], computed: int, hit: int) -> int:
        """The part of a hit worth loading: the blocks in the pinned tier at its start always; the rest only where
        the store's load-or-recompute figures expect loading them to be faster than computing them."""
        bt = self.block_tokens
        keys = prompt_keys[computed // bt:(computed + hit) // bt]
        lead = 0
        while lead < len(keys) and self.store.in_pinned(keys[lead]):
            lead += 1
        rest = keys[lead:]
        if not rest:
            return hit
        decision = self.store.load_or_recompute.decide(self.store.lower_tier_bytes(rest), len(rest) * bt)
        if decision.choice == "load":
            return hit
        self.store.counters.add(loads_declined=len(rest))
        self.store.load_or_recompute.declined_blocks += len(rest)
        return lead * bt

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        tokens = self._cacheable_tokens(request)
        start, stored, looked_up = self._lookups.pop(request.request_id, (0, 0, []))
        self._pending_loads.pop(request.request_id, None)
        if tokens is None:
            return
        tracker = self._trackers.get(request.request_id)
        if tracker is None:
            tracker = RequestTracker(request.request_id, tokens, self._extra(request), request.num_prompt_tokens)
            self._trackers[request.request_id] = tracker
        tracker.stored_blocks = stored
        if num_external_tokens <= 0:
            return
        bt = self.block_tokens
        if start % bt:
            raise errors.InvalidRequestError(
                f"request {request.request_id}: external tokens start at {start}, inside a block of {bt}"
            )
        block_ids = blocks.get_block_ids()[0]
        # a hit the scheduler cut short inside a block still loads that whole block (its tail is recomputed)
        first, last = start // bt, -(-(start + num_external_tokens) // bt)
        # the lookup's keys are the prompt's chained prefix hashes: those of a shorter prefix are their first ones
        keys = (looked_up[:last] if len(looked_up) >= last
                else self.store.keys_for(list(tokens[:last * bt]), self._extra(request)))[first:]
        self._pending_loads[request.request_id] = BlockTransfer(request.request_id, keys, list(block_ids[first:last]))
        tracker.saved_blocks = max(tracker.saved_blocks, last)  # loaded blocks are in the store already
        # where the blocks are now, before a prefetch promotes them (get_external_cache_hit_sources)
        self._host_hits[request.request_id] = self.store.pinned_count(keys)
        if self._ahead.workers and self._ahead.blocks + len(keys) <= self.store.pinned_capacity // 2:
            # a worker in this process takes it (its reads overlap the rest of the scheduler's step); what is held
            # ahead stays within what a step loads layer by layer (more is loaded chunk by chunk, not held)
            self._ahead.put(request.request_id, keys, self._hold(keys))

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[Any, int] | None:
        """Loaded tokens by where they are now: the pinned tier (host memory) or a lower tier (NVMe, NFS);
        ``None`` where this side has nothing to say (vLLM's default answer then)."""
        load = self._pending_loads.get(request.request_id)
        if num_external_tokens <= 0 or load is None:
            return None
        host = min(num_external_tokens, self._host_hits.get(request.request_id, 0) * self.block_tokens)
        out = {CacheHitSource.HOST: host, CacheHitSource.DISK: num_external_tokens - host}
        return {src: n for src, n in out.items() if n > 0}

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> SfstoreConnectorMetadata:
        meta = SfstoreConnectorMetadata()
        scheduled: list[tuple[RequestTracker, int]] = []
        for new in scheduler_output.scheduled_new_reqs:
            tracker = self._trackers.get(new.req_id)
            if tracker is None:
                prompt = list(new.prompt_token_ids or ())
                tracker = self._trackers[new.req_id] = RequestTracker(new.req_id, prompt, (), len(prompt))
                if new.prompt_token_ids is None:
                    tracker.saved_blocks = NOTHING_TO_SAVE  # nothing to key on
            tracker.block_ids = list(new.block_ids[0]) if new.block_ids else []
            self._recomputing(tracker, new.num_computed_tokens)
            done = new.num_computed_tokens + scheduler_output.num_scheduled_tokens.get(new.req_id, 0)
            scheduled.append((tracker, done))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracker = self._trackers.get(req_id)
            if tracker is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                tracker.block_ids = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                tracker.block_ids.extend(new_ids[0])
            self._recomputing(tracker, cached.num_computed_tokens[i])
            done = cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            scheduled.append((tracker, done))
        for tracker, _done in scheduled:
            load = self._pending_loads.pop(tracker.req_id, None)
            if load is not None:
                meta.loads.append(load)
        for tracker, done in scheduled:
            save = self._plan_save(tracker, done)
            if save is not None:
                meta.saves.append(save)
        self._pending_loads.clear()
        self._host_hits.clear()
        meta.computed_tokens = int(getattr(scheduler_output, "total_num_scheduled_tokens", 0) or 0)
        return meta

    def _recomputing(self, tracker: RequestTracker, computed: int) -> None:
        """A step that computes tokens of blocks counted as saved recomputes them: a load of them failed (vLLM
        moved the request back to the first block it could not load) or a hit was cut short inside a block. Plan
        their saves again (``_plan_save`` skips those still in the store), so a block dropped as corrupt is
        rewritten."""
        if tracker.saved_blocks < NOTHING_TO_SAVE and computed < tracker.saved_blocks * self.block_tokens:
            tracker.saved_blocks = computed // self.block_tokens
            tracker.stored_blocks = min(tracker.stored_blocks, tracker.saved_blocks)  # a failed one was dropped

    def _plan_save(self, tracker: RequestTracker, computed: int) -> BlockTransfer | None:
        bt = self.block_tokens
        tokens = tracker.token_ids
        limit = len(tokens) if self.save_decode_tokens else tracker.prompt_len
        end = min(computed, limit, len(tokens)) // bt
        end = min(end, len(tracker.block_ids))
        if end <= tracker.saved_blocks:
            return None
        keys = self.store.keys_for(list(tokens[:end * bt]), tracker.extra)
        first = tracker.saved_blocks
        tracker.saved_blocks = end
        # Blocks the lookup found are not asked about again (on a full hit, the last block, recomputed); the rest
        # in one question to the shared tier, not one per block.
        ask = list(range(max(first, tracker.stored_blocks), end))
        stored = self.store.contains_many([keys[i] for i in ask])
        chosen = [i for i, done in zip(ask, stored, strict=True) if not done]
        if not chosen:
            return None
        return BlockTransfer(tracker.req_id, [keys[i] for i in chosen], [tracker.block_ids[i] for i in chosen],
                             token_ids=[list(tokens[i * bt:(i + 1) * bt]) for i in chosen],
                             parents=[keys[i - 1] if i else None for i in chosen])

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._trackers.pop(request.request_id, None)
        self._ahead.drop(request.request_id)
        self._host_hits.pop(request.request_id, None)
        self._lookups.pop(request.request_id, None)
        self._pending_loads.pop(request.request_id, None)
        return False, None  # saves are copied out within their step: vLLM may free the blocks now
