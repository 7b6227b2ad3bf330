"""DiLoCo's model at the end of training: every ``on_train_end`` hook sees θ_outer after the closing
outer step, identical on every rank (2 spawned CPU/gloo ranks, rank-dependent data through DDP's
sampler). ``max_steps=20`` with H = 8 ends the run 4 inner steps into a round.

Oracles: the two ranks' parameters compared with each other, and the parameters after ``fit``
returns (the closing step applied exactly once: a second outer step on a zero Δ still moves θ by
the outer Nesterov momentum, so a repeat would show); the outer-step count is 20 // 8 + 1.
"""

from __future__ import annotations

import os

import lightning as L
import pytest
import torch
from lit_models import TinyClassifier, make_loader

from lightning_gc import GCStrategy
from lightning_gc.callbacks.diloco_view import DiLoCoView

pytestmark = pytest.mark.slow

H, MAX_STEPS = 8, 20


def _flat(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in module.parameters()])


class _SeesTrainEnd(L.Callback):
    """A user's callback: what the model is in its on_train_end, and after fit returned."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.seen: dict = {}

    def on_train_end(self, trainer, pl_module):
        diloco = trainer.strategy.diloco
        self.seen.update(callback=_flat(pl_module), outer_at_callback=diloco.outer_steps)

    def on_fit_end(self, trainer, pl_module):  # after the strategy's teardown
        self.seen.update(module=getattr(pl_module, "seen_at_train_end", None), after_fit=_flat(pl_module),
                         outer_after_fit=trainer.strategy.diloco.outer_steps)
        torch.save(self.seen, os.path.join(self.out, f"rank{trainer.global_rank}.pt"))


class _ModuleSeesTrainEnd(TinyClassifier):
    def on_train_end(self):
        self.seen_at_train_end = _flat(self)


def _fit(tmp, callbacks, ckpt_path=None, **trainer_kw) -> list[dict]:
    trainer = L.Trainer(strategy=GCStrategy(compressor="dense", sync="diloco", diloco_inner_steps=H,
                                            start_method="forkserver"),
                        accelerator="cpu", devices=2, max_steps=MAX_STEPS, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(tmp), callbacks=callbacks,
                        **{"enable_checkpointing": False, **trainer_kw})
    trainer.fit(_ModuleSeesTrainEnd(momentum=0.0), make_loader(n=128), ckpt_path=ckpt_path)
    return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(2)]


def test_on_train_end_sees_theta_outer_after_the_closing_step_even_from_a_callback_listed_first(tmp_path):
    # the user's callback listed BEFORE lightning_gc's own (DiLoCoView, which the strategy keeps first)
    res = _fit(tmp_path, [_SeesTrainEnd(str(tmp_path)), DiLoCoView()])
    for r in res:
        assert r["outer_at_callback"] == r["outer_after_fit"] == MAX_STEPS // H + 1  # the closing step, once
        assert torch.equal(r["callback"], r["after_fit"]) and torch.equal(r["module"], r["after_fit"])
    assert torch.equal(res[0]["callback"], res[1]["callback"])
    assert torch.equal(res[0]["module"], res[1]["module"])


def test_a_run_resumed_at_its_last_step_still_ends_on_theta_outer(tmp_path):
    """The checkpoint of the last epoch's end is written before on_train_end, inside the open round
    (each rank's θ_local in it). Resumed with nothing left to train, the strategy's teardown closes
    the round: the ranks end identical and on the first run's final model."""
    ckpt_cb = L.pytorch.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_top_k=-1, every_n_epochs=1)
    (tmp_path / "a").mkdir()
    first = _fit(tmp_path / "a", [_SeesTrainEnd(str(tmp_path / "a")), ckpt_cb], enable_checkpointing=True)
    last = sorted((tmp_path / "ckpt").glob(f"*step={MAX_STEPS}*.ckpt"))[0]
    assert torch.load(last, weights_only=False)["lightning_gc"]["ranks"][0]["diloco"]["theta_local"] is not None
    (tmp_path / "b").mkdir()
    resumed = _fit(tmp_path / "b", [_SeesTrainEnd(str(tmp_path / "b"))], ckpt_path=str(last))
    for r in range(2):
        assert resumed[r]["outer_after_fit"] == MAX_STEPS // H + 1
        assert torch.equal(resumed[r]["after_fit"], first[r]["after_fit"])
    assert torch.equal(resumed[0]["after_fit"], resumed[1]["after_fit"])
