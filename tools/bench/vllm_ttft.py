"""One engine process of the ``vllm`` bench suite, run with the engine venv's Python (``.venv-vllm-engine``).

``python vllm_ttft.py SPEC.json OUT.json``. ``SPEC``: ``model``, ``connector`` (``none``, ``sfstore`` or
``example``: vLLM's ExampleConnector, which stores each request's KV as safetensors files in a directory),
``extra`` (the connector's extra config), ``prompts`` (token ids), ``repeat_same`` (time each prompt twice in this
process: the second is a hit from the pinned tier) and ``eager`` (vLLM's ``enforce_eager``; default off: the
model compiled, as vLLM runs it by default). Each prompt is one
``LLM.generate`` with ``max_tokens=1`` after a warm-up prompt: its wall time is the time to first token. ``OUT``:
``{"ttft_s": [...], "again_s": [...], "cached": [...], "cached_again": [...], "error": None}``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def main(spec: dict[str, Any]) -> dict[str, Any]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = dict(
        model=spec["model"], skip_tokenizer_init=True, dtype="float32", block_size=32, enable_prefix_caching=False,
        max_model_len=8192, seed=0, max_num_batched_tokens=8192, max_num_seqs=4,
        enforce_eager=bool(spec.get("eager", False)),
        kv_cache_memory_bytes=1 << 30,
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
    out: dict[str, Any] = {"ttft_s": [], "again_s": [], "cached": [], "cached_again": [], "error": None}
    for p in spec["prompts"]:
        for field, cached in (("ttft_s", "cached"), ("again_s", "cached_again"))[:2 if spec.get("repeat_same") else 1]:
            t0 = time.perf_counter()
            res = llm.generate([TokensPrompt(prompt_token_ids=p)], params, use_tqdm=False)
            out[field].append(time.perf_counter() - t0)
            out[cached].append(res[0].num_cached_tokens)
            if conn == "sfstore" and field == "ttft_s" and spec.get("repeat_same"):
                from sfstore.kvcache import vllm as sfvllm

                for entry in list(sfvllm._stores.values()):
                    entry[0].wait_for_puts()  # the shared files are complete before anything times them
    return out


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        spec_ = json.load(f)
    try:
        result = main(spec_)
    except Exception as exc:  # the bench reports why a side could not run
        result = {"error": f"{type(exc).__name__}: {exc}"}
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)
