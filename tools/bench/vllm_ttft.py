"""One engine process of the ``vllm`` bench suite, run with the engine venv's Python (``.venv-vllm-engine``).

``python vllm_ttft.py SPEC.json``. ``SPEC``: ``model``, ``connector`` (``none``, ``sfstore`` or ``example``: vLLM's
ExampleConnector, which stores each request's KV as safetensors files in a directory), ``extra`` (the connector's
extra config), ``eager`` (vLLM's ``enforce_eager``; default off: the model compiled, as vLLM runs it by default) and
``kv_cache_bytes`` (vLLM's ``kv_cache_memory_bytes``, default 256 MiB).

The process builds its engine, runs a warm-up prompt, prints ``@@ready {"vllm": version, "sfstore_from": path}``
and then serves the suite, which keeps every side's process alive and interleaves them prompt by prompt (so a change
of load on the machine hits every side alike): each line on stdin is a JSON command, ``{"prompt": [token ids],
"repeat": 1 or 2, "wait_puts": bool, "floor": bool}``; each prompt is one ``LLM.generate`` with ``max_tokens=1``
(its wall time is the time to first token), ``repeat`` 2 times it again at once (a hit from the pinned tier),
``wait_puts`` waits after each pass until sfstore's blocks reached the shared tier (outside the timings),
``floor`` (sfstore only) times the prompt once more with the connector's loads cut out (``floor_s``: vLLM's own time
for the hit, the least any connector could reach). The answer is one line ``@@reply {"ttft_s": [...], "cached":
[...]}`` (``cached``: vLLM's ``num_cached_tokens`` of each pass; with sfstore also ``deadline_misses``, its
operations past their deadline in this process so far), or ``@@error {"error": ...}``; ``{"quit": true}`` ends the
process. Lines without the ``@@`` prefix are vLLM's own output.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

PREFIX = "@@"


def _say(kind: str, body: dict[str, Any]) -> None:
    sys.stdout.write(f"{PREFIX}{kind} {json.dumps(body)}\n")
    sys.stdout.flush()


def build(spec: dict[str, Any]) -> Any:
    """The engine of ``spec``, after one warm-up prompt."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = dict(
        model=spec["model"], skip_tokenizer_init=True, dtype="float32", block_size=32, enable_prefix_caching=False,
        max_model_len=8192, seed=0, max_num_batched_tokens=8192, max_num_seqs=4,
        enforce_eager=bool(spec.get("eager", False)),
        kv_cache_memory_bytes=int(spec.get("kv_cache_bytes", 256 << 20)),
    )
    conn = spec["connector"]
    if conn == "sfstore":
        kwargs["kv_transfer_config"] = {"kv_connector": "SfstoreConnector", "kv_role": "kv_both",
                                        "kv_connector_module_path": "sfstore.kvcache.vllm",
                                        "kv_connector_extra_config": spec.get("extra", {})}
    elif conn == "example":
        kwargs["kv_transfer_config"] = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                                        "kv_connector_extra_config": spec.get("extra", {})}
    llm = LLM(**kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
    llm.generate([TokensPrompt(prompt_token_ids=[(i * 7919) % 8192 for i in range(64)])], params, use_tqdm=False)
    return llm, params, TokensPrompt


def _floor_pass(llm: Any, params: Any, prompt: Any) -> float:
    """TTFT of ``prompt`` (a hit) with the connector's loads cut out: the scheduler still reports the hit, so vLLM
    computes only the last block, but nothing is copied into the pages (the output is meaningless: timing only).
    What is left is vLLM's own time for a hit, the least any connector could reach."""
    from sfstore.kvcache.vllm import SfstoreConnector as C

    real = (C.start_load_kv, C.wait_for_layer_load)
    C.start_load_kv = lambda self, forward_context, **kw: None  # type: ignore[method-assign]
    C.wait_for_layer_load = lambda self, layer_name: None  # type: ignore[method-assign]
    try:
        t0 = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        return time.perf_counter() - t0
    finally:
        C.start_load_kv, C.wait_for_layer_load = real  # type: ignore[method-assign]


def _wait_puts(spec: dict[str, Any]) -> None:
    """Wait until sfstore's puts of this process reached the shared tier: its files are complete, and no write of
    this process runs in the background, before anything else is timed."""
    if spec["connector"] != "sfstore":
        return
    from sfstore.kvcache import vllm as sfvllm

    for entry in list(sfvllm._stores.values()):
        entry[0].wait_for_puts()


def _deadline_misses() -> int | None:
    """sfstore's tier operations past their deadline in this process so far (a load past it is a miss: the hit
    is cut short there), or None where its stats do not say."""
    from sfstore.kvcache import vllm as sfvllm

    try:
        return sum(int(entry[0].stats()["deadline_misses"]) for entry in list(sfvllm._stores.values()))
    except (KeyError, TypeError, ValueError, AttributeError, OSError):
        return None


def serve(spec: dict[str, Any]) -> None:
    """Build the engine, then answer commands from stdin until ``quit`` or end of input."""
    try:
        llm, params, tokens_prompt = build(spec)
    except Exception as exc:  # the bench reports why a side could not run
        _say("error", {"error": f"{type(exc).__name__}: {exc}"})
        return
    import vllm

    import sfstore

    _say("ready", {"vllm": vllm.__version__, "sfstore_from": sfstore.__path__[0]})
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        if cmd.get("quit"):
            return
        try:
            out: dict[str, Any] = {"ttft_s": [], "cached": []}
            for _ in range(int(cmd.get("repeat", 1))):
                t0 = time.perf_counter()
                res = llm.generate([tokens_prompt(prompt_token_ids=cmd["prompt"])], params, use_tqdm=False)
                out["ttft_s"].append(time.perf_counter() - t0)
                out["cached"].append(res[0].num_cached_tokens)
                if cmd.get("wait_puts"):
                    _wait_puts(spec)
            if cmd.get("floor") and spec["connector"] == "sfstore":
                out["floor_s"] = _floor_pass(llm, params, tokens_prompt(prompt_token_ids=cmd["prompt"]))
                if cmd.get("wait_puts"):
                    _wait_puts(spec)
            if spec["connector"] == "sfstore":
                out["deadline_misses"] = _deadline_misses()
        except Exception as exc:
            _say("error", {"error": f"{type(exc).__name__}: {exc}"})
            continue
        _say("reply", out)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        serve(json.load(f))
