"""The recipe for tools that write plain files, against the real ``transformers`` ``Trainer`` and ``accelerate``:
``output_dir=local_path("sf://runs/x")`` puts the Trainer's checkpoints where ``sf://runs/x`` says, sfstore's
``checkpoint.load`` reads their model directories, and training resumes from them;
``Accelerator.save_state(local_path(...))`` then ``load_state`` restores the weights bit for bit."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch

from sfstore import checkpoint
from sfstore.fs import local_path

transformers = pytest.importorskip("transformers")

from tests.checkpoint.trainer_parts import (  # noqa: E402  (needs transformers)
    StepCounter,
    Tokens,
    bits_equal,
    steps_taken,
    tiny_llama,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

STEPS, SAVE_EVERY = 4, 2


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The ``sf://`` root (``SFSTORE_ROOT``), everything offline, and the working directory a scratch one
    (the Trainer writes nothing beside its output directory)."""
    monkeypatch.setenv("SFSTORE_ROOT", str(tmp_path / "root"))
    monkeypatch.delenv("SFSTORE_CONFIG", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.setenv("WANDB_DISABLED", "true")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "root").mkdir()
    yield Path(os.path.realpath(tmp_path / "root"))


def _trainer(output_dir: str, max_steps: int, model: Any | None = None) -> Any:
    # A constant rate: a decaying one follows max_steps, so 4 steps of a 4-step run would not be the first 4
    # of a 6-step one, and resuming could not be compared with one run.
    args = transformers.TrainingArguments(
        output_dir=output_dir, max_steps=max_steps, save_strategy="steps", save_steps=SAVE_EVERY,
        per_device_train_batch_size=4, learning_rate=1e-2, lr_scheduler_type="constant", report_to=[], use_cpu=True,
        seed=0, data_seed=0,
        logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
    )
    return transformers.Trainer(model=model if model is not None else tiny_llama(), args=args, train_dataset=Tokens(),
                                callbacks=[StepCounter()])


def test_trainer_checkpoints_under_local_path_are_sfstore_checkpoints(root: Path) -> None:
    """``Trainer(output_dir=local_path("sf://runs/x"))``: each checkpoint is at ``sf://runs/x/checkpoint-N``
    (seen through the ``sf://`` filesystem), its model directory loads through ``sfstore.checkpoint.load`` (by
    ``sf://`` url, and into a fresh model) as the weights the Trainer had at that step."""
    trainer = _trainer(local_path("sf://runs/x"), STEPS)
    trainer.train()
    fs = fsspec.filesystem("sf")
    names = sorted(os.path.basename(p) for p in fs.ls("sf://runs/x", detail=False))
    assert names == [f"checkpoint-{s}" for s in range(SAVE_EVERY, STEPS + 1, SAVE_EVERY)]
    last = f"sf://runs/x/checkpoint-{STEPS}"
    for name in ("model.safetensors", "config.json", "trainer_state.json", "optimizer.pt"):
        assert fs.exists(f"{last}/{name}"), name
    want = trainer.model.state_dict()
    bits_equal(checkpoint.load(last), want)
    fresh = tiny_llama()
    checkpoint.load(last, into=fresh)
    bits_equal(fresh.state_dict(), want)
    # The earlier checkpoint holds other weights (training moved them): load reads each one as it is.
    first = checkpoint.load(f"sf://runs/x/checkpoint-{SAVE_EVERY}")
    assert any(not torch.equal(first[k], want[k]) for k in want)


def test_trainer_resumes_from_its_checkpoint_under_local_path(root: Path) -> None:
    """``trainer.train(resume_from_checkpoint=True)`` finds the last checkpoint under ``local_path(...)`` and
    goes on from it: two more steps from ``checkpoint-4`` end exactly where six steps in one run end."""
    out = local_path("sf://runs/resume")
    _trainer(out, STEPS).train()
    resumed = _trainer(out, STEPS + SAVE_EVERY)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == STEPS + SAVE_EVERY and steps_taken(resumed) == SAVE_EVERY
    straight = _trainer(local_path("sf://runs/straight"), STEPS + SAVE_EVERY)
    straight.train()
    bits_equal(resumed.model.state_dict(), straight.model.state_dict())
    # ... and the new checkpoint it wrote is one load reads.
    bits_equal(checkpoint.load(f"sf://runs/resume/checkpoint-{STEPS + SAVE_EVERY}"), straight.model.state_dict())
    # An explicit checkpoint directory by its local path works the same.
    again = _trainer(out, STEPS + SAVE_EVERY)
    again.train(resume_from_checkpoint=local_path(f"sf://runs/resume/checkpoint-{STEPS}"))
    assert steps_taken(again) == SAVE_EVERY
    bits_equal(again.model.state_dict(), straight.model.state_dict())


def test_accelerate_save_state_under_local_path_restores_bit_exact(root: Path) -> None:
    """``Accelerator.save_state(local_path("sf://acc/state"))``, weights changed by more training, then
    ``load_state``: the weights (and the optimizer's step) are back bit for bit; the state's
    ``model.safetensors`` is at ``sf://acc/state`` and ``checkpoint.load`` reads it as the saved weights."""
    accelerate = pytest.importorskip("accelerate")
    acc = accelerate.Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    x, y = torch.randn(64, 16), torch.randn(64, 4)

    def step() -> None:
        opt.zero_grad()
        acc.backward(torch.nn.functional.mse_loss(model(x), y))
        opt.step()

    for _ in range(3):
        step()
    where = local_path("sf://acc/state")
    acc.save_state(where)
    saved = {k: v.detach().clone() for k, v in acc.unwrap_model(model).state_dict().items()}
    saved_opt = {k: v.clone() for k, v in opt.state_dict()["state"][0].items()}
    for _ in range(3):
        step()
    assert any(not torch.equal(v, saved[k]) for k, v in acc.unwrap_model(model).state_dict().items())
    acc.load_state(where)
    bits_equal(acc.unwrap_model(model).state_dict(), saved)
    now_opt = opt.state_dict()["state"][0]
    assert all(torch.equal(now_opt[k], v) for k, v in saved_opt.items())
    fs = fsspec.filesystem("sf")
    assert fs.exists("sf://acc/state/model.safetensors") and fs.exists("sf://acc/state/optimizer.bin")
    bits_equal(checkpoint.load("sf://acc/state/model.safetensors"), saved)
    # Training goes on from the restored state as it did from the saved one.
    step()
