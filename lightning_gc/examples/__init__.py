"""Demo workloads (LightningModules + LightningDataModules) for the quickstart, recipes and benchmark.

Everything here is generated from fixed seeds or read from text that ships with Python, so the
workloads run offline and every rank sees identical data. Use them from a LightningCLI YAML, e.g.::

    model:
      class_path: lightning_gc.examples.MLPClassifier
    data:
      class_path: lightning_gc.examples.TeacherClassificationData

or programmatically through :func:`get_preset`. See ``docs/workloads.md``.
"""

from .classification import MLPClassifier, TeacherClassificationData
from .language import ByteLM, StdlibTextData
from .presets import PRESETS, Preset, describe_presets, get_preset
from .transformer import ByteGPT
from .vision import ResNet18Classifier, SyntheticImageData

__all__ = [
    "MLPClassifier",
    "TeacherClassificationData",
    "ResNet18Classifier",
    "SyntheticImageData",
    "ByteLM",
    "StdlibTextData",
    "ByteGPT",
    "PRESETS",
    "Preset",
    "get_preset",
    "describe_presets",
]
