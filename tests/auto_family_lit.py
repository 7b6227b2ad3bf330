"""Shared pieces of the per-step ⇄ DiLoCo tests under ``compressor="auto"`` (tests/test_auto_diloco*.py):
a report callback that records, after every optimizer step, which family ran and a digest of the
parameters and optimizer state; and a 2-rank CPU/gloo fit. Module level so spawned ranks import them."""

from __future__ import annotations

import os

import lightning as L
import torch
from lit_models import TinyClassifier, make_loader

from lightning_gc import GCStrategy

SLOW_LINK = dict(network_alpha_s=2e-3, network_beta_s_per_byte=8 / 2e6)  # pinned: the first decision is fixed


def _moments(opt) -> list[torch.Tensor]:
    return [s[k].detach().reshape(-1).clone() for s in opt.state.values() for k in sorted(s) if torch.is_tensor(s[k])]


class FamilyReport(L.Callback):
    """Per optimizer step: whether DiLoCo ran it, the rank's parameters, and its optimizer moments after
    the step and right after ``optimizer.step()`` (before any switch's averaging)."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.steps: list[dict] = []
        self._pre: list[torch.Tensor] = []

    def on_train_start(self, trainer, pl_module):
        # right after optimizer.step(), before the session's post-step work (DiLoCo's, auto's switches)
        trainer.optimizers[0].register_step_post_hook(lambda opt, *_: setattr(self, "_pre", _moments(opt)))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        d = trainer.strategy.diloco
        self.steps.append({"diloco": bool(d is not None and d.active),
                           "params": torch.cat([p.detach().reshape(-1) for p in pl_module.parameters()]).clone(),
                           "moments": _moments(trainer.optimizers[0]), "pre_moments": self._pre})

    def on_fit_end(self, trainer, pl_module):
        s = trainer.strategy
        torch.save({"steps": self.steps, "sync": s.auto.state.sync, "hook_calls": s.engine.hook_calls,
                    "engine_step": s.engine.step, "global_step": trainer.global_step,
                    "params": {k: v.detach().clone() for k, v in pl_module.state_dict().items()},
                    "optimizer": trainer.optimizers[0].state_dict()},
                   os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"))


def strategy(**auto) -> GCStrategy:
    """ddp as the only per-step candidate on a pinned link, no window, probe or re-measurement (so no
    per-step re-decision), the trial at once (gate 0), per-step first (lead 0; ``diloco_lead`` in ``auto``
    overrides it) and one DiLoCo round per window."""
    opts = {"candidates": ["ddp"], "diloco": ["diloco10"], "diloco_gate": 0, "diloco_lead": 0, "diloco_rounds": 1,
            "window": 1000, "probe_every": 0, "gain_every": 0, "early_comm_ratio": 0.0, **auto}
    return GCStrategy(compressor="auto", start_method="forkserver", min_compress_numel=16, auto=opts, **SLOW_LINK)


def fit(tmp, strat, ckpt_path=None, callbacks=(), model=None, **trainer_kw) -> list[dict]:
    out = tmp / "report"
    out.mkdir(parents=True, exist_ok=True)
    trainer = L.Trainer(strategy=strat, accelerator="cpu", devices=2, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(tmp), num_sanity_val_steps=0,
                        callbacks=[FamilyReport(str(out)), *callbacks],
                        **{"max_epochs": 3, "enable_checkpointing": False, **trainer_kw})
    trainer.fit(model or TinyClassifier(momentum=0.9), make_loader(n=512), ckpt_path=ckpt_path)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]
