"""Study workload (not a preset, not part of the package): a transformer-encoder classifier with
AdamW and warm-up, held out from the presets ``auto`` is developed on. It is the workload of the
per-step-best clause of docs/auto-diloco.md: with DiLoCo among ``auto``'s candidates, a job whose
best method is per-step must not lose time to the trial.

Run it through the bench's ``module:factory`` presets, from the repository root::

    PYTHONPATH=docs/studies lightning-gc bench --preset heldout_encoder:workload --ranks 4 --hosts 4 \\
      --bandwidth 20mbit --budget 150 --eval-every 25 --methods "auto,auto:diloco=diloco10+diloco50"

Task. Sequences of ``seq_len`` tokens drawn uniformly from ``vocab`` symbols. A fixed, seeded
teacher scores class ``c`` as the sum over adjacent pairs of ``T[x_i, x_{i+1}, c]`` (``T`` drawn
from N(0, 1)), centred so that the classes are balanced. Samples whose top-1 minus top-2 score is
among the smallest ``margin_quantile`` are rejected (as the ``mlp`` preset's teacher does), so the
label is learnable. Bigram counts cannot be read from a bag of tokens: the student must learn to
attend to a token's neighbour, which is what the encoder's attention and positions are for.

Student. ``nn.TransformerEncoder`` (pre-norm layers, GELU, no dropout) over token plus learned
position embeddings, mean-pooled, a LayerNorm and a linear head. AdamW with decoupled weight decay
on matrices only, linear warm-up over ``warmup_steps`` then a constant learning rate, clipping 1.0.
"""

from __future__ import annotations

from types import SimpleNamespace

import lightning as L
import torch
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

from lightning_gc.examples.classification import ClassifierModule, GeneratedTensorData, stream_generator
from lightning_gc.examples.transformer import adamw_param_groups

__all__ = ["BigramTeacherData", "EncoderClassifier", "workload"]


class BigramTeacherData(GeneratedTensorData):
    """Token sequences labelled by a random bigram-scoring teacher (see the module docstring)."""

    min_val_batch_size = 256

    def __init__(self, vocab: int = 8, seq_len: int = 16, num_classes: int = 4, num_train: int = 32768,
                 num_val: int = 2048, margin_quantile: float = 0.5, batch_size: int = 32,
                 num_workers: int = 0, seed: int = 0) -> None:
        super().__init__()
        if vocab < 2 or seq_len < 2 or num_classes < 2:
            raise ValueError(f"vocab={vocab}, seq_len={seq_len}, num_classes={num_classes} must each be >= 2")
        if not 0.0 <= margin_quantile < 1.0:
            raise ValueError(f"margin_quantile={margin_quantile!r} must be in [0, 1)")
        self.save_hyperparameters()
        self._teacher: tuple[torch.Tensor, torch.Tensor, float] | None = None

    def _scores(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return table[x[:, :-1], x[:, 1:]].sum(dim=1)

    def _teacher_params(self) -> tuple[torch.Tensor, torch.Tensor, float]:
        if self._teacher is None:
            hp = self.hparams
            g = stream_generator(hp.seed, "teacher")
            # float64: the keep/reject decision at the margin must not flip between machines
            table = torch.randn(hp.vocab, hp.vocab, hp.num_classes, generator=g, dtype=torch.float64)
            calib = torch.randint(0, hp.vocab, (32768, hp.seq_len), generator=g)
            raw = self._scores(calib, table)
            centre = raw.mean(dim=0)
            top2 = (raw - centre).topk(2, dim=1).values
            threshold = float(torch.quantile(top2[:, 0] - top2[:, 1], hp.margin_quantile)) \
                if hp.margin_quantile > 0 else 0.0
            self._teacher = (table, centre, threshold)
        return self._teacher

    def generate(self, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        if split not in ("train", "val"):
            raise ValueError(f"split={split!r}: use 'train' or 'val'")
        hp = self.hparams
        n = hp.num_train if split == "train" else hp.num_val
        table, centre, threshold = self._teacher_params()
        g = stream_generator(hp.seed, split)
        xs, ys, have = [], [], 0
        while have < n:
            x = torch.randint(0, hp.vocab, (4096, hp.seq_len), generator=g)
            logits = self._scores(x, table) - centre
            top2 = logits.topk(2, dim=1).values
            keep = (top2[:, 0] - top2[:, 1]) >= threshold
            xs.append(x[keep])
            ys.append(logits.argmax(dim=1)[keep])
            have += int(keep.sum())
        return torch.cat(xs)[:n].contiguous(), torch.cat(ys)[:n].contiguous()


class EncoderClassifier(ClassifierModule):
    """``nn.TransformerEncoder`` classifier trained with AdamW and a linear warm-up (the loss, its
    logging and validation are the example classifiers')."""

    def __init__(self, vocab: int = 8, seq_len: int = 16, num_classes: int = 4, d_model: int = 128,
                 n_heads: int = 4, n_layers: int = 2, ff_mult: int = 4, lr: float = 2e-3,
                 weight_decay: float = 0.01, warmup_steps: int = 50, grad_clip: float = 1.0) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} must be a multiple of n_heads={n_heads}")
        if warmup_steps < 0 or lr <= 0:
            raise ValueError(f"warmup_steps={warmup_steps} must be >= 0 and lr={lr} > 0")
        self.save_hyperparameters()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.randn(seq_len, d_model))
        layer = nn.TransformerEncoderLayer(d_model, n_heads, ff_mult * d_model, dropout=0.0,
                                           activation="gelu", batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, num_classes)
        self.val_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.encoder(self.tok(x) + self.pos[: x.shape[1]])
        return self.head(self.norm(h.mean(dim=1)))

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        torch.nn.utils.clip_grad_norm_(self.parameters(), self.hparams.grad_clip)

    def configure_optimizers(self):
        hp = self.hparams
        optimizer = torch.optim.AdamW(adamw_param_groups(self, hp.weight_decay), lr=hp.lr, betas=(0.9, 0.98))
        warmup = max(1, int(hp.warmup_steps))
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def workload(seed: int = 0, target: float = 0.8, batch_size: int = 32, **model_args):
    """The bench's ``module:factory`` contract: model, data, metric, mode, target, batch size."""
    L.seed_everything(seed, workers=False, verbose=False)
    data_keys = ("vocab", "seq_len", "num_classes")
    data_args = {k: model_args[k] for k in data_keys if k in model_args}
    return SimpleNamespace(model=EncoderClassifier(**model_args),
                           datamodule=BigramTeacherData(batch_size=batch_size, seed=seed, **data_args),
                           metric="val_acc", mode="max", target=float(target), batch_size=int(batch_size))
