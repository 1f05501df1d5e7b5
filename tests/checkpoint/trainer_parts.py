"""What the Hugging Face Trainer tests train: a tiny random Llama built from a config (no downloads), fixed token
sequences, and a step counter. Import after ``pytest.importorskip("transformers")``; the two-rank test's
torchrun child imports it too."""

from __future__ import annotations

from typing import Any

import torch
import transformers


def tiny_llama() -> Any:
    """A 2-layer Llama of hidden size 32, the same random weights every time (seed 0)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                      num_attention_heads=2, num_key_value_heads=1, vocab_size=128,
                                      tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(config)


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """16 fixed sequences of 12 tokens (drawn with ``seed``), each its own label (a causal LM learns to continue
    them)."""

    def __init__(self, seed: int = 1) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 128, (16, 12), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class StepCounter(transformers.TrainerCallback):
    """Counts the optimizer steps a ``train()`` call takes (a resumed one takes only the missing ones)."""

    def __init__(self) -> None:
        self.taken = 0

    def on_step_end(self, *args: Any, **kwargs: Any) -> None:
        self.taken += 1


def steps_taken(trainer: Any) -> int:
    """The steps the trainer's :class:`StepCounter` counted."""
    (steps,) = [c for c in trainer.callback_handler.callbacks if isinstance(c, StepCounter)]
    return steps.taken


def bits_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Assert two state dicts hold the same names, dtypes, shapes and bytes."""
    assert set(got) == set(want)
    for name, t in want.items():
        g = got[name].detach()
        assert g.dtype == t.dtype and g.shape == t.shape, name
        assert torch.equal(g.reshape(-1).view(torch.uint8), t.detach().reshape(-1).view(torch.uint8)), name
