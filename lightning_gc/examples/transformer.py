"""A small decoder-only transformer on byte-level text (``gpt`` preset), trained the way most people
train transformers: AdamW with decoupled weight decay, linear warm-up then cosine decay, gradient
clipping at 1.0, in ``32-true`` or ``bf16-mixed``.

The data is :class:`~lightning_gc.examples.language.StdlibTextData`, the same byte windows of the
Python standard library's sources as the LSTM ``lm`` preset (nothing is downloaded; the same
``val_bpb`` metric), so the two language workloads differ only in model and optimizer.

Architecture (GPT-2 style, pre-norm): byte embedding (256 symbols) + learned position embedding ->
``n_layers`` blocks of ``x + attn(LN(x))``, ``x + MLP(LN(x))`` with causal multi-head attention
(``F.scaled_dot_product_attention(is_causal=True)``) and a GELU MLP of ``mlp_ratio * d_model``
units -> final LayerNorm -> a 256-way output layer whose weight is the byte embedding (tied).
Weights start at N(0, 0.02), the two residual output projections of every block at
N(0, 0.02 / sqrt(2 n_layers)), biases at 0, LayerNorm at (1, 0). No dropout by default: the runs
are short and far from over-fitting, and without it a run is a deterministic function of its seed.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from .classification import _check_positive
from .language import ByteLanguageModel

__all__ = ["ByteGPT", "warmup_cosine", "adamw_param_groups"]


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """The learning-rate factor of the ``n = step + 1``-th optimizer step (``LambdaLR``'s ``step``
    counts the steps already taken).

    ``n <= warmup_steps``: ``n / warmup_steps`` (linear, reaching the peak at the last warm-up step);
    after that, cosine from 1 down to ``min_lr_ratio``, reached exactly at ``n = total_steps``:
    ``r + (1 - r) * (1 + cos(pi * p)) / 2`` with ``p = (n - warmup_steps) / (total_steps - warmup_steps)``
    (held at ``r`` from ``total_steps`` on; a run with ``total_steps <= warmup_steps`` ends inside the
    warm-up).
    """
    n = step + 1
    if n <= warmup_steps:
        return n / warmup_steps
    p = 1.0 if n >= total_steps else (n - warmup_steps) / (total_steps - warmup_steps)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * p))


def adamw_param_groups(module: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW parameter groups: weight decay on the matrices (every parameter with ``ndim >= 2``:
    linear weights and the tied byte / position embeddings), none on vectors (biases, LayerNorm
    gains and shifts), the GPT-2 / nanoGPT convention: decaying a LayerNorm gain towards 0 or a bias
    towards 0 only fights the normalisation and adds no regularisation. Each tensor appears once
    (a tied weight is one parameter). Empty groups are dropped."""
    decay, no_decay = [], []
    for p in module.parameters():  # deduplicates tied parameters
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


class _CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.dropout = dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class _Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, mlp_ratio: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = _CausalSelfAttention(d_model, n_heads, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, mlp_ratio * d_model)
        self.proj = nn.Linear(mlp_ratio * d_model, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.proj(F.gelu(self.fc(self.ln2(x)))))


class ByteGPT(ByteLanguageModel):
    """Decoder-only byte-level transformer (see the module docstring for the architecture).

    Optimizer: ``torch.optim.AdamW(lr, betas=(beta1, beta2), eps=1e-8)`` with decoupled weight
    decay ``weight_decay`` on the matrices only (:func:`adamw_param_groups`). Schedule: a
    ``LambdaLR`` of :func:`warmup_cosine`, stepped by Lightning after every optimizer step
    (``interval: "step"``); the cosine ends at ``total_steps``, by default the Trainer's
    ``estimated_stepping_batches`` (``max_steps``, or ``max_epochs`` x batches per epoch).

    ``grad_clip`` (global L2 norm, 0 disables) is applied in ``configure_gradient_clipping`` so the
    clipping belongs to the workload: the benchmark builds its own Trainer without
    ``gradient_clip_val``, and every method it compares must train the same recipe. A Trainer
    ``gradient_clip_val`` takes precedence. Lightning clips after the gradients were synchronised
    (and, in ``bf16-mixed``, on the fp32 gradients), so every rank computes the same norm
    (under ``sync="osp"`` the deferred layers' gradients are still local: OSP computes the factor
    from replicated values, docs/osp.md).

    ``seq_len`` is the context length (positions); a DataModule's windows may be shorter, not
    longer. Logs ``train_loss`` (nats/byte) every step, ``val_loss`` and ``val_bpb`` (bits per byte
    = nats / ln 2) every validation epoch, like :class:`~lightning_gc.examples.ByteLM`.
    """

    def __init__(
        self,
        d_model: int = 128,
        n_layers: int = 2,
        n_heads: int = 4,
        mlp_ratio: int = 4,
        seq_len: int = 64,
        dropout: float = 0.0,
        lr: float = 3e-3,
        beta1: float = 0.9,
        beta2: float = 0.95,
        weight_decay: float = 0.1,
        warmup_steps: int = 50,
        total_steps: int | None = None,
        min_lr_ratio: float = 0.1,
        grad_clip: float = 1.0,
    ) -> None:
        super().__init__()
        for name in ("d_model", "n_layers", "n_heads", "mlp_ratio", "seq_len"):
            _check_positive(name, locals()[name])
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} must be a multiple of n_heads={n_heads} (equal head widths).")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout={dropout!r} must be in [0, 1).")
        if not lr > 0:
            raise ValueError(f"lr={lr!r} must be > 0: a non-positive learning rate never updates the model.")
        for name, beta in (("beta1", beta1), ("beta2", beta2)):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"{name}={beta!r} must be in [0, 1) (AdamW's moment decay rates).")
        if weight_decay < 0:
            raise ValueError(f"weight_decay={weight_decay!r} must be >= 0; use 0 to disable it.")
        if int(warmup_steps) != warmup_steps or warmup_steps < 0:
            raise ValueError(f"warmup_steps={warmup_steps!r} must be an integer >= 0.")
        if total_steps is not None:
            _check_positive("total_steps", total_steps)
            if total_steps <= warmup_steps:
                raise ValueError(
                    f"total_steps={total_steps} must exceed warmup_steps={warmup_steps}: the cosine decay starts "
                    "after the warm-up. Lower warmup_steps (e.g. a tenth of the run) or train longer."
                )
        if not 0.0 <= min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio={min_lr_ratio!r} must be in [0, 1] (the final lr as a fraction of lr).")
        if grad_clip < 0:
            raise ValueError(f"grad_clip={grad_clip!r} must be >= 0 (0 disables clipping).")
        self.save_hyperparameters()
        self.tok_emb = nn.Embedding(self.vocab_size, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(_Block(d_model, n_heads, mlp_ratio, dropout) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, self.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # tied: one 256 x d_model parameter
        self.apply(self._init_weights)
        for block in self.blocks:
            for proj in (block.attn.proj, block.proj):
                nn.init.normal_(proj.weight, mean=0.0, std=0.02 / math.sqrt(2 * n_layers))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``(batch, t, 256)`` for int64 byte inputs ``(batch, t)``, ``t <= seq_len``."""
        t = x.shape[1]
        if t > self.hparams.seq_len:
            raise ValueError(
                f"input length {t} exceeds the model's context seq_len={self.hparams.seq_len}; "
                "give the model and the DataModule the same seq_len."
            )
        h = self.tok_emb(x) + self.pos_emb(torch.arange(t, device=x.device))
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln_f(h))

    def schedule_steps(self) -> int:
        """The step at which the cosine reaches ``min_lr_ratio``: ``total_steps``, or the Trainer's
        ``estimated_stepping_batches`` when it is None."""
        total = self.hparams.total_steps
        if total is None:
            try:
                estimated = self.trainer.estimated_stepping_batches
            except RuntimeError as exc:  # not attached to a Trainer
                raise ValueError(
                    "ByteGPT(total_steps=None) takes the schedule's length from the Trainer; "
                    "attach the module to a Trainer or pass total_steps."
                ) from exc
            if not math.isfinite(estimated):
                raise ValueError(
                    "ByteGPT(total_steps=None) needs a finite run to end its cosine schedule: set the "
                    "Trainer's max_steps or max_epochs, or pass total_steps."
                )
            total = int(estimated)
            if total <= self.hparams.warmup_steps:
                # not an error: a short benchmark run of the preset (lightning-gc bench --steps 20) must
                # still train; it simply never leaves the warm-up
                rank_zero_warn(
                    f"ByteGPT: the run has {total} optimizer steps and warmup_steps={self.hparams.warmup_steps}, "
                    f"so it ends inside the linear warm-up (the last step at {total}/{self.hparams.warmup_steps} "
                    "of lr) and the cosine decay never starts; lower warmup_steps (e.g. a tenth of the run) to "
                    "train with the whole schedule."
                )
        return int(total)

    def configure_optimizers(self):
        hp = self.hparams
        optimizer = torch.optim.AdamW(
            adamw_param_groups(self, hp.weight_decay), lr=hp.lr, betas=(hp.beta1, hp.beta2), eps=1e-8
        )
        total, warmup, floor = self.schedule_steps(), int(hp.warmup_steps), float(hp.min_lr_ratio)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: warmup_cosine(step, warmup, total, floor)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1}}

