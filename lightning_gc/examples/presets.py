"""Named, ready-to-train (model, data, metric, target) bundles used by the quickstart and the benchmark.

A preset fixes everything that makes two benchmark runs comparable -- architecture, data, batch
size, optimizer settings and the metric/target that defines "time to target" -- so that a run
differs from another only in what is being measured (compressor, network model, world size).
Any constructor argument of the preset's model or DataModule can still be overridden by name.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import lightning as L
import torch

from .classification import MLPClassifier, TeacherClassificationData
from .language import ByteLM, StdlibTextData
from .transformer import ByteGPT
from .vision import ResNet18Classifier, SyntheticImageData

__all__ = ["PRESETS", "Preset", "PresetSpec", "get_preset", "describe_presets"]


@dataclass(frozen=True)
class PresetSpec:
    """The recipe for a preset: classes, their default arguments, and the metric to watch."""

    model_cls: type[L.LightningModule]
    model_kwargs: dict[str, Any]
    data_cls: type[L.LightningDataModule]
    data_kwargs: dict[str, Any]
    metric: str
    mode: str
    target: float
    description: str


@dataclass
class Preset:
    """A constructed workload: fresh model and DataModule instances plus how to judge progress.

    ``target`` is the value of ``metric`` (``"max"``: at least, ``"min"``: at most) that counts as
    "reached" for time-to-target measurements; it is chosen so that dense synchronous SGD reaches
    it well within the preset's usual budget but not in the first few hundred steps.
    """

    name: str
    model: L.LightningModule
    datamodule: L.LightningDataModule
    metric: str
    mode: str
    target: float
    batch_size: int
    description: str = ""
    overrides: dict[str, Any] = field(default_factory=dict)

    def reached(self, value: float) -> bool:
        """Whether a metric ``value`` meets the target in this preset's direction."""
        return value >= self.target if self.mode == "max" else value <= self.target


PRESETS: dict[str, PresetSpec] = {
    "quickstart": PresetSpec(
        model_cls=MLPClassifier,
        model_kwargs=dict(
            num_features=64, num_classes=10, hidden=[256, 256], lr=0.005, momentum=0.9, weight_decay=5e-4
        ),
        data_cls=TeacherClassificationData,
        data_kwargs=dict(num_features=64, num_classes=10, num_train=16384, num_val=2048, batch_size=64),
        metric="val_acc",
        mode="max",
        target=0.85,
        description=(
            "85k-parameter MLP on teacher-labelled Gaussian data; < 1 minute for 5 epochs on 2 CPU ranks."
        ),
    ),
    "mlp": PresetSpec(
        model_cls=MLPClassifier,
        model_kwargs=dict(
            num_features=128,
            num_classes=10,
            hidden=[768, 768, 512],
            lr=0.005,
            momentum=0.9,
            weight_decay=5e-4,
        ),
        data_cls=TeacherClassificationData,
        data_kwargs=dict(num_features=128, num_classes=10, num_train=32768, num_val=4096, batch_size=64),
        metric="val_acc",
        mode="max",
        target=0.85,
        description="1.09M-parameter, 4-matrix MLP on 128-dimensional teacher-labelled data.",
    ),
    "cnn": PresetSpec(
        model_cls=ResNet18Classifier,
        model_kwargs=dict(num_classes=10, width=64, lr=0.05, momentum=0.9, weight_decay=5e-4),
        data_cls=SyntheticImageData,
        data_kwargs=dict(num_classes=10, num_train=8192, num_val=1024, batch_size=16),
        metric="val_acc",
        mode="max",
        target=0.8,
        description="CIFAR-style ResNet-18 (11.2M parameters) on synthetic 3x32x32 template images.",
    ),
    "lm": PresetSpec(
        model_cls=ByteLM,
        model_kwargs=dict(embed_dim=64, hidden_size=256, num_layers=1, lr=1.0, momentum=0.9, grad_clip=1.0),
        data_cls=StdlibTextData,
        data_kwargs=dict(seq_len=64, max_bytes=2_000_000, val_fraction=0.1, batch_size=32),
        metric="val_bpb",
        mode="min",
        target=2.5,
        description="Byte-level LSTM language model on the Python standard library's source text.",
    ),
    "gpt": PresetSpec(
        model_cls=ByteGPT,
        model_kwargs=dict(
            d_model=128, n_layers=2, n_heads=4, seq_len=64, lr=3e-3, beta1=0.9, beta2=0.95,
            weight_decay=0.1, warmup_steps=50, min_lr_ratio=0.1, grad_clip=1.0,
        ),
        data_cls=StdlibTextData,
        data_kwargs=dict(seq_len=64, max_bytes=2_000_000, val_fraction=0.1, batch_size=16),
        metric="val_bpb",
        mode="min",
        target=2.5,
        description=(
            "2-layer decoder-only byte transformer (AdamW, warm-up + cosine, clipping 1.0) on the "
            "standard library's source text."
        ),
    ),
}


def _init_params(cls: type) -> set[str]:
    return {n for n in inspect.signature(cls.__init__).parameters if n != "self"}


def get_preset(name: str, seed: int = 0, **overrides: Any) -> Preset:
    """Build preset ``name`` with fresh model and DataModule instances.

    ``seed`` seeds both the data (``DataModule(seed=...)``) and the model's initial weights; the
    weights are drawn inside ``torch.random.fork_rng`` so building a preset neither depends on nor
    changes the global RNG state, and two calls with the same arguments give identical models.

    ``overrides`` are routed by name: keys accepted by the model's ``__init__`` go to the model,
    keys accepted by the DataModule's go to the DataModule (keys accepted by both, such as
    ``num_classes``, go to both, keeping them consistent), and ``target`` replaces the target.
    """
    if name not in PRESETS:
        raise ValueError(f"Unknown preset {name!r}: valid presets are {sorted(PRESETS)}.")
    spec = PRESETS[name]
    model_kwargs = dict(spec.model_kwargs)
    data_kwargs = dict(spec.data_kwargs)
    target = spec.target
    model_keys, data_keys = _init_params(spec.model_cls), _init_params(spec.data_cls)
    for key, value in overrides.items():
        if key == "target":
            target = float(value)
            continue
        if key == "seed":
            raise ValueError("Pass `seed` as get_preset's own argument, not as an override.")
        if key not in model_keys and key not in data_keys:
            raise ValueError(
                f"Override {key!r} is not an argument of preset {name!r}: "
                f"{spec.model_cls.__name__} accepts {sorted(model_keys)}, "
                f"{spec.data_cls.__name__} accepts {sorted(data_keys - {'seed'})}, plus 'target'."
            )
        if key in model_keys:
            model_kwargs[key] = value
        if key in data_keys:
            data_kwargs[key] = value
    datamodule = spec.data_cls(**data_kwargs, seed=seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = spec.model_cls(**model_kwargs)
    return Preset(
        name=name,
        model=model,
        datamodule=datamodule,
        metric=spec.metric,
        mode=spec.mode,
        target=target,
        batch_size=int(data_kwargs["batch_size"]),
        description=spec.description,
        overrides=dict(overrides),
    )


def describe_presets() -> list[dict[str, Any]]:
    """One row per preset (name, classes, parameter count, metric, mode, target, batch size).

    Cheap: models are built but no data is generated or read.
    """
    rows = []
    for name in PRESETS:
        preset = get_preset(name)
        rows.append(
            dict(
                name=name,
                model=type(preset.model).__name__,
                data=type(preset.datamodule).__name__,
                params=sum(p.numel() for p in preset.model.parameters()),
                metric=preset.metric,
                mode=preset.mode,
                target=preset.target,
                batch_size=preset.batch_size,
                description=preset.description,
            )
        )
    return rows
