"""Teacher-student classification: the quickstart workload and the ``mlp`` benchmark preset.

Why a synthetic teacher task instead of a real dataset: the package must run with nothing downloaded
(no torchvision, no network), the data must be bit-identical on every rank and every machine for a
given ``seed``, and the task must be *learnable but not trivial* so that a badly tuned gradient
compressor visibly costs accuracy. Labels produced by a fixed random MLP ("teacher") satisfy all
three: a student MLP can reach ~90% accuracy, but only after several epochs of real optimisation.

This module also holds the small helpers every example workload shares (per-purpose random streams,
optimizer construction and validation), so that all workloads accept the same optimizer arguments.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

__all__ = ["MLPClassifier", "TeacherClassificationData", "stream_generator", "build_optimizer"]

_OPTIMIZERS = ("sgd", "adam")


# --------------------------------------------------------------------------------------------
# Shared helpers
# --------------------------------------------------------------------------------------------


def stream_generator(seed: int, stream: str) -> torch.Generator:
    """Return a CPU ``torch.Generator`` for one named purpose ("teacher", "train", "val", ...).

    Every purpose gets its own stream derived from ``(seed, stream)`` so that, e.g., changing the
    number of training samples does not change the validation set, and the validation set is never
    drawn from the same random numbers as the training set. ``zlib.crc32`` is used (not ``hash``)
    because Python's string hash is salted per process, and every DDP rank must derive the same
    stream.
    """
    mixed = (int(seed) * 0x9E3779B97F4A7C15 + zlib.crc32(stream.encode("utf-8"))) % (2**63 - 1)
    return torch.Generator(device="cpu").manual_seed(mixed)


def train_loader(dataset, batch_size: int, generator: torch.Generator, num_workers: int) -> DataLoader:
    """Shuffled training loader. The explicit generator makes single-process shuffling
    reproducible; under DDP Lightning swaps in a DistributedSampler and the generator is unused."""
    return DataLoader(dataset, batch_size=batch_size, shuffle=True, generator=generator,
                      num_workers=num_workers, persistent_workers=num_workers > 0)


def val_loader(dataset, batch_size: int, num_workers: int) -> DataLoader:
    """Validation loader in dataset order."""
    return DataLoader(dataset, batch_size=batch_size, shuffle=False,
                      num_workers=num_workers, persistent_workers=num_workers > 0)


class GeneratedTensorData(L.LightningDataModule):
    """Plumbing shared by the generated data sets: subclasses implement ``generate(split)``
    returning ``(inputs, targets)`` tensors for ``"train"`` and ``"val"`` and store ``seed``,
    ``batch_size`` and ``num_workers`` as hyperparameters."""

    #: validation batches are at least this large (validation needs no gradients)
    min_val_batch_size = 64

    def generate(self, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def setup(self, stage: str | None = None) -> None:
        if getattr(self, "train_set", None) is None:
            self.train_set = TensorDataset(*self.generate("train"))
            self.val_set = TensorDataset(*self.generate("val"))

    def train_dataloader(self) -> DataLoader:
        hp = self.hparams
        return train_loader(self.train_set, hp.batch_size, stream_generator(hp.seed, "shuffle"), hp.num_workers)

    def val_dataloader(self) -> DataLoader:
        hp = self.hparams
        return val_loader(self.val_set, max(hp.batch_size, self.min_val_batch_size), hp.num_workers)


def validate_optimizer_args(optimizer: str, lr: float, momentum: float, weight_decay: float) -> str:
    """Check optimizer arguments at construction time and return the normalised optimizer name.

    Validating in ``__init__`` (rather than in ``configure_optimizers``) makes a typo in a YAML
    config fail before any process group, dataloader or logger is created.
    """
    name = str(optimizer).lower()
    if name not in _OPTIMIZERS:
        raise ValueError(
            f"optimizer={optimizer!r} is not supported: the example workloads implement "
            f"{list(_OPTIMIZERS)}. Set `optimizer: sgd` (default, momentum SGD) or `optimizer: adam`."
        )
    if not lr > 0:
        raise ValueError(f"lr={lr!r} must be > 0: a non-positive learning rate never updates the model.")
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"momentum={momentum!r} must be in [0, 1): values >= 1 make SGD diverge.")
    if weight_decay < 0:
        raise ValueError(f"weight_decay={weight_decay!r} must be >= 0; use 0 to disable it.")
    return name


def build_optimizer(
    params, optimizer: str, lr: float, momentum: float, weight_decay: float
) -> torch.optim.Optimizer:
    """Momentum SGD (the default, the setting most gradient-compression papers report) or Adam.

    For Adam, ``momentum`` is ignored (Adam keeps its default betas) and ``lr`` should be set
    roughly 10-100x smaller than the SGD default.
    """
    name = validate_optimizer_args(optimizer, lr, momentum, weight_decay)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)


def _check_positive(name: str, value: int) -> None:
    if int(value) != value or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer.")


# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------


class TeacherClassificationData(GeneratedTensorData):
    """Gaussian inputs labelled by a fixed, seeded random 2-layer "teacher" MLP.

    Generation (all from ``torch.Generator`` streams derived from ``seed``):

    * the teacher ``logits = tanh(x @ W1 + b1) @ W2`` with ``teacher_hidden`` tanh units is drawn
      from the "teacher" stream; its logits are centred by their mean over a calibration sample so
      that the classes are roughly balanced (a random MLP otherwise favours a few classes);
    * inputs ``x ~ N(0, I)`` of ``num_features`` dims; training samples come from the "train"
      stream and validation samples from the "val" stream, so the sets never share draws;
    * samples whose teacher margin (top-1 minus top-2 logit) is among the smallest
      ``margin_quantile`` fraction are rejected. Without this the task is dominated by points that
      sit on the teacher's decision boundaries, and a student cannot get past ~70% accuracy from
      ~10^4 samples; with the default 0.5 a [256, 256] student reaches ~90%;
    * with probability ``label_noise`` a label is replaced by a uniformly drawn class (which caps
      the achievable accuracy at about ``1 - label_noise * (1 - 1/num_classes)``).

    Every rank generates the identical full dataset; Lightning's ``DistributedSampler`` gives each
    rank its shard, so nothing here knows about ranks.
    """

    min_val_batch_size = 256

    def __init__(
        self,
        num_features: int = 64,
        num_classes: int = 10,
        num_train: int = 16384,
        num_val: int = 2048,
        teacher_hidden: int = 32,
        margin_quantile: float = 0.5,
        label_noise: float = 0.0,
        batch_size: int = 64,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        for name in ("num_features", "num_train", "num_val", "teacher_hidden", "batch_size"):
            _check_positive(name, locals()[name])
        if num_classes < 2:
            raise ValueError(f"num_classes={num_classes!r} must be >= 2 for a classification task.")
        if not 0.0 <= margin_quantile < 1.0:
            raise ValueError(
                f"margin_quantile={margin_quantile!r} must be in [0, 1): it is the fraction of "
                "lowest-margin samples rejected; 0 keeps everything, 1 would reject everything."
            )
        if not 0.0 <= label_noise <= 1.0:
            raise ValueError(f"label_noise={label_noise!r} must be a probability in [0, 1].")
        if num_workers < 0:
            raise ValueError(f"num_workers={num_workers!r} must be >= 0 (0 loads in the main process).")
        self.save_hyperparameters()
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None
        self._teacher: tuple[torch.Tensor, ...] | None = None

    # The teacher is built lazily so that constructing the DataModule (e.g. by LightningCLI or
    # ``describe_presets``) costs nothing.
    def _teacher_params(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float]:
        if self._teacher is None:
            hp = self.hparams
            g = stream_generator(hp.seed, "teacher")
            # float64 so that the keep/reject decision at the margin threshold cannot flip between
            # machines whose float32 matmul kernels round differently (a flip would shift every
            # later sample and give two ranks different datasets).
            dt = torch.float64
            w1 = torch.randn(hp.num_features, hp.teacher_hidden, generator=g, dtype=dt) / hp.num_features**0.5
            b1 = 0.5 * torch.randn(hp.teacher_hidden, generator=g, dtype=dt)
            w2 = (
                torch.randn(hp.teacher_hidden, hp.num_classes, generator=g, dtype=dt) / hp.teacher_hidden**0.5
            )
            calib = torch.randn(32768, hp.num_features, generator=g, dtype=dt)
            raw = torch.tanh(calib @ w1 + b1) @ w2
            centre = raw.mean(dim=0)
            top2 = (raw - centre).topk(2, dim=1).values
            margins = top2[:, 0] - top2[:, 1]
            threshold = float(torch.quantile(margins, hp.margin_quantile)) if hp.margin_quantile > 0 else 0.0
            self._teacher = (w1, b1, w2, centre, threshold)
        return self._teacher  # type: ignore[return-value]

    def teacher_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Centred teacher logits (float64) for inputs ``x`` of shape ``(n, num_features)``."""
        w1, b1, w2, centre, _ = self._teacher_params()
        return torch.tanh(x.to(torch.float64) @ w1 + b1) @ w2 - centre

    def generate(self, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(x, y)`` for ``split`` in {"train", "val"}: float32 ``(n, num_features)``, int64 ``(n,)``.

        Deterministic: the same hyperparameters always give bit-identical tensors.
        """
        if split not in ("train", "val"):
            raise ValueError(f"split={split!r} is not a split of this DataModule; use 'train' or 'val'.")
        hp = self.hparams
        n = hp.num_train if split == "train" else hp.num_val
        threshold = self._teacher_params()[4]
        g = stream_generator(hp.seed, split)
        xs, ys, have = [], [], 0
        # Fixed-size chunks keep the draw sequence (hence the data) independent of ``n``.
        while have < n:
            x = torch.randn(4096, hp.num_features, generator=g)
            logits = self.teacher_logits(x)
            top2 = logits.topk(2, dim=1).values
            keep = (top2[:, 0] - top2[:, 1]) >= threshold
            xs.append(x[keep])
            ys.append(logits.argmax(dim=1)[keep])
            have += int(keep.sum())
        x = torch.cat(xs)[:n].contiguous()
        y = torch.cat(ys)[:n].contiguous()
        if hp.label_noise > 0:
            flip = torch.rand(n, generator=g) < hp.label_noise
            random_labels = torch.randint(0, hp.num_classes, (n,), generator=g)
            y = torch.where(flip, random_labels, y)
        return x, y



class ClassifierModule(L.LightningModule):
    """Training, validation and optimizer shared by the example classifiers: cross-entropy,
    ``train_loss`` per step, ``val_loss`` / ``val_acc`` per epoch (reduced across ranks).
    Subclasses define ``forward``, ``self.val_acc`` and the hyperparameters ``optimizer``, ``lr``,
    ``momentum``, ``weight_decay``."""

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y), on_epoch=True, sync_dist=True)
        self.val_acc.update(logits, y)
        self.log("val_acc", self.val_acc, on_epoch=True, prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        hp = self.hparams
        return build_optimizer(self.parameters(), hp.optimizer, hp.lr, hp.momentum, hp.weight_decay)


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------


class MLPClassifier(ClassifierModule):
    """A ReLU MLP classifier: ``num_features -> hidden[0] -> ... -> hidden[-1] -> num_classes``.

    Small enough to train on CPUs in a minute, yet with several weight matrices of different
    shapes (e.g. 64x256, 256x256, 256x10), which is what per-tensor compressors (top-k, PowerSGD)
    and bucketing care about. Logs ``train_loss`` every step and ``val_loss`` / ``val_acc`` every
    validation epoch (reduced across ranks).

    The defaults are the quickstart configuration. ``lr=0.005`` (with momentum 0.9) is deliberately
    modest: with 2 ranks x 64 samples per step, dense SGD is still improving after 5 epochs, so a
    compressor that slows convergence shows up in the accuracy curve instead of being hidden by an
    early plateau (a 10x larger lr plateaus, and over-fits, after the first epoch).
    """

    def __init__(
        self,
        num_features: int = 64,
        num_classes: int = 10,
        hidden: Sequence[int] = (256, 256),
        lr: float = 0.005,
        momentum: float = 0.9,
        weight_decay: float = 5e-4,
        optimizer: str = "sgd",
    ) -> None:
        super().__init__()
        _check_positive("num_features", num_features)
        if num_classes < 2:
            raise ValueError(f"num_classes={num_classes!r} must be >= 2 for a classification task.")
        hidden = [int(h) for h in hidden]
        if not hidden or any(h < 1 for h in hidden):
            raise ValueError(
                f"hidden={hidden!r} must be a non-empty list of positive layer widths, e.g. [256, 256]."
            )
        validate_optimizer_args(optimizer, lr, momentum, weight_decay)
        self.save_hyperparameters()
        layers: list[nn.Module] = []
        width = num_features
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)
        self.val_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

