"""A deep network for merge-plan experiments: the ResNet-50 layer layout at a small width.

OMGS matters when a model has many tensors of uneven sizes: per-tensor exchanges (LAGS) then pay
many start-ups, one merged exchange (TopK-SGD) waits for all of backward. ResNet-50's layout —
a stem, bottleneck blocks ``[3, 4, 6, 3]`` (1x1 → 3x3 → 1x1, expansion 4), projection shortcuts,
a linear head — gives 161 parameter tensors (53 convolutions + 1 linear layer + their
norms/biases). ``width`` scales every stage (64 is the standard network, 23.5M parameters); the
default 8 keeps the structure at about 0.4M parameters so that 4 ranks train it on 2 CPU cores.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

from .classification import ClassifierModule, _check_positive, validate_optimizer_args


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, in_planes: int, planes: int, stride: int) -> None:
        super().__init__()
        out = planes * self.expansion
        self.conv1 = nn.Conv2d(in_planes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_planes != out:
            self.shortcut = nn.Sequential(nn.Conv2d(in_planes, out, 1, stride=stride, bias=False), nn.BatchNorm2d(out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + self.shortcut(x))


class DeepResNetClassifier(ClassifierModule):
    """ResNet-50 layout (bottleneck blocks ``[3, 4, 6, 3]``) with stage widths ``width·(1, 2, 4, 8)``."""

    def __init__(self, num_classes: int = 10, width: int = 8, lr: float = 0.05, momentum: float = 0.9,
                 weight_decay: float = 5e-4, optimizer: str = "sgd") -> None:
        super().__init__()
        _check_positive("width", width)
        if num_classes < 2:
            raise ValueError(f"num_classes={num_classes!r} must be >= 2 for a classification task.")
        validate_optimizer_args(optimizer, lr, momentum, weight_decay)
        self.save_hyperparameters()
        self.conv1 = nn.Conv2d(3, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        blocks: list[nn.Module] = []
        in_planes = width
        for i, (n, stride) in enumerate(zip((3, 4, 6, 3), (1, 2, 2, 2))):
            planes = width * 2**i
            for j in range(n):
                blocks.append(Bottleneck(in_planes, planes, stride if j == 0 else 1))
                in_planes = planes * Bottleneck.expansion
        self.layers = nn.Sequential(*blocks)
        self.fc = nn.Linear(in_planes, num_classes)
        self.val_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layers(out)
        return self.fc(F.adaptive_avg_pool2d(out, 1).flatten(1))
