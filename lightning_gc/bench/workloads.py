"""Workloads for the benchmark: the package presets, a built-in ``probe`` and user presets.

``--preset`` accepts

* a preset name of :func:`lightning_gc.examples.presets.get_preset` (``mlp``, ``cnn``, ``lm``,
  ``gpt``, ``quickstart``). ``gpt`` is the AdamW transformer: its warm-up + cosine schedule spans the
  run (``--steps``; a run no longer than its warm-up is warned about), its target is set so that
  DDP crosses it late in a ``--steps 600`` run, and it clips inside the module;
* ``probe``: a single dense layer (``width`` x ``width`` weights, 512 -> 262,656 parameters, 1 MiB of
  fp32 gradient) on a random linear-regression task. It needs nothing but torch and spends almost
  all of its step in communication, which makes it the workload for checking the emulated network
  itself (the shaped-rate test uses it);
* ``deep``: the ResNet-50 layer layout (bottleneck blocks ``[3, 4, 6, 3]``, 161 parameter tensors)
  at width 8 (0.38M parameters) on synthetic 3x16x16 template images, batch 16: many tensors of
  uneven sizes, the workload for merge plans (``topk:plan=omgs`` against ``plan=model/layer/threshold``).
  ``--preset-arg`` keys: ``width``, ``image_size``, ``batch_size``, ``lr``, ``num_train``;
* ``package.module:factory``: any callable ``factory(seed=..., **preset_args)`` returning an object
  with the attributes ``model``, ``datamodule``, ``metric`` (name of a logged validation metric),
  ``mode`` (``"max"``/``"min"``), ``target`` (float or ``None``) and ``batch_size``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

__all__ = ["WorkloadError", "Workload", "parse_value", "preset_arg", "resolve_preset"]

_REQUIRED = ("model", "datamodule", "metric", "mode", "target", "batch_size")
_CONTRACT = ("a 'module:factory' preset is a callable factory(seed=..., **preset_args) returning an object with "
             f"the attributes {', '.join(_REQUIRED)}, e.g. types.SimpleNamespace(model=MyModule(), "
             "datamodule=MyData(), metric='val_loss', mode='min', target=None, batch_size=32)")


class WorkloadError(ValueError):
    """A preset that cannot be built; the message names it, the reason and the fix."""


def parse_value(text: str) -> Any:
    """A command-line value as Python: ``true/yes/on``, ``false/no/off``, ``none/null``, an int, a
    float, else the stripped text (``--preset-arg`` values and method options)."""
    low = text.strip().lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    if low in ("none", "null"):
        return None
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text.strip()


def preset_arg(text: str) -> tuple[str, Any]:
    """``--preset-arg KEY=VALUE`` → ``(key, value)``: the argparse type that ``lightning-gc bench`` and
    ``lightning-gc advise`` share (values through :func:`parse_value`)."""
    import argparse

    key, eq, value = text.partition("=")
    if not eq or not key.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE; write e.g. --preset-arg batch_size=64")
    return key.strip(), parse_value(value)


def meets_target(value: float | None, target: float | None, mode: str) -> bool:
    """Whether a metric ``value`` reaches ``target`` in the metric's direction (``"max"``: at least,
    ``"min"``: at most); ``False`` when either is missing."""
    if value is None or target is None:
        return False
    return value >= target if mode == "max" else value <= target


@dataclass
class Workload:
    name: str
    model: Any
    datamodule: Any
    metric: str
    mode: str
    target: float | None
    batch_size: int


def _probe(seed: int = 0, width: int = 512, batch_size: int = 32, lr: float = 0.01, samples: int = 2048):
    import lightning as L
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    width, batch_size, samples = int(width), int(batch_size), int(samples)
    if width < 1 or batch_size < 1 or samples < batch_size:
        raise WorkloadError(
            f"probe preset: width={width}, batch_size={batch_size}, samples={samples} must be positive with "
            f"samples >= batch_size; e.g. --preset-arg width=512"
        )

    class ProbeModel(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(width, width)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return ((self.net(x) - y) ** 2).sum(dim=1).mean()  # summed over outputs: learns in ~40 steps

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", F.mse_loss(self.net(x), y), on_epoch=True, sync_dist=True)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=lr)

    class ProbeData(L.LightningDataModule):
        def __init__(self) -> None:
            super().__init__()
            g = torch.Generator().manual_seed(seed)
            teacher = torch.randn(width, width, generator=g) / width**0.5
            x = torch.randn(samples, width, generator=g)
            xv = torch.randn(max(batch_size, samples // 8), width, generator=g)
            self.train_set = TensorDataset(x, x @ teacher.T)
            self.val_set = TensorDataset(xv, xv @ teacher.T)

        def train_dataloader(self):
            return DataLoader(self.train_set, batch_size=batch_size, shuffle=True, drop_last=True,
                              generator=torch.Generator().manual_seed(seed + 1))

        def val_dataloader(self):
            return DataLoader(self.val_set, batch_size=batch_size)

    torch.manual_seed(seed)
    # target 0.5 (per-element MSE): reached within a few tens of steps at the default lr
    return Workload("probe", ProbeModel(), ProbeData(), "val_loss", "min", 0.5, batch_size)


def _deep(seed: int = 0, width: int = 8, image_size: int = 16, batch_size: int = 16, lr: float = 0.05,
          num_train: int = 4096):
    import torch

    from lightning_gc.examples.deep import DeepResNetClassifier
    from lightning_gc.examples.vision import SyntheticImageData

    width, image_size, batch_size, num_train = int(width), int(image_size), int(batch_size), int(num_train)
    if width < 1 or image_size < 4 or batch_size < 1 or num_train < batch_size:
        raise WorkloadError(
            f"deep preset: width={width}, image_size={image_size}, batch_size={batch_size}, num_train={num_train} "
            "must be positive with image_size >= 4 and num_train >= batch_size; e.g. --preset-arg width=8"
        )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = DeepResNetClassifier(num_classes=10, width=width, lr=float(lr))
    data = SyntheticImageData(num_classes=10, num_train=num_train, num_val=512, image_size=image_size,
                              max_shift=image_size // 2, template_grid=4, batch_size=batch_size, seed=seed)
    return Workload("deep", model, data, "val_acc", "max", 0.6, batch_size)


def resolve_preset(name: str, seed: int = 0, **overrides: Any):
    """Build the workload ``name`` (see the module docstring)."""
    if name == "probe":
        preset = _probe(seed=seed, **overrides)
    elif name == "deep":
        try:
            preset = _deep(seed=seed, **overrides)
        except TypeError as exc:
            raise WorkloadError(f"preset 'deep' with arguments {overrides}: {exc}") from exc
    elif ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            factory = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise WorkloadError(
                f"preset {name!r}: cannot import {attr!r} from module {module_name!r} ({exc}); make the module "
                f"importable (PYTHONPATH) or use a built-in preset"
            ) from exc
        if not callable(factory):
            raise WorkloadError(f"preset {name!r}: {attr!r} is a {type(factory).__name__}, not a callable; "
                                f"{_CONTRACT}")
        try:
            preset = factory(seed=seed, **overrides)
        except TypeError as exc:
            raise WorkloadError(f"preset {name!r} with arguments {overrides}: {exc}; {_CONTRACT}") from exc
    else:
        try:
            from lightning_gc.examples.presets import get_preset
        except ImportError as exc:
            raise WorkloadError(
                f"preset {name!r} needs lightning_gc.examples.presets, which is not importable ({exc}); "
                f"use --preset probe or a 'module:factory' preset"
            ) from exc
        try:
            preset = get_preset(name, seed=seed, **overrides)
        except (KeyError, ValueError, TypeError) as exc:
            raise WorkloadError(f"preset {name!r} with arguments {overrides}: {exc}") from exc
    missing = [a for a in _REQUIRED if not hasattr(preset, a)]
    if missing:
        raise WorkloadError(f"preset {name!r} returned a {type(preset).__name__} without attribute(s) {missing}; "
                            f"{_CONTRACT}")
    if preset.mode not in ("max", "min"):
        raise WorkloadError(f"preset {name!r} has mode={preset.mode!r}; it must be 'max' or 'min'")
    return preset
