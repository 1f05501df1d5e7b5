"""One vLLM engine run for the engine tier: ``python engine_run.py SPEC.json OUT.json`` (a child process per run).

``SPEC`` names the model directory, the connector's extra config (``null``: no connector), the engine settings and
the rounds of prompts (token ids); each round is one ``LLM.generate`` call, greedy. ``OUT`` gets, per round and
prompt, the generated token ids, ``num_cached_tokens`` and the finish reason, and (in-process engines only) the
connector's store statistics. Kept free of pytest so the engine runs exactly as a user's script would
(test_vllm_engine.py runs it).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from typing import Any


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _subscribe(endpoint: str, events: list[dict[str, Any]], stop: threading.Event) -> None:
    import msgspec
    import zmq
    from vllm.distributed.kv_events import KVEventBatch

    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.bind(endpoint)  # vLLM's publisher connects to a tcp endpoint without a wildcard (binds only to "*")
    sock.setsockopt(zmq.SUBSCRIBE, b"kv")
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    while not stop.is_set():
        if not poller.poll(100):
            continue
        _topic, _seq, payload = sock.recv_multipart()
        for e in decoder.decode(payload).events:
            hashes = getattr(e, "block_hashes", [])
            events.append({"type": type(e).__name__, "medium": getattr(e, "medium", None),
                           "hashes": [h.hex() if isinstance(h, bytes) else h for h in hashes],
                           "tokens": len(getattr(e, "token_ids", []) or [])})
    sock.close(0)


def _slow_on_purpose(cls: type, method: str, pause: float) -> None:
    """Make every call of ``cls.method`` in this process wait ``pause`` seconds first."""
    real = getattr(cls, method)

    def slowed(self: Any, *args: Any) -> Any:
        time.sleep(pause)
        return real(self, *args)

    setattr(cls, method, slowed)


def run(spec: dict[str, Any]) -> dict[str, Any]:
    if not spec.get("multiprocessing", False):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = dict(
        model=spec["model"], skip_tokenizer_init=True, dtype="float32", block_size=spec.get("block_size", 32),
        enable_prefix_caching=False, max_model_len=spec.get("max_model_len", 2048), seed=0,
        max_num_batched_tokens=spec.get("max_num_batched_tokens", 2048), max_num_seqs=spec.get("max_num_seqs", 8),
        enable_chunked_prefill=True, enforce_eager=True, kv_cache_memory_bytes=spec.get("kv_cache_bytes", 256 << 20),
    )
    if spec.get("kv") is not None:
        kv: dict[str, Any] = {"kv_connector": "SfstoreConnector", "kv_connector_module_path": "sfstore.kvcache.vllm",
                              "kv_role": "kv_both", "kv_connector_extra_config": spec["kv"]}
        kv.update(spec.get("kv_transfer", {}))
        kwargs["kv_transfer_config"] = kv
    events: list[dict[str, Any]] = []
    stop = threading.Event()
    sub = None
    if spec.get("kv_events"):
        # vLLM's own ZMQ publisher, and a subscriber as a router (Dynamo, llm-d) runs one; it binds, vLLM connects
        port = _free_port()
        kwargs["kv_events_config"] = {"enable_kv_cache_events": True, "publisher": "zmq",
                                      "endpoint": f"tcp://127.0.0.1:{port}", "topic": "kv"}
        sub = threading.Thread(target=_subscribe, args=(f"tcp://127.0.0.1:{port}", events, stop), daemon=True)
        sub.start()
    if spec.get("stats"):
        kwargs["disable_log_stats"] = False
    if spec.get("slow_shared_read_s"):
        # the shared tier slowed on purpose (a congested server, as no disk of this machine is): every read of
        # it first waits this long, inside the store's own call (its deadline and rates see the wait)
        from sfstore.kvcache.tiers import SharedTier

        _slow_on_purpose(SharedTier, "read_into", float(spec["slow_shared_read_s"]))
    if spec.get("slow_shared_layer_s"):
        # each batch of a layer-by-layer chunk read (its headers, then each layer) slowed on purpose, as a
        # congested server would: the engine's first layers can load while the later ones are still being read
        from sfstore.kvcache.shared_chunks import ChunkFiles

        _slow_on_purpose(ChunkFiles, "_finish", float(spec["slow_shared_layer_s"]))
    llm = LLM(**kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=spec.get("max_tokens", 8), detokenize=False)
    rounds = []
    for prompts in spec["rounds"]:
        t0 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        took = time.perf_counter() - t0
        rounds.append([{"tokens": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens,
                        "finish": o.outputs[0].finish_reason, "seconds": took} for o in outs])
    if spec.get("stats"):
        llm.llm_engine.do_log_stats()  # vLLM's stat logger prints the connector's stats ("KV Transfer metrics")
    if sub is not None:
        time.sleep(1.0)  # the publisher's thread sends what the last steps queued
        stop.set()
        sub.join(5)
    result: dict[str, Any] = {"rounds": rounds, "stats": None, "events": events}
    if spec.get("kv") is not None and not spec.get("multiprocessing", False):
        from sfstore.kvcache import vllm as sfvllm

        stores = [entry[0] for entry in sfvllm._stores.values()]
        if stores:
            stats = stores[0].stats()
            result["stats"] = {k: v for k, v in stats.items() if isinstance(v, (int, float, str, dict, list))}
            if stores[0].shared is not None:
                result["shared_io"] = stores[0].shared.fp.counters.snapshot()
            g = stores[0].geometry  # so that a test can read the tiers the engine left
            result["geometry"] = {"num_layers": g.num_layers, "block_tokens": g.block_tokens,
                                  "num_kv_heads": g.num_kv_heads, "head_dim": g.head_dim, "dtype": g.dtype}
            # each prompt's block keys (as named in the shared directory), so a test can damage chosen blocks
            result["keys"] = [[k.hex() for k in stores[0].keys_for(p)] for p in spec["rounds"][0]]
    return result


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        spec_ = json.load(f)
    out = run(spec_)
    with open(sys.argv[2], "w") as f:
        json.dump(out, f, default=str)
    # the engine's own shutdown (its store closes and drains its background writes) runs at exit
