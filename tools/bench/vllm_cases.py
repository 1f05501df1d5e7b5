"""What the ``vllm`` bench suite measures and how it judges it: the models it builds, the pairs of sides it compares,
the physical bound of a hit, and the goals of the issues.

No engine runs here: the suite (:mod:`tools.bench.suites.vllm`) measures each side's time to first token (TTFT) and
hands the per-length entries to :func:`pair_cases`.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass
from typing import Any

__all__ = ["BenchModel", "MODELS", "BLOCK_TOKENS", "Goal", "GOALS", "PAIRS", "parse_models", "physical_bound",
           "bound_line", "pair_cases"]

#: vLLM's block size in every engine of the suite (``block_size=32``): one block of the connectors is this many tokens
BLOCK_TOKENS = 32
#: vLLM's ``max_model_len`` in every engine of the suite
MAX_MODEL_LEN = 8192
#: the KV cache every engine gets at least (``kv_cache_memory_bytes``)
MIN_KV_CACHE_BYTES = 256 << 20


@dataclass(frozen=True)
class BenchModel:
    """A random Llama the suite builds (``transformers.LlamaConfig``) and serves in float32.

    Attributes
    ----------
    name : str
        The name in ``--models``, case names and the bench directory.
    layers, hidden, intermediate, heads, kv_heads : int
        ``num_hidden_layers``, ``hidden_size``, ``intermediate_size``, ``num_attention_heads``,
        ``num_key_value_heads``.
    head_dim : int or None
        ``head_dim`` when the config sets it (wide KV heads beside a small hidden size, so compute stays cheap);
        None: ``hidden / heads``, as in Llama.
    vocab : int
        ``vocab_size``; prompts are random token ids below it.
    """

    name: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int | None = None
    vocab: int = 8192

    #: bytes of one KV element (the engines run float32)
    DTYPE_BYTES = 4

    def config(self) -> dict[str, Any]:
        """The ``transformers.LlamaConfig`` keyword arguments of the model."""
        cfg: dict[str, Any] = dict(vocab_size=self.vocab, hidden_size=self.hidden,
                                   intermediate_size=self.intermediate, num_hidden_layers=self.layers,
                                   num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
                                   max_position_embeddings=MAX_MODEL_LEN, initializer_range=0.1)
        if self.head_dim is not None:
            cfg["head_dim"] = self.head_dim
        return cfg

    def block_bytes(self, tokens: int = BLOCK_TOKENS) -> int:
        """KV bytes of ``tokens`` tokens over all layers (keys and values), computed from :meth:`config`: what one
        connector block holds."""
        return tokens * kv_bytes_per_token(self.config(), self.DTYPE_BYTES)

    def kv_cache_bytes(self) -> int:
        """vLLM's ``kv_cache_memory_bytes`` for the model: two ``max_model_len`` prompts' KV, at least
        :data:`MIN_KV_CACHE_BYTES` (a 4096-token prompt of the wide model needs 128 MiB)."""
        return max(MIN_KV_CACHE_BYTES, 2 * MAX_MODEL_LEN * kv_bytes_per_token(self.config(), self.DTYPE_BYTES))


def kv_bytes_per_token(config: dict[str, Any], dtype_bytes: int) -> int:
    """KV bytes of one token of a Llama ``config`` (``LlamaConfig`` keyword arguments or attributes): layers x
    (key + value) x KV heads x head size x element size, the head size being ``head_dim`` where the config sets it,
    else ``hidden_size / num_attention_heads``."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return int(config["num_hidden_layers"]) * 2 * int(config["num_key_value_heads"]) * int(head_dim) * dtype_bytes


#: The models ``--models`` picks from: the engine tier's tiny one (128 KiB blocks: a sfstore file of 132 KiB) and
#: one whose blocks have the size of a real model's (1 MiB per 32-token block; hidden size and vocabulary small so
#: that the forward pass stays cheap on a CPU)
MODELS = {
    "tiny": BenchModel("tiny", layers=4, hidden=256, intermediate=512, heads=4, kv_heads=2),
    "wide": BenchModel("wide", layers=4, hidden=256, intermediate=512, heads=8, kv_heads=8, head_dim=128),
}


def parse_models(text: str) -> list[BenchModel]:
    """An ``argparse`` type: ``tiny,wide`` -> the models, in the order given, each once.

    Raises
    ------
    argparse.ArgumentTypeError
        For an empty list or a name that is not in :data:`MODELS`.
    """
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODELS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown model {', '.join(unknown) or '(none given)'}: "
                                         f"choose from {', '.join(MODELS)}")
    return [MODELS[n] for n in dict.fromkeys(names)]


#: (our side, the other side): one common-shape case each per model and prompt length. ``bound`` is the physical
#: bound of a hit (:func:`physical_bound`)
PAIRS = (("sfstore-shared-cold", "none"), ("sfstore-pinned", "none"), ("sfstore-shared-cold", "example-cold"),
         ("sfstore-pinned", "example-warm"), ("sfstore-shared-cold", "bound"), ("sfstore-miss", "none"))
REFERENCE_TOOLS = {"none": "vLLM, no connector", "example-cold": "vLLM ExampleConnector",
                   "example-warm": "vLLM ExampleConnector", "bound": "physical bound (max of floor and fio)"}


@dataclass(frozen=True)
class Goal:
    """One goal on a pair's ratio (the other side's TTFT over ours), at each of ``lengths`` tokens.

    Attributes
    ----------
    issue : int
        The issue that set it.
    model : str
        The model (:data:`MODELS`).
    ours, other : str
        The pair.
    target : float
        The least ratio that meets it: ``2.5`` is "2.5x faster", ``1 / 1.3`` "TTFT at most 1.3x the other's".
    lengths : tuple of int
        Prompt lengths it is judged at.
    """

    issue: int
    model: str
    ours: str
    other: str
    target: float
    lengths: tuple[int, ...]

    def text(self, n: int) -> str:
        """What it asks, at ``n`` tokens."""
        head = f"issue {self.issue}: {self.model} model, {n}-token TTFT, {self.ours}"
        if self.other == "bound":
            return f"{head} <= {1 / self.target:.2g}x the physical bound"
        if self.target < 1 or self.other == "none":
            return f"{head} <= {1 / self.target:.2g}x {self.other}"
        if self.target == 1:
            return f"{head} at least as fast as {self.other}"
        return f"{head} >= {self.target:.2g}x faster than {self.other}"


#: issue 27's acceptance (both models, 1536 and 4096 tokens), then issue 16's goals against no connector (the tiny
#: model at 1536 tokens). Issue 16's goals of 1.5x against ``ExampleConnector`` gave way to issue 27's per model
GOALS = (
    Goal(27, "wide", "sfstore-shared-cold", "bound", 1 / 1.3, (1536, 4096)),
    Goal(27, "wide", "sfstore-shared-cold", "example-cold", 2.5, (1536, 4096)),
    Goal(27, "tiny", "sfstore-shared-cold", "example-cold", 1.3, (1536, 4096)),
    Goal(27, "tiny", "sfstore-pinned", "example-warm", 1.0, (1536, 4096)),
    Goal(16, "tiny", "sfstore-shared-cold", "none", 0.5 ** -1, (1536,)),
    Goal(16, "tiny", "sfstore-pinned", "none", 0.2 ** -1, (1536,)),
)


def _summary(samples: list[float]) -> dict[str, Any]:
    return {"median_s": statistics.median(samples), "min_s": min(samples), "max_s": max(samples),
            "samples_s": samples}


def physical_bound(floor: dict[str, Any] | None, fio: dict[str, Any] | None) -> dict[str, Any]:
    """The least TTFT any connector could reach on each prompt: the larger of vLLM's own time for the hit (the
    floor) and fio's cold O_DIRECT read of the prompt's shared-tier files.

    Parameters
    ----------
    floor, fio : dict or None
        The two sides' summaries (``samples_s`` in prompt order), or ``{"error": ...}``.

    Returns
    -------
    dict
        A side summary of the per-prompt maxima, with ``limited_by`` (``floor`` or ``fio`` per prompt), or
        ``{"error": ...}`` when either side has no samples or their counts differ.
    """
    for name, side in (("floor", floor), ("fio", fio)):
        if not side or not side.get("samples_s"):
            why = (side or {}).get("error") or "no samples"
            return {"error": f"no {name}: {why}"}
    assert floor is not None and fio is not None
    a, b = list(floor["samples_s"]), list(fio["samples_s"])
    if len(a) != len(b):
        return {"error": f"{len(a)} floor samples but {len(b)} fio samples"}
    out = _summary([max(x, y) for x, y in zip(a, b, strict=True)])
    out["limited_by"] = ["fio" if y > x else "floor" for x, y in zip(a, b, strict=True)]
    return out


def _ms(side: dict[str, Any] | None) -> str:
    return f"{float(side['median_s']) * 1e3:.1f} ms" if side and "median_s" in side else "n/a"


def bound_line(entry: dict[str, Any]) -> str:
    """One line on a ``ttft`` entry's physical bound: the bound, what it comes from, and each hit's TTFT over it."""
    sides = entry.get("sides", {})
    bound, fio = sides.get("bound") or {}, sides.get("fio") or {}
    head = f"{entry.get('name', '?')}: physical bound"
    if "median_s" not in bound:
        return f"{head} n/a ({bound.get('error', 'not measured')})"
    text = f"{head} {_ms(bound)} (floor {_ms(sides.get('floor'))}, fio {_ms(fio)}"
    if fio.get("bytes"):
        size = statistics.median(fio["bytes"])
        text += f" for {statistics.median(fio.get('files') or [0]):.0f} files, {size / (1 << 20):.1f} MiB"
        text += f" at {size / float(fio['median_s']) / (1 << 20):.0f} MiB/s"
    text += ")"
    over = [f"{s} {float(sides[s]['median_s']) / float(bound['median_s']):.2f}x"
            for s in ("sfstore-shared-cold", "sfstore-pinned", "example-cold", "example-warm")
            if "median_s" in (sides.get(s) or {})]
    return text + ("; TTFT over it: " + ", ".join(over) if over else "")


def _short(side: str) -> str:
    return side.removeprefix("sfstore-").removesuffix("-cold") if side != "sfstore-shared-cold" else "shared-cold"


def _entry_key(entry: dict[str, Any]) -> tuple[str, int]:
    params = entry["params"]
    return str(params.get("model", "tiny")), int(params["prompt_tokens"])  # the suite ran only "tiny" before


def _case(entry: dict[str, Any], ours: str, other: str) -> dict[str, Any] | None:
    a, b = entry["sides"].get(ours), entry["sides"].get(other)
    if a is None or b is None:
        return None
    model, n = _entry_key(entry)
    case: dict[str, Any] = {"name": f"{model}-ttft-{n}-{_short(ours)}-vs-{_short(other)}",
                            "params": {"model": model, "prompt_tokens": n, "side": ours, "versus": other},
                            "sfstore": a, "reference_tool": REFERENCE_TOOLS.get(other, other), "reference": b,
                            "ratio": None, "ratio_min": None, "ratio_max": None}
    if "median_s" in a and "median_s" in b:
        per = [y / x for x, y in zip(a["samples_s"], b["samples_s"], strict=False) if x > 0]
        case.update(ratio=statistics.median(per), ratio_min=min(per), ratio_max=max(per),
                    ttft_ratio=a["median_s"] / b["median_s"])
    return case


def _judge(goal: Goal, n: int, entry: dict[str, Any] | None, case: dict[str, Any] | None) -> dict[str, Any]:
    text = goal.text(n)
    item: dict[str, Any] = {"goal": text, "issue": goal.issue, "model": goal.model, "prompt_tokens": n,
                            "target": goal.target}
    if entry is None or case is None:
        why = "this model and length were not run" if entry is None else f"no {goal.ours} or {goal.other} side"
        item.update(status="not run", met=None, reason=why, line=f"goal: {text}: not run ({why})")
        return item
    item["case"] = case["name"]
    if case["ratio"] is None:
        why = case["sfstore"].get("error") or case["reference"].get("error") or "no samples"
        item.update(status="n/a", met=None, reason=why, line=f"goal: {text}: n/a ({why})")
        return item
    r = float(case["ratio"])
    met = r >= goal.target
    verdict = "PASS" if met else "MISS"
    if goal.other == "bound":
        line = f"goal: {text}: {verdict}, TTFT {1 / r:.2f}x the bound"
    else:
        line = f"goal: {text}: {verdict}, TTFT {1 / r:.2f}x ({r:.2f}x faster)"
    sides = entry["sides"]
    floor, other = sides.get("floor") or {}, case["reference"]
    if goal.other != "bound" and floor.get("median_s"):
        item["bound"] = float(other["median_s"]) / float(floor["median_s"])
        line += f"; a connector with free loads: {item['bound']:.2f}x"
    pinned = sides.get("sfstore-pinned") or {}
    if goal.ours == "sfstore-shared-cold" and goal.other not in ("none", "bound") and pinned.get("median_s"):
        # sfstore's pinned hit is the same hit with nothing read from disk: no cold read can beat it
        item["bound_no_disk"] = float(other["median_s"]) / float(pinned["median_s"])
        line += f"; a cold read costing no more than a pinned hit: {item['bound_no_disk']:.2f}x"
    item.update(ratio=r, status="met" if met else "missed", met=met, line=line)
    if not met:
        item["missed_by"] = goal.target - r
    return item


def pair_cases(ttft: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The common-shape cases (one per pair of sides, model and prompt length) and the goals, from the ``ttft``
    entries.

    Parameters
    ----------
    ttft : list of dict
        Per model and prompt length: ``name``, ``params`` (``model``, ``prompt_tokens``) and ``sides`` (side name
        -> its summary, with ``samples_s`` in prompt order, or ``error``).

    Returns
    -------
    tuple
        ``(cases, acceptance)``. A case's ``ratio`` is the other side's TTFT over ours, the median of the per-prompt
        ratios (``ratio_min``, ``ratio_max``); ``ttft_ratio`` is ours over theirs, medians. ``acceptance`` holds one
        entry per goal of :data:`GOALS` and length (``goal``, ``case``, ``target`` on ``ratio``, ``status``:
        ``met``, ``missed``, ``n/a`` (a side failed) or ``not run``; ``met``, ``line``).
    """
    cases: list[dict[str, Any]] = []
    by_key: dict[tuple[str, int, str, str], dict[str, Any]] = {}
    entries: dict[tuple[str, int], dict[str, Any]] = {}
    for entry in ttft:
        key = _entry_key(entry)
        entries[key] = entry
        for ours, other in PAIRS:
            case = _case(entry, ours, other)
            if case is not None:
                cases.append(case)
                by_key[(*key, ours, other)] = case
    acceptance = [_judge(goal, n, entries.get((goal.model, n)), by_key.get((goal.model, n, goal.ours, goal.other)))
                  for goal in GOALS for n in goal.lengths]
    return cases, acceptance
