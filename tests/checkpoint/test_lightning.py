"""``sfstore.checkpoint.lightning.SfstoreCheckpointIO`` with a real ``lightning.pytorch.Trainer`` (CPU).

A tiny LightningModule (``save_hyperparameters``, Adam with a scheduler) trains 2 epochs with
``ModelCheckpoint(dirpath="sf://...", save_top_k=1)`` through the plugin, resumes from ``ckpt_path=`` with
the very weights and optimizer state it saved, and the checkpoint ``save_top_k`` drops is removed; the same
through Lightning's ``AsyncCheckpointIO`` with ``default_root_dir="sf://..."`` and with a host directory; values
that cannot be stored without pickling are refused, naming their key.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pl = pytest.importorskip("lightning.pytorch")

import fsspec  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins.io import AsyncCheckpointIO  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from sfstore import checkpoint, errors  # noqa: E402
from sfstore.checkpoint import MANIFEST_NAME  # noqa: E402
from sfstore.checkpoint.lightning import SfstoreCheckpointIO  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning",
                                        "ignore::FutureWarning")

STEPS_PER_EPOCH = 4


class Tiny(pl.LightningModule):  # type: ignore[misc]
    def __init__(self, hidden: int = 8, lr: float = 0.05, betas: tuple[float, float] = (0.9, 0.99),
                 name: str = "tiny", extra: Any = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(3, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))

    def training_step(self, batch: Any, index: int) -> Any:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=self.hparams.lr, betas=self.hparams.betas)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)}

    def train_dataloader(self) -> DataLoader[Any]:
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(4 * STEPS_PER_EPOCH, 3, generator=g), torch.randn(4 * STEPS_PER_EPOCH, 1,
                                                                                           generator=g))
        return DataLoader(data, batch_size=4)


class Snapshot(Callback):  # type: ignore[misc]
    """The module's and optimizer's state when (resumed) training starts."""

    def __init__(self) -> None:
        self.weights: dict[str, Any] = {}
        self.exp_avg: list[Any] = []
        self.global_step = -1

    def on_train_start(self, trainer: Any, module: Any) -> None:
        self.weights = {k: v.detach().clone() for k, v in module.state_dict().items()}
        state = trainer.optimizers[0].state_dict()["state"]
        self.exp_avg = [state[i]["exp_avg"].clone() for i in sorted(state)]
        self.global_step = trainer.global_step


def _trainer(epochs: int, plugin: Any, callbacks: list[Any], **kwargs: Any) -> Any:
    return pl.Trainer(max_epochs=epochs, plugins=[plugin], callbacks=callbacks, accelerator="cpu", devices=1,
                      logger=False, enable_progress_bar=False, enable_model_summary=False, **kwargs)


def _state(module: Any) -> dict[str, Any]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture
def sfroot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "root").mkdir()  # a configured root must exist
    monkeypatch.setenv("SFSTORE_ROOT", str(tmp_path / "root"))
    monkeypatch.delenv("SFSTORE_CONFIG", raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path / "root"


def test_train_checkpoint_resume_and_top_k_removal_on_sf(sfroot: Path) -> None:
    torch.manual_seed(0)
    model = Tiny()
    trainer = _trainer(2, SfstoreCheckpointIO(), [ModelCheckpoint(dirpath="sf://runs/exp", save_top_k=1)])
    trainer.fit(model)
    first, second = "epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt"
    fs = fsspec.filesystem("sf")
    assert [os.path.basename(p) for p in fs.ls("sf://runs/exp", detail=False)] == [second]  # top-1 removed
    assert (sfroot / "runs" / "exp" / second / MANIFEST_NAME).is_file()  # an sfstore checkpoint, not a pickle
    assert not any(p.suffix in (".pt", ".bin", ".pkl") for p in (sfroot / "runs" / "exp" / second).iterdir())
    infos = checkpoint.list("sf://runs/exp")
    assert [(i.name, i.step, i.metadata["epoch"]) for i in infos] == [(second, 8, 1)]
    saved = _state(model)

    ckpt = SfstoreCheckpointIO().load_checkpoint(f"sf://runs/exp/{second}")
    assert ckpt["global_step"] == 8 and ckpt["hyper_parameters"]["betas"] == (0.9, 0.99)
    assert _equal(dict(ckpt["state_dict"]), saved)
    state_key = next(k for k in ckpt["callbacks"] if k.startswith("ModelCheckpoint"))
    assert ckpt["callbacks"][state_key]["best_model_path"] == f"sf://runs/exp/{second}"

    # Resume: the module and optimizer start from what was saved; one more epoch, and save_top_k=1 drops
    # the checkpoint it resumed from (Lightning removes it on a non-local filesystem).
    snap = Snapshot()
    resumed = Tiny()
    again = _trainer(3, SfstoreCheckpointIO(), [ModelCheckpoint(dirpath="sf://runs/exp", save_top_k=1), snap])
    again.fit(resumed, ckpt_path=f"sf://runs/exp/{second}")
    assert snap.global_step == 8 and _equal(snap.weights, saved)
    want = ckpt["optimizer_states"][0]["state"]
    assert all(torch.equal(a, want[i]["exp_avg"]) for i, a in zip(sorted(want), snap.exp_avg, strict=True))
    assert again.global_step == 12 and again.lr_scheduler_configs[0].scheduler.last_epoch == 3
    assert [os.path.basename(p) for p in fs.ls("sf://runs/exp", detail=False)] == ["epoch=2-step=12.ckpt"]
    assert first not in os.listdir(sfroot / "runs" / "exp")
    assert not [n for n in os.listdir(sfroot / "runs" / "exp") if n.startswith(".")]  # no staging left


def test_lightnings_async_checkpoint_io_with_default_root_dir_on_sf(sfroot: Path) -> None:
    torch.manual_seed(1)
    model = Tiny(hidden=4)
    # save_top_k=-1: Lightning's wrapper lets ModelCheckpoint remove a checkpoint its thread has not written yet.
    keep_all = ModelCheckpoint(save_top_k=-1)  # dirpath: <default_root_dir>/checkpoints
    trainer = _trainer(2, AsyncCheckpointIO(SfstoreCheckpointIO()), [keep_all], default_root_dir="sf://runs/async")
    trainer.fit(model)  # teardown waits for the background saves
    names = sorted(os.listdir(sfroot / "runs" / "async" / "checkpoints"))
    assert names == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt"]
    snap = Snapshot()
    again = _trainer(3, AsyncCheckpointIO(SfstoreCheckpointIO()), [snap], default_root_dir="sf://runs/async")
    again.fit(Tiny(hidden=4), ckpt_path="sf://runs/async/checkpoints/epoch=1-step=8.ckpt")
    assert snap.global_step == 8 and _equal(snap.weights, _state(model))


def test_async_save_orders_saves_and_removals(sfroot: Path) -> None:
    torch.manual_seed(3)
    model = Tiny()
    io = SfstoreCheckpointIO(async_save=True)
    trainer = _trainer(3, io, [ModelCheckpoint(dirpath="sf://runs/bg", save_top_k=1)])
    trainer.fit(model)
    assert os.listdir(sfroot / "runs" / "bg") == ["epoch=2-step=12.ckpt"]  # each drop waited for its save
    snap = Snapshot()
    _trainer(4, SfstoreCheckpointIO(async_save=True), [snap]).fit(Tiny(), ckpt_path="sf://runs/bg/epoch=2-step=12.ckpt")
    assert snap.global_step == 12 and _equal(snap.weights, _state(model))
    # A background save's failure is raised by the next call (here: the load of its path).
    io.save_checkpoint({"w": torch.ones(3)}, "sf://runs/bg/a.ckpt")
    assert io.load_checkpoint("sf://runs/bg/a.ckpt")["w"].tolist() == [1.0, 1.0, 1.0]  # waited for
    (sfroot / "runs" / "bg" / "b.ckpt").mkdir()
    (sfroot / "runs" / "bg" / "b.ckpt" / "notes.txt").write_text("not a checkpoint")
    io.save_checkpoint({"w": torch.ones(3)}, "sf://runs/bg/b.ckpt")
    with pytest.raises(errors.PathExistsError, match="not an sfstore checkpoint"):
        io.teardown()
    io.teardown()  # raised once


def test_host_directory(tmp_path: Path, sfroot: Path) -> None:
    torch.manual_seed(2)
    model = Tiny()
    where = tmp_path / "local-ckpts"
    trainer = _trainer(2, SfstoreCheckpointIO(), [ModelCheckpoint(dirpath=str(where), save_top_k=1)])
    trainer.fit(model)
    assert os.listdir(where) == ["epoch=1-step=8.ckpt"] and (where / "epoch=1-step=8.ckpt" / MANIFEST_NAME).is_file()
    snap = Snapshot()
    _trainer(3, SfstoreCheckpointIO(), [snap]).fit(Tiny(), ckpt_path=str(where / "epoch=1-step=8.ckpt"))
    assert snap.global_step == 8 and _equal(snap.weights, _state(model))
    io = SfstoreCheckpointIO()
    io.save_checkpoint({"state_dict": _state(model), "global_step": 3}, "relative.ckpt")  # from the cwd
    assert (tmp_path / "relative.ckpt" / MANIFEST_NAME).is_file()
    io.save_checkpoint({"state_dict": _state(model), "global_step": 4}, "relative.ckpt")  # replaced
    assert io.load_checkpoint(str(tmp_path / "relative.ckpt"))["global_step"] == 4
    io.remove_checkpoint("relative.ckpt")
    assert not (tmp_path / "relative.ckpt").exists()
    io.remove_checkpoint("relative.ckpt")  # nothing there: no error, as TorchCheckpointIO
    torch.save({"x": 1}, tmp_path / "old.ckpt")  # a checkpoint Lightning wrote with torch.save: unlinked
    io.remove_checkpoint(tmp_path / "old.ckpt")
    assert not (tmp_path / "old.ckpt").exists()
    (tmp_path / "precious").mkdir()
    (tmp_path / "precious" / "notes.txt").write_text("keep")
    with pytest.raises(errors.InvalidRequestError, match="not an sfstore checkpoint"):
        io.remove_checkpoint(tmp_path / "precious")
    assert (tmp_path / "precious" / "notes.txt").read_text() == "keep"
    with pytest.raises(FileNotFoundError):
        io.load_checkpoint("sf://no/such.ckpt")


def test_values_that_would_need_pickle_are_refused_by_key(sfroot: Path) -> None:
    trainer = _trainer(1, SfstoreCheckpointIO(), [ModelCheckpoint(dirpath="sf://runs/bad")])
    with pytest.raises(errors.InvalidRequestError, match=r"hyper_parameters/extra.*save_hyperparameters\(ignore="):
        trainer.fit(Tiny(extra=torch.nn.ReLU()))
    assert not os.path.exists(sfroot / "runs" / "bad") or not [
        n for n in os.listdir(sfroot / "runs" / "bad") if not n.startswith(".")
    ]  # nothing written

    class Stateful(Callback):  # type: ignore[misc]
        def state_dict(self) -> dict[str, Any]:
            return {"ok": 1, "fn": len}

    io = SfstoreCheckpointIO()
    with pytest.raises(errors.InvalidRequestError, match=r"callbacks/Stateful/fn.*callback's state_dict\(\)"):
        io.save_checkpoint({"callbacks": {"Stateful": Stateful().state_dict()}}, "sf://runs/bad/x.ckpt")
    with pytest.raises(errors.InvalidRequestError, match="storage_options"):
        io.save_checkpoint({}, "sf://runs/bad/y.ckpt", storage_options={"compress": True})
    with pytest.raises(errors.InvalidRequestError, match="not 's3"):
        io.save_checkpoint({}, "s3://bucket/x.ckpt")
    with pytest.raises(errors.InvalidRequestError, match="map_location"):
        io.load_checkpoint("sf://runs/bad/x.ckpt", map_location=lambda storage, loc: storage)
    io.save_checkpoint({"step_state": 1}, "sf://runs/ok.ckpt", storage_options={"metadata": {"note": "hi"}})
    assert checkpoint.load("sf://runs/ok.ckpt") == {"step_state": 1}
    assert checkpoint.list("sf://runs")[0].metadata == {"note": "hi"}
