"""The bench's FSDP2 methods: native HSDP baselines and ``GCModelParallelStrategy`` (docs/fsdp.md).

* ``hsdp``: native HSDP, fp32: FSDP2 on the 2-D (replicate, shard) mesh, its own dense replica
  all-reduce. The baseline a user of FSDP2 has without lightning_gc.
* ``hsdp_bf16``: the same with ``MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)``: the
  reduce-scatter and the replica all-reduce in bf16 (FSDP2's "16-bit reduce").
* ``fsdp_<compressor>`` (``fsdp_topk:ratio=0.01``, ``fsdp_qsgd``, ``fsdp_bf16``, ``fsdp_dense``, ...):
  :class:`~lightning_gc.model_parallel.GCModelParallelStrategy` with that compressor between
  replicas; options are its keyword arguments or the compressor's.

Replicas are the bench's hosts (``--hosts``), shards the processes of one host, so the shard
dimension never crosses the shaped link. The preset shards itself in ``configure_model``
(lightning_gc/examples/language.py) with what the strategy's ``fully_shard_kwargs()`` says.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import ModelParallelStrategy

from lightning_gc.model_parallel import GCModelParallelStrategy

#: the native HSDP baselines (torch alone), with the reduce dtype each sets
HSDP_BASELINES = {"hsdp": None, "hsdp_bf16": "bfloat16"}
FSDP_PREFIX = "fsdp_"
_STRATEGY_KEYS = {"ratio", "collective", "error_feedback", "seed", "min_compress_numel"}


class NativeHSDPStrategy(GCModelParallelStrategy):
    """Native HSDP: the model is sharded on the 2-D (replicate, data_parallel) mesh and FSDP2
    all-reduces across replicas itself; no hook of lightning_gc's is installed."""

    def __init__(self, reduce_dtype: str | None = None) -> None:
        super().__init__(compressor="dense")
        self.reduce_dtype = reduce_dtype

    def fully_shard_kwargs(self) -> dict[str, Any]:
        import torch
        from torch.distributed.fsdp import MixedPrecisionPolicy

        kwargs: dict[str, Any] = {"mesh": self.device_mesh["replicate", "data_parallel"]}
        if self.reduce_dtype is not None:
            kwargs["mp_policy"] = MixedPrecisionPolicy(reduce_dtype=getattr(torch, self.reduce_dtype))
        return kwargs

    def setup(self, trainer: Any) -> None:
        ModelParallelStrategy.setup(self, trainer)  # Lightning's own: no replica hooks


def build_fsdp_strategy(name: str, options: dict[str, Any]):
    """The strategy of an FSDP2 bench method (options already parsed)."""
    if name in HSDP_BASELINES:
        if options:
            raise ValueError(f"method {name!r} takes no options (got {sorted(options)})")
        return NativeHSDPStrategy(HSDP_BASELINES[name])
    compressor = name[len(FSDP_PREFIX):]
    kwargs = {k: v for k, v in options.items() if k in _STRATEGY_KEYS}
    args = {k: v for k, v in options.items() if k not in _STRATEGY_KEYS}
    return GCModelParallelStrategy(compressor=compressor, compressor_args=args, **kwargs)


def hsdp_bytes_per_step(name: str, hosts: int, ranks: int, num_params: int) -> float:
    """Bytes one rank sends per step between hosts for a native HSDP baseline: a ring all-reduce of
    its shard (``1/shard_ranks`` of the gradient, in the reduce dtype) across the hosts. What
    ``fsdp_<compressor>`` counts too (its replica exchange); the reduce-scatter and the parameters'
    all-gathers stay inside the host, for every method alike."""
    shard_ranks = ranks // hosts
    grad_bytes = (2 if HSDP_BASELINES[name] else 4) * num_params
    return 2 * (hosts - 1) / hosts * grad_bytes / shard_ranks if hosts > 1 else 0.0
