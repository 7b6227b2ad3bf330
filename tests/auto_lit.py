"""Shared pieces of the ``compressor="auto"`` Trainer tests (tests/test_auto*.py): the callback that
saves each rank's chooser state, the fit helper on 2 spawned CPU/gloo ranks and the pinned links."""

from __future__ import annotations

import math
from pathlib import Path

import lightning as L
import torch
from lit_models import ReportCallback, TinyClassifier, make_loader

from lightning_gc import GCStrategy

SLOW_LINK = dict(network_alpha_s=2e-3, network_beta_s_per_byte=8 / 2e6)  # 2 Mbit/s, 2 ms per message
# for the tests whose only candidates besides ddp are lossy: at 2 Mbit/s Top-k beats DDP per unit of progress
# only while the profiled compute stays under ~24 ms (a loaded CI run profiled 25.8 ms and DDP won, as the
# oracle agreed); at 0.25 Mbit/s it does up to ~240 ms
SLOWER_LINK = dict(network_alpha_s=2e-3, network_beta_s_per_byte=8 / 0.25e6)


class AutoReport(L.Callback):
    """Saves each rank's chooser state, and the rank's own local gradients of the steps ``keep_steps``
    (copied by this callback's own hooks, independently of the chooser's sampling)."""

    def __init__(self, out: Path, keep_steps: tuple[int, ...] = ()) -> None:
        self.out = out
        self.keep_steps = keep_steps
        self.grads: dict[int, dict[str, torch.Tensor]] = {}

    def on_fit_start(self, trainer, pl_module):
        def keep(name):
            def hook(p):
                if trainer.global_step in self.keep_steps:  # the step whose backward this is (0-based)
                    self.grads.setdefault(trainer.global_step, {})[name] = p.grad.detach().clone()
            return hook
        for name, p in pl_module.named_parameters():
            p.register_post_accumulate_grad_hook(keep(name))

    def on_train_end(self, trainer, pl_module):
        a, e = trainer.strategy.auto, trainer.strategy.engine
        torch.save({"history": a.history, "chosen": a.chosen, "dense_mode": e.dense_mode, "slots": e.slot_specs(),
                    "compressed_steps": e.totals()["compressed_steps"], "gain_checks": a.gain_checks,
                    "grads": self.grads, "walls": list(a.measured)},
                   self.out / f"auto{trainer.global_rank}.pt")


def errors_by_hand(grads: dict[str, torch.Tensor], min_numel: int = 16) -> dict[str, float]:
    """One rank's relative error of what ddp, fp16, Top-k 1 % and EF-signSGD send for its gradient
    (the tensors of at least ``min_numel`` elements, flattened; each of these errors is independent
    of the order): written from the methods' definitions, not from lightning_gc."""
    x = torch.cat([g.reshape(-1).double() for g in grads.values() if g.numel() >= min_numel])
    x2 = float(x.pow(2).sum())
    k = math.ceil(0.01 * x.numel())
    sign = torch.where(x >= 0, 1.0, -1.0).double()
    return {"ddp": 0.0,
            "fp16": float((x.half().double() - x).pow(2).sum()) / x2,
            "topk": 1.0 - float(x.pow(2).sort(descending=True).values[:k].sum()) / x2,
            "efsign": float((x.abs().mean() * sign - x).pow(2).sum()) / x2}


def _fit(tmp: Path, strategy: GCStrategy, ckpt_path=None, callbacks=(), keep_steps=(), model=None, val=None, **kw):
    out = tmp / "report"
    out.mkdir(parents=True, exist_ok=True)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(tmp),
                        callbacks=[ReportCallback(str(out)), AutoReport(out, keep_steps), *callbacks],
                        **{"max_epochs": 2, "enable_checkpointing": False, **kw})
    trainer.fit(model or TinyClassifier(), make_loader(), val, ckpt_path=ckpt_path)
    return ([torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)],
            [torch.load(out / f"auto{r}.pt", weights_only=False) for r in range(2)])


def _strategy(link=SLOW_LINK, **auto):
    # one decision only: no window completes (calibration, drift) and no periodic re-probe; those decide
    # from measured step times, which differ between two runs (tests/test_auto_model.py covers them)
    # early_comm_ratio 0: the warm-up profiles step 1 whatever step 0's exposed communication was
    return GCStrategy(compressor="auto", start_method="forkserver", min_compress_numel=16,
                      auto={"window": 1000, "probe_every": 0, "early_comm_ratio": 0.0, **auto}, **link)


