"""Shared pieces of the DiLoCo-in-Lightning tests (tests/test_diloco_lightning*.py): a report
callback that adds DiLoCo's counters and what each rank evaluated on, and a 2-rank CPU fit. Module
level so that spawned ranks can import them."""

from __future__ import annotations

import os

import lightning as L
import torch
from lit_models import ReportCallback, TinyClassifier, make_loader


class DiLoCoReport(ReportCallback):
    """Adds DiLoCo's counters and the parameters each rank evaluated on."""

    def __init__(self, out_dir: str) -> None:
        super().__init__(out_dir)
        self.evaluated: list[torch.Tensor] = []

    def on_validation_start(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.evaluated.append(torch.cat([p.detach().reshape(-1).clone() for p in pl_module.parameters()]))

    def on_train_end(self, trainer, pl_module):
        super().on_train_end(trainer, pl_module)
        self._diloco = getattr(trainer.strategy, "diloco", None)

    def on_fit_end(self, trainer, pl_module):
        # after the strategy's teardown, which closes an unfinished DiLoCo round
        path = os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt")
        if not os.path.exists(path):  # nothing was trained (resumed at the last step)
            super().on_train_end(trainer, pl_module)
        info = torch.load(path, weights_only=False)
        d = getattr(self, "_diloco", None)
        info.update(evaluated=self.evaluated, outer_steps=d.outer_steps if d else None,
                    inner_step=d.inner_step if d else None,
                    totals=trainer.strategy.engine.totals() if getattr(trainer.strategy, "engine", None) else None,
                    params={k: v.detach().clone() for k, v in pl_module.state_dict().items()})
        torch.save(info, path)


class ValLoaderClassifier(TinyClassifier):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.cross_entropy(self(x), y), sync_dist=True)


def fit(tmp, strategy, model=None, ckpt_path=None, callbacks=(), val=False, **trainer_kw):
    out = tmp / "report"
    out.mkdir(parents=True, exist_ok=True)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(tmp), num_sanity_val_steps=0,
                        callbacks=[DiLoCoReport(str(out)), *callbacks], **{"max_epochs": 2, **trainer_kw})
    model = model or TinyClassifier(momentum=0.0)
    loaders = dict(val_dataloaders=make_loader(n=64, seed=3, shuffle=False)) if val else {}
    trainer.fit(model, make_loader(n=128), ckpt_path=ckpt_path, **loaders)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]
