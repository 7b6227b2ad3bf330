"""Tiny LightningModules and data for tests (module level so spawned ranks can import them)."""

from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset


class TinyClassifier(L.LightningModule):
    """Two-layer MLP; `hidden` large enough that its weights are compressed (≥ 1024 elements)."""

    def __init__(self, num_features: int = 16, hidden: int = 96, num_classes: int = 4, lr: float = 0.1,
                 momentum: float = 0.9, nan_at_step: int = -1, nan_rank: int = 1) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(1234)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(num_features, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, num_classes)
        )
        self.local_grads: list[dict[str, torch.Tensor]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self(x), y)
        if self.hparams.nan_at_step == self.global_step and self.global_rank == self.hparams.nan_rank:
            loss = loss * float("nan")
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=self.hparams.momentum)


def make_loader(n: int = 256, num_features: int = 16, num_classes: int = 4, batch_size: int = 16, seed: int = 0,
                shuffle: bool = True) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, num_features, generator=g)
    w = torch.randn(num_features, num_classes, generator=g)
    y = (x @ w).argmax(dim=1)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=shuffle)


class ReportCallback(L.Callback):
    """Writes each rank's engine/strategy facts and final parameters to ``<out>/rank<r>.pt``."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.steps_seen: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        flat = torch.cat([p.detach().reshape(-1) for p in pl_module.parameters()])
        self.steps_seen.append(int(torch.isfinite(flat).all()))

    def on_train_end(self, trainer, pl_module):
        import os

        strategy = trainer.strategy
        engine = getattr(strategy, "engine", None)
        ddp = strategy.model
        info = {
            "rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "global_step": trainer.global_step,
            "engine_step": engine.step if engine else None,
            "hook_calls": engine.hook_calls if engine else None,
            "totals": engine.totals() if engine else None,
            "comm_hook": ddp._get_ddp_logging_data().get("comm_hook") if hasattr(ddp, "_get_ddp_logging_data") else None,
            "skipped": getattr(strategy, "skipped_steps", None),
            "summary": strategy.summary().as_dict() if hasattr(strategy, "summary") and engine else None,
            "params": {k: v.detach().clone() for k, v in pl_module.state_dict().items()},
            "memory": engine.state_dict()["memory"] if engine else None,
            "finite_after_each_step": self.steps_seen,
        }
        torch.save(info, os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"))
