"""Image classification: a CIFAR-style ResNet-18 on seeded synthetic 3x32x32 images (``cnn`` preset).

ResNet-18 on CIFAR-10 is the most common benchmark in the gradient-compression literature (it has
many tensors of very different sizes: 3x3 convolutions from 1.7k to 2.4M weights, BatchNorm
vectors, a small classifier). Real CIFAR-10 would have to be downloaded, so the same model shape is
trained on images generated from class templates instead; what matters for communication
experiments is the gradient structure of the network, not the pixels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset
from torchmetrics.classification import MulticlassAccuracy

from .classification import (
    ClassifierModule,
    GeneratedTensorData,
    _check_positive,
    stream_generator,
    validate_optimizer_args,
)

__all__ = ["SyntheticImageData", "ResNet18Classifier"]


def _low_frequency(n: int, channels: int, size: int, grid: int, generator: torch.Generator) -> torch.Tensor:
    """``n`` smooth random images: a ``grid x grid`` Gaussian field bilinearly upsampled to ``size``."""
    coarse = torch.randn(n, channels, grid, grid, generator=generator)
    return F.interpolate(coarse, size=(size, size), mode="bilinear", align_corners=False)


class SyntheticImageData(GeneratedTensorData):
    """Seeded 3x``image_size``x``image_size`` images whose class is a shifted low-frequency template.

    Each class ``c`` owns a fixed smooth colour pattern ``T_c`` (a ``template_grid`` x
    ``template_grid`` Gaussian field, 8x8 by default, upsampled, drawn from the "templates" stream
    of ``seed``). An image of class ``c`` is::

        x = a * roll(T_c, dy, dx) + nuisance_std * N_smooth + noise_std * N_pixel

    with contrast ``a ~ U(0.5, 1.5)``, a random circular shift ``|dy|, |dx| <= max_shift`` pixels,
    an independent smooth "background" field and i.i.d. pixel noise. The shift makes a linear
    classifier on raw pixels weak while a convolutional network with global pooling learns it, and
    the background/noise keep it from being solved in a few steps. Training images come from the
    "train" stream and validation images from the "val" stream. All ranks hold the full,
    identical dataset; Lightning's ``DistributedSampler`` shards it.
    """

    def __init__(
        self,
        num_classes: int = 10,
        num_train: int = 8192,
        num_val: int = 1024,
        image_size: int = 32,
        max_shift: int = 16,
        template_grid: int = 8,
        nuisance_std: float = 0.5,
        noise_std: float = 0.5,
        batch_size: int = 16,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        for name in ("num_train", "num_val", "image_size", "template_grid", "batch_size"):
            _check_positive(name, locals()[name])
        if num_classes < 2:
            raise ValueError(f"num_classes={num_classes!r} must be >= 2 for a classification task.")
        if not 0 <= max_shift < image_size:
            raise ValueError(f"max_shift={max_shift!r} must be in [0, image_size={image_size}).")
        if nuisance_std < 0 or noise_std < 0:
            raise ValueError(
                f"nuisance_std={nuisance_std!r} and noise_std={noise_std!r} must be >= 0 (they are "
                "standard deviations)."
            )
        if num_workers < 0:
            raise ValueError(f"num_workers={num_workers!r} must be >= 0 (0 loads in the main process).")
        self.save_hyperparameters()
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None

    def templates(self) -> torch.Tensor:
        """The ``(num_classes, 3, image_size, image_size)`` class templates, each with unit std."""
        hp = self.hparams
        t = _low_frequency(
            hp.num_classes, 3, hp.image_size, hp.template_grid, stream_generator(hp.seed, "templates")
        )
        return t / t.flatten(1).std(dim=1).view(-1, 1, 1, 1)

    def generate(self, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(x, y)`` for ``split`` in {"train", "val"}: float32 ``(n, 3, H, W)``, int64 ``(n,)``."""
        if split not in ("train", "val"):
            raise ValueError(f"split={split!r} is not a split of this DataModule; use 'train' or 'val'.")
        hp = self.hparams
        n = hp.num_train if split == "train" else hp.num_val
        g = stream_generator(hp.seed, split)
        templates = self.templates()
        y = torch.randint(0, hp.num_classes, (n,), generator=g)
        x = torch.empty(n, 3, hp.image_size, hp.image_size)
        chunk = 1024
        for start in range(0, n, chunk):
            stop = min(start + chunk, n)
            m = stop - start
            contrast = 0.5 + torch.rand(m, 1, 1, 1, generator=g)
            shifts = torch.randint(-hp.max_shift, hp.max_shift + 1, (m, 2), generator=g)
            background = _low_frequency(m, 3, hp.image_size, 4, g)
            noise = torch.randn(m, 3, hp.image_size, hp.image_size, generator=g)
            base = templates[y[start:stop]]
            shifted = torch.stack(
                [torch.roll(img, shifts=(int(s[0]), int(s[1])), dims=(1, 2)) for img, s in zip(base, shifts)]
            )
            x[start:stop] = contrast * shifted + hp.nuisance_std * background + hp.noise_std * noise
        return x, y



class BasicBlock(nn.Module):
    """The ResNet basic block: two 3x3 conv-BN layers plus an identity or 1x1-conv shortcut."""

    def __init__(self, in_planes: int, planes: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False), nn.BatchNorm2d(planes)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet18Classifier(ClassifierModule):
    """CIFAR-style ResNet-18: 3x3 stem (no max-pool), BasicBlock x [2, 2, 2, 2], global average pool.

    Stage widths are ``width * (1, 2, 4, 8)``; ``width=64`` is the standard network with
    11,173,962 parameters for 10 classes (as in the PowerSGD and Deep Gradient Compression
    experiments). Smaller widths (e.g. 8) keep the exact layer structure -- same number and kinds
    of tensors -- at a fraction of the cost, which is what tests use. Logs ``train_loss`` every
    step and ``val_loss`` / ``val_acc`` every validation epoch.
    """

    def __init__(
        self,
        num_classes: int = 10,
        width: int = 64,
        lr: float = 0.05,
        momentum: float = 0.9,
        weight_decay: float = 5e-4,
        optimizer: str = "sgd",
    ) -> None:
        super().__init__()
        _check_positive("width", width)
        if num_classes < 2:
            raise ValueError(f"num_classes={num_classes!r} must be >= 2 for a classification task.")
        validate_optimizer_args(optimizer, lr, momentum, weight_decay)
        self.save_hyperparameters()
        self.conv1 = nn.Conv2d(3, width, 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        stages = []
        in_planes = width
        for i, stride in enumerate((1, 2, 2, 2)):
            planes = width * 2**i
            stages.append(nn.Sequential(BasicBlock(in_planes, planes, stride), BasicBlock(planes, planes, 1)))
            in_planes = planes
        self.layers = nn.Sequential(*stages)
        self.fc = nn.Linear(in_planes, num_classes)
        self.val_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layers(out)
        out = F.adaptive_avg_pool2d(out, 1).flatten(1)
        return self.fc(out)

