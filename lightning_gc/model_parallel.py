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

from collections.abc import Callable, Generator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import ModelParallelStrategy as FabricModelParallelStrategy
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from ._names import closest
from ._validation import check_int
from .comm.network import NetworkState
from .config import FLAT_FIELDS, CompressionConfig, is_flat_name
from .engine.config import EngineConfig
from .engine.slots import MethodSpec, build_slot
from .sync.hsdp import ReplicaExchange, attach, refusal

#: the folder, inside a distributed checkpoint, that holds each rank's error memory
MEMORY_DIR = "lightning_gc"


#: the FSDP2 front doors' own arguments beside the flat compression names (for the did-you-mean)
_OWN_ARGUMENTS = ("replicate_size", "save_distributed_checkpoint", "process_group_backend", "timeout")


@dataclass(frozen=True)
class ReplicaOptions:
    """The compression options of both FSDP2 front doors (Trainer and Fabric), validated once: what is
    sent between replicas, and how the ranks are laid out. Refusals name the value, reason and fix."""

    compression: CompressionConfig
    collective: str  # resolved
    error_feedback: bool  # resolved
    seed: int = 0
    min_compress_numel: int = 1024
    replicate_size: int | Literal["auto"] = "auto"

    @classmethod
    def build(cls, who: str, compressor: str, ratio: float | None, compressor_args: dict[str, Any] | None,
              collective: str, error_feedback: bool | None, seed: int, min_compress_numel: int,
              replicate_size: int | Literal["auto"], save_distributed_checkpoint: bool,
              options: dict[str, Any]) -> ReplicaOptions:
        unknown = [n for n in options if not is_flat_name(n)]
        if unknown:
            near = closest(unknown[0], [*FLAT_FIELDS, *_OWN_ARGUMENTS])
            hint = f" Did you mean {near}=?" if near else ""
            raise ValueError(f"{who} got an unexpected argument {unknown[0]!r}: it takes Lightning's model-parallel "
                             f"checkpoint/backend arguments and lightning_gc's compression options (docs/fsdp.md).{hint}")
        given = {"compressor": compressor, **options}
        why = refusal(given, None)
        if why:
            raise ValueError(why)
        compression = CompressionConfig(compressor=compressor, ratio=ratio, compressor_args=compressor_args or {},
                                        collective=collective, error_feedback=error_feedback)
        resolved, ef = compression.resolved()
        why = refusal(given, resolved)
        if why:
            raise ValueError(why)
        EngineConfig(seed=seed, min_compress_numel=min_compress_numel)  # validates both with GCStrategy's rules
        if replicate_size != "auto":
            check_int("replicate_size", replicate_size, 1, "Use the number of nodes, or 'auto' for num_nodes.")
        if not save_distributed_checkpoint and ef:
            raise ValueError(f"save_distributed_checkpoint=False with compressor={compressor!r} and error feedback: the "
                             "error memory differs on every rank, so a checkpoint assembled on rank 0 cannot hold it. "
                             "Keep save_distributed_checkpoint=True (the default), or pass error_feedback=False.")
        return cls(compression, resolved, ef, seed, min_compress_numel, replicate_size)

    def replicas(self, num_nodes: int) -> int:
        """The number of replicas (``replicate_size`` resolved against the launcher's nodes)."""
        return num_nodes if self.replicate_size == "auto" else int(self.replicate_size)

    def mesh(self, device_type: str, world: int, num_nodes: int) -> Any:
        """The ``("replicate", "data_parallel", "tensor_parallel")`` mesh (a collective call)."""
        from torch.distributed.device_mesh import init_device_mesh

        replicas = self.replicas(num_nodes)
        if world % replicas:
            raise ValueError(f"replicate_size={replicas} does not divide the {world} ranks: every replica (node) holds "
                             "the same number of shards. Use a divisor of the world size.")
        return init_device_mesh(device_type, (replicas, world // replicas, 1),
                                mesh_dim_names=("replicate", "data_parallel", "tensor_parallel"))

    def attach(self, model: torch.nn.Module, mesh: Any) -> ReplicaExchange:
        """Hook every FSDP module of ``model`` (sharded on ``mesh["data_parallel"]``) and check that
        every replica of a shard sends the same groups: on a difference every rank stops with it."""
        c = self.compression
        spec = MethodSpec(c.compressor, c.ratio, dict(c.compressor_args), self.collective, self.error_feedback)
        group = mesh["replicate"].get_group()
        replica = ReplicaExchange(build_slot(spec, group, NetworkState(), False), group,
                                  replica=mesh["replicate"].get_local_rank(), replicas=mesh["replicate"].size(),
                                  shard=mesh["data_parallel"].get_local_rank(), seed=self.seed,
                                  min_compress_numel=self.min_compress_numel)
        attach(model, replica)
        mine = replica.signature()["layouts"]
        theirs: list[Any] = [None] * replica.replicas
        dist.all_gather_object(theirs, mine, group=group)
        if any(t != mine for t in theirs):
            diff = next(t for t in theirs if t != mine)
            raise RuntimeError(f"lightning_gc: the replicas sharded the model differently (here {mine}, elsewhere "
                               f"{diff}); shard it identically on every node.")
        return replica


def save_memory(replica: ReplicaExchange, folder: Path, rank: int) -> None:
    """This rank's error memory and exchange state, in ``folder/lightning_gc/`` (a distributed
    checkpoint's folder)."""
    (folder / MEMORY_DIR).mkdir(parents=True, exist_ok=True)
    torch.save(replica.state_dict(), folder / MEMORY_DIR / f"rank{rank:05d}.pt")


def load_memory(replica: ReplicaExchange, folder: Path, rank: int) -> None:
    path = folder / MEMORY_DIR / f"rank{rank:05d}.pt"
    if not path.is_file():
        raise FileNotFoundError(f"lightning_gc: {path} is missing: this checkpoint holds no error memory for this rank "
                                "(saved by another strategy, or on fewer ranks). Resume on the layout it was saved on, "
                                "or start a new run from its weights.")
    replica.load_state_dict(torch.load(path, weights_only=False))


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
        self.options = ReplicaOptions.build(type(self).__name__, compressor, ratio, compressor_args, collective,
                                            error_feedback, seed, min_compress_numel, replicate_size,
                                            save_distributed_checkpoint, options)
        super().__init__(data_parallel_size="auto", tensor_parallel_size=1,
                         save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timeout)
        self.replica: ReplicaExchange | None = None

    @property
    def compression(self) -> CompressionConfig:
        return self.options.compression

    # ------------------------------------------------------------------ the mesh
    @override
    def setup_environment(self) -> None:
        self._data_parallel_size = self.num_nodes * self.num_processes  # Lightning's own 2-D mesh, replaced below
        super().setup_environment()
        self._device_mesh = self.options.mesh(self.root_device.type, self.world_size, self.num_nodes)
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
        self.replica = self.options.attach(self.model, self.device_mesh)

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
            if not self.replica.after_step():
                rank_zero_warn("lightning_gc: a replica exchange produced a non-finite mean; this step's error "
                               "memory was discarded (the optimizer still stepped, as under native HSDP).")
            self._log_step()
        return out

    def _log_step(self) -> None:
        """``gc/bytes_inter_node`` (bytes this rank sent between replicas), ``gc/comm_s`` and
        ``gc/codec_s`` to the Trainer's loggers, every ``log_every_n_steps`` (rank 0's figures)."""
        trainer = self.lightning_module.trainer
        last = self.replica.last
        if self.global_rank != 0 or not trainer.loggers or last is None:
            return
        if (trainer.global_step + 1) % max(1, trainer.log_every_n_steps):
            return
        metrics = {"gc/bytes_inter_node": float(last.bytes_inter_node), "gc/comm_s": last.comm_s,
                   "gc/codec_s": last.compress_s}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    # ------------------------------------------------------------------ checkpoints
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        super().save_checkpoint(checkpoint, filepath, storage_options)
        if self.replica is not None and self._save_distributed_checkpoint:
            save_memory(self.replica, Path(self.broadcast(filepath)), self.global_rank)
            self.barrier()

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        out = super().load_checkpoint(checkpoint_path, weights_only)
        if self.replica is not None:
            load_memory(self.replica, Path(self.broadcast(checkpoint_path)), self.global_rank)
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


class GCFabricModelParallelStrategy(FabricModelParallelStrategy):
    """Lightning Fabric's :class:`~lightning.fabric.strategies.ModelParallelStrategy` with the replica
    exchange of :class:`GCModelParallelStrategy`: ``parallelize_fn(module, device_mesh)`` shards on
    ``device_mesh["data_parallel"]`` (one node's ranks), the nodes are the replicas. Gradient
    accumulation is Fabric's ``no_backward_sync``; ``fabric.save``/``fabric.load`` keep each rank's
    error memory in the checkpoint folder (distributed checkpoints).

    Args:
        parallelize_fn: as in Fabric's ``ModelParallelStrategy``.
        compressor, ratio, compressor_args, collective, error_feedback, seed, min_compress_numel,
        replicate_size, save_distributed_checkpoint, process_group_backend, timeout, **options: as in
            :class:`GCModelParallelStrategy`.
    """

    def __init__(self, parallelize_fn: Callable[[Any, Any], Any], *, compressor: str = "topk",
                 ratio: float | None = None, compressor_args: dict[str, Any] | None = None, collective: str = "auto",
                 error_feedback: bool | None = None, seed: int = 0, min_compress_numel: int = 1024,
                 replicate_size: int | Literal["auto"] = "auto", save_distributed_checkpoint: bool = True,
                 process_group_backend: str | None = None, timeout: timedelta | None = default_pg_timeout,
                 **options: Any) -> None:
        self.options = ReplicaOptions.build(type(self).__name__, compressor, ratio, compressor_args, collective,
                                            error_feedback, seed, min_compress_numel, replicate_size,
                                            save_distributed_checkpoint, options)
        super().__init__(parallelize_fn, data_parallel_size="auto", tensor_parallel_size=1,
                         save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timeout)
        self.replica: ReplicaExchange | None = None

    @override
    def setup_environment(self) -> None:
        self._data_parallel_size = self.num_nodes * self.num_processes  # Lightning's own 2-D mesh, replaced below
        super().setup_environment()
        self._device_mesh = self.options.mesh(self.root_device.type, self.world_size, self.num_nodes)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @override
    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        if self.replica is not None:
            raise RuntimeError("GCFabricModelParallelStrategy sets up one model; make one Fabric per model.")
        module = super().setup_module(module)
        self.replica = self.options.attach(module, self.device_mesh)
        return module

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        out = super().optimizer_step(optimizer, **kwargs)
        if self.replica is not None:
            self.replica.after_step()
        return out

    @override
    def save_checkpoint(self, path: Any, state: dict[str, Any], storage_options: Any | None = None,
                        filter: dict[str, Callable[[str, Any], bool]] | None = None) -> None:
        super().save_checkpoint(path, state, storage_options, filter)
        if self.replica is not None and self._save_distributed_checkpoint:
            save_memory(self.replica, Path(self.broadcast(path)), self.global_rank)
            self.barrier()

    @override
    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True,
                        weights_only: bool | None = None) -> dict[str, Any]:
        out = super().load_checkpoint(path, state, strict, weights_only)
        if self.replica is not None:
            load_memory(self.replica, Path(self.broadcast(path)), self.global_rank)
        return out
