"""FSDP2 models with a compressed exchange between replicas: ``GCModelParallelStrategy`` (docs/fsdp.md).

Lightning's :class:`~lightning.pytorch.strategies.ModelParallelStrategy` runs FSDP2 (and tensor
parallelism) on a device mesh that the user's ``configure_model`` shards the model on. This
subclass lays the data-parallel ranks out as ``replicate × data_parallel``: ``data_parallel`` is the
ranks of one node, on which the user's ``fully_shard(..., mesh=self.device_mesh["data_parallel"])``
shards as usual, and the replicas are the nodes. FSDP2 reduce-scatters inside the node; every FSDP
module's all-reduce hook then runs lightning_gc's compressor between the nodes
(:mod:`lightning_gc.sync.hsdp`). The model code is the one ``ModelParallelStrategy`` runs.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import ModelParallelStrategy
from typing_extensions import override

from ._validation import check_int
from .comm.network import NetworkState
from .config import CompressionConfig, is_flat_name
from .engine.config import EngineConfig
from .engine.slots import MethodSpec, build_slot
from .sync.hsdp import ReplicaExchange, attach, refusal

#: the folder, inside a distributed checkpoint, that holds each rank's error memory
MEMORY_DIR = "lightning_gc"


class GCModelParallelStrategy(ModelParallelStrategy):
    """FSDP2 inside each node, lightning_gc's compressed exchange between nodes (HSDP).

    In ``configure_model``, shard exactly as with ``ModelParallelStrategy``::

        for block in self.model.blocks:
            fully_shard(block, mesh=self.device_mesh["data_parallel"])
        fully_shard(self.model, mesh=self.device_mesh["data_parallel"])

    ``device_mesh`` has the dimensions ``("replicate", "data_parallel", "tensor_parallel")``; the
    ``data_parallel`` mesh is the ranks of one node. Gradient accumulation, clipping (the gradients
    are identical on every replica) and FSDP2's ``MixedPrecisionPolicy`` work as under
    ``ModelParallelStrategy``; checkpoints must be distributed (each rank saves its error memory in
    the checkpoint folder's ``lightning_gc/``).

    Keyword-only args:
        compressor, ratio, compressor_args, collective, error_feedback, seed, min_compress_numel: as
            in :class:`~lightning_gc.GCStrategy`; the collective must run on the replica group
            (:data:`lightning_gc.sync.hsdp.REPLICA_COLLECTIVES`). A module whose shard has fewer than
            ``min_compress_numel`` elements is sent dense.
        replicate_size: the number of replicas (nodes); ``"auto"``: the Trainer's ``num_nodes``. Set
            it to emulate nodes on one machine (e.g. 2 on 4 processes: two "nodes" of two).
        save_distributed_checkpoint, process_group_backend, timeout: as in ``ModelParallelStrategy``.
        **options: other lightning_gc options are refused with the reason (OSP, DiLoCo, ``auto``,
            plans and topologies drive GCStrategy's DDP engine).
    """

    strategy_name = "gc_fsdp"

    def __init__(
        self,
        *,
        compressor: str = "topk",
        ratio: float | None = None,
        compressor_args: dict[str, Any] | None = None,
        collective: str = "auto",
        error_feedback: bool | None = None,
        seed: int = 0,
        min_compress_numel: int = 1024,
        replicate_size: int | Literal["auto"] = "auto",
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        **options: Any,
    ) -> None:
        unknown = [n for n in options if not is_flat_name(n)]
        if unknown:
            raise TypeError(f"GCModelParallelStrategy got an unexpected argument {unknown[0]!r}: it takes "
                            "ModelParallelStrategy's checkpoint/backend arguments and lightning_gc's compression "
                            "options (docs/fsdp.md).")
        given = {"compressor": compressor, **options}
        why = refusal(given, None)
        if why:
            raise ValueError(why)
        self.compression = CompressionConfig(compressor=compressor, ratio=ratio, compressor_args=compressor_args or {},
                                             collective=collective, error_feedback=error_feedback)
        resolved_collective, self.error_feedback = self.compression.resolved()
        why = refusal(given, resolved_collective)
        if why:
            raise ValueError(why)
        EngineConfig(seed=seed, min_compress_numel=min_compress_numel)  # validates both with GCStrategy's rules
        if replicate_size != "auto":
            check_int("replicate_size", replicate_size, 1, "Use the number of nodes, or 'auto' for num_nodes.")
        if not save_distributed_checkpoint and self.error_feedback:
            raise ValueError(f"save_distributed_checkpoint=False with compressor={compressor!r} and error feedback: the "
                             "error memory differs on every rank, so a checkpoint assembled on rank 0 cannot hold it. "
                             "Keep save_distributed_checkpoint=True (the default), or pass error_feedback=False.")
        super().__init__(data_parallel_size="auto", tensor_parallel_size=1,
                         save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timeout)
        self.seed, self.min_compress_numel, self.collective = seed, min_compress_numel, resolved_collective
        self._replicate_size = replicate_size
        self.replica: ReplicaExchange | None = None

    # ------------------------------------------------------------------ the mesh
    def replicas(self) -> int:
        """The number of replicas (resolved ``replicate_size``)."""
        return self.num_nodes if self._replicate_size == "auto" else int(self._replicate_size)

    @override
    def setup_environment(self) -> None:
        world = self.num_nodes * self.num_processes
        replicas = self.replicas()
        if world % replicas:
            raise ValueError(f"replicate_size={replicas} does not divide the {world} ranks: every replica (node) holds "
                             "the same number of shards. Use a divisor of the world size.")
        self._data_parallel_size = world  # Lightning's own 2-D mesh, replaced below
        super().setup_environment()
        from torch.distributed.device_mesh import init_device_mesh

        self._device_mesh = init_device_mesh(self.root_device.type, (replicas, world // replicas, 1),
                                             mesh_dim_names=("replicate", "data_parallel", "tensor_parallel"))
        self.lightning_module._device_mesh = self._device_mesh

    def fully_shard_kwargs(self) -> dict[str, Any]:
        """What ``configure_model`` passes to ``fully_shard``: the mesh of one node's ranks. Writing
        ``fully_shard(block, **self.trainer.strategy.fully_shard_kwargs())`` lets a model shard under
        this strategy and under others that define it (the bench's native-HSDP baselines)."""
        return {"mesh": self.device_mesh["data_parallel"]}

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}  # every rank reads its own batches

    # ------------------------------------------------------------------ the hooks
    @override
    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        mesh = self.device_mesh
        spec = MethodSpec(self.compression.compressor, self.compression.ratio, dict(self.compression.compressor_args),
                          self.collective, self.error_feedback)
        group = mesh["replicate"].get_group()
        self.replica = ReplicaExchange(build_slot(spec, group, NetworkState(), False), group,
                                       replica=mesh["replicate"].get_local_rank(), replicas=mesh["replicate"].size(),
                                       shard=mesh["data_parallel"].get_local_rank(), seed=self.seed,
                                       min_compress_numel=self.min_compress_numel)
        attach(self.model, self.replica)
        self._check_layouts_agree()

    def _check_layouts_agree(self) -> None:
        """Every replica of a shard must send the same groups in the same order: compare the layouts
        across the replica group once, and stop every rank with the difference (never a hang)."""
        mine = self.replica.signature()["layouts"]
        theirs: list[Any] = [None] * self.replica.replicas
        dist.all_gather_object(theirs, mine, group=self.replica.group)
        if any(t != mine for t in theirs):
            diff = next(t for t in theirs if t != mine)
            raise RuntimeError(f"lightning_gc: the replicas sharded the model differently (here {mine}, elsewhere {diff}); "
                               "configure_model must call fully_shard identically on every node.")

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Gradient accumulation: FSDP2 keeps the unsharded gradients until the last micro-batch, so
        the replica exchange runs once per optimizer step."""
        from torch.distributed.fsdp import FSDPModule

        modules = [m for m in self.model.modules() if isinstance(m, FSDPModule)]
        for m in modules:
            m.set_requires_gradient_sync(False, recurse=False)
        try:
            yield None
        finally:
            for m in modules:
                m.set_requires_gradient_sync(True, recurse=False)

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.replica is not None:
            self.replica.after_step()
        return out

    # ------------------------------------------------------------------ checkpoints
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        super().save_checkpoint(checkpoint, filepath, storage_options)
        if self.replica is not None and self._save_distributed_checkpoint:
            folder = Path(self.broadcast(filepath)) / MEMORY_DIR
            folder.mkdir(parents=True, exist_ok=True)
            torch.save(self.replica.state_dict(), folder / f"rank{self.global_rank:05d}.pt")
            self.barrier()

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        out = super().load_checkpoint(checkpoint_path, weights_only)
        if self.replica is not None:
            path = Path(self.broadcast(checkpoint_path)) / MEMORY_DIR / f"rank{self.global_rank:05d}.pt"
            if not path.is_file():
                raise FileNotFoundError(f"lightning_gc: {path} is missing: this checkpoint holds no error memory for this "
                                        "rank (saved by another strategy, or on fewer ranks). Resume on the layout it "
                                        "was saved on, or start a new run from its weights.")
            self.replica.load_state_dict(torch.load(path, weights_only=False))
        return out

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """``gc_fsdp_<compressor>`` for the compressors whose natural collective runs between replicas."""
        from .compressors import available_compressors, get_entry

        for name in available_compressors():
            try:
                collective, _ = CompressionConfig(compressor=name).resolved()
            except ValueError:
                continue
            alias = f"gc_fsdp_{name}"
            if refusal({"compressor": name}, collective) is None and alias not in strategy_registry:
                strategy_registry.register(alias, cls, description=f"lightning_gc FSDP2: {get_entry(name).summary}",
                                           compressor=name)


def register_model_parallel_aliases() -> None:
    """Register ``gc_fsdp_<compressor>`` in Lightning's strategy registry (``Trainer(strategy=
    "gc_fsdp_topk")``; replicas: the Trainer's ``num_nodes``)."""
    from lightning.pytorch.strategies import StrategyRegistry

    GCModelParallelStrategy.register_strategies(StrategyRegistry)
