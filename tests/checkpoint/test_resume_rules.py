"""Resuming: ``latest()`` on a first run, and which checkpoint ``latest()`` picks when weights sit beside steps."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch

from sfstore import checkpoint, errors


def test_load_of_latest_on_a_first_run_is_a_typed_not_found(ckroot: Path) -> None:
    assert checkpoint.latest("run9") is None  # nothing saved: None, so a guarded resume can test for it
    with pytest.raises(errors.PathNotFoundError) as got:
        checkpoint.load(checkpoint.latest("run9"))  # type: ignore[arg-type]  # the unguarded resume
    assert isinstance(got.value, FileNotFoundError) and got.value.errno == errno.ENOENT
    text = str(got.value)
    assert "no committed checkpoint" in text and "latest() returns" in text and "is not None" in text


def test_guarded_resume_runs_on_a_first_and_a_second_run(ckroot: Path) -> None:
    model = torch.nn.Linear(4, 4)
    for _run in range(2):
        start = 0
        if (info := checkpoint.latest("run1")) is not None:
            start = checkpoint.load(info)["step"]
        checkpoint.save({"model": model.state_dict(), "step": start + 100}, f"run1/step-{start + 100}")
    last = checkpoint.latest("run1")
    assert last is not None and last.name == "step-200" and last.step == 200


def test_save_to_none_is_a_typed_error(ckroot: Path) -> None:
    with pytest.raises(errors.InvalidRequestError, match=r"must be a str or os\.PathLike"):
        checkpoint.save({"x": torch.ones(1)}, None)  # type: ignore[arg-type]


def test_latest_prefers_the_training_state_to_weights_saved_after_it(ckroot: Path) -> None:
    # README's Checkpoints example: two training states, then the bare weights under a name with no step.
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters())
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 100}
    checkpoint.save(state, "run1/step-100", metadata={"step": 100})
    checkpoint.save_async({**state, "step": 200}, "run1/step-200", metadata={"step": 200}).get()
    checkpoint.save(model.state_dict(), "run1/weights")
    assert [i.name for i in checkpoint.list("run1")] == ["step-100", "step-200", "weights"]  # commit order
    info = checkpoint.latest("run1")
    assert info is not None and info.name == "step-200" and info.step == 200
    assert checkpoint.load(info)["step"] == 200  # the training state, not the weights


def test_latest_takes_the_step_from_the_name_when_no_metadata_says_it(ckroot: Path) -> None:
    # The quick start saves without metadata: the name carries the step.
    checkpoint.save({"step": 100}, "run2/step-100")
    checkpoint.save({"x": torch.ones(2)}, "run2/best")
    info = checkpoint.latest("run2")
    assert info is not None and info.name == "step-100" and info.step == 100
    assert [i.step for i in checkpoint.list("run2")] == [100, None]


def test_latest_among_stepped_checkpoints_is_the_newest_commit(ckroot: Path) -> None:
    # A run restarted from an earlier step (or rerun over old names) resumes from what it saved last.
    for step in (300, 100, 200):
        checkpoint.save({"s": torch.tensor(step)}, f"run3/epoch=0-step={step}")
    checkpoint.save({"s": torch.tensor(0)}, "run3/final-export")
    info = checkpoint.latest("run3")
    assert info is not None and info.name == "epoch=0-step=200" and info.step == 200


def test_latest_with_no_step_anywhere_is_the_newest_commit(ckroot: Path) -> None:
    checkpoint.save({"x": torch.ones(1)}, "run4/b")
    checkpoint.save({"x": torch.ones(2)}, "run4/a")
    info = checkpoint.latest("run4")
    assert info is not None and info.name == "a" and info.step is None


@pytest.mark.parametrize(
    ("name", "step"),
    [
        ("step-200", 200), ("step_200", 200), ("step200", 200), ("STEP-7", 7), ("epoch=1-step=200", 200),
        ("epoch=1-step=200.ckpt", 200), ("global_step200", 200), ("global-step-5", 5), ("checkpoint-200", 200),
        ("ckpt_12", 12), ("iter_0000200", 200), ("run-a-step-3-final", 3), ("checkpoint-step-9", 9),
        ("weights", None), ("best", None), ("epoch=3", None), ("model-v2", None), ("last", None),
        ("mystep-4", None), ("steps-100", None), ("substep4", None),
    ],
)
def test_step_in_name(name: str, step: int | None) -> None:
    from sfstore.checkpoint.catalog import step_in_name

    assert step_in_name(name) == step


def test_saving_over_an_existing_checkpoint_says_how_to_overwrite(ckroot: Path) -> None:
    checkpoint.save({"x": torch.ones(2)}, "run5/step-1")
    for save in (checkpoint.save, lambda s, u: checkpoint.save_async(s, u).get()):
        with pytest.raises(errors.PathExistsError) as got:
            save({"x": torch.zeros(2)}, "run5/step-1")
        text = str(got.value)
        assert "'run5/step-1' exists" in text and "overwrite=True" in text and "sfstore-staging" not in text
    assert checkpoint.load("run5/step-1")["x"].tolist() == [1.0, 1.0]  # nothing was lost
    # overwrite=True replaces it, for save and save_async alike; nothing else is left in the directory.
    checkpoint.save({"x": torch.full((2,), 2.0)}, "run5/step-1", overwrite=True)
    assert checkpoint.load("run5/step-1")["x"].tolist() == [2.0, 2.0]
    checkpoint.save_async({"x": torch.full((2,), 3.0)}, "run5/step-1", overwrite=True).get()
    assert checkpoint.load("run5/step-1")["x"].tolist() == [3.0, 3.0]
    assert sorted(p.name for p in (ckroot / "run5").iterdir()) == ["step-1"]


def test_a_failed_overwrite_leaves_the_old_checkpoint_whole(ckroot: Path) -> None:
    checkpoint.save({"x": torch.ones(3)}, "run6/step-1")
    with pytest.raises(errors.InvalidRequestError):
        checkpoint.save({"x": torch.zeros(3), "bad": object()}, "run6/step-1", overwrite=True)
    assert checkpoint.load("run6/step-1")["x"].tolist() == [1.0, 1.0, 1.0]
    assert sorted(p.name for p in (ckroot / "run6").iterdir()) == ["step-1"]
