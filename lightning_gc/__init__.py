"""lightning_gc: communication-efficient data-parallel training for PyTorch Lightning.

Importing the package registers the ``gc_<compressor>`` strategy aliases with Lightning, so
``Trainer(strategy="gc_topk")`` works after ``import lightning_gc`` (``"gc_fsdp_topk"`` for FSDP2 models,
docs/fsdp.md; and ``Fabric(strategy="gc_topk")``
with Lightning Fabric, :mod:`lightning_gc.fabric`).
"""

from .adaptive import AdaptiveRatio
from .callbacks import GCMonitor, GradientFidelity
from .compressors import available_compressors, build_compressor
from .engine import EngineConfig, GCEngine
from .fabric import GCFabricStrategy, register_fabric_aliases
from .model_parallel import GCModelParallelStrategy, register_model_parallel_aliases
from .strategy import GCStrategy, register_aliases

__version__ = "0.1.0"

register_model_parallel_aliases()
register_aliases()
register_fabric_aliases()

__all__ = ["AdaptiveRatio", "EngineConfig", "GCEngine", "GCMonitor", "GCFabricStrategy", "GCModelParallelStrategy", "GCStrategy", "GradientFidelity", "available_compressors", "build_compressor", "__version__"]
