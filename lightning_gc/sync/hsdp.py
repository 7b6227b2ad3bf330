"""HSDP with lightning_gc's exchange between replicas: FSDP2 shards inside a node, we send between nodes.

Native HSDP (``fully_shard(..., mesh=<2-D (replicate, shard) mesh>)``) reduce-scatters each layer's
gradient inside a replica group and then all-reduces the shard across replicas, dense. Here FSDP2
is given only the shard mesh (the ranks of one node), so it reduce-scatters inside the node and
hands each FSDP module's shard of the node mean to ``FSDPModule.set_all_reduce_hook``; the hook
runs the configured compressor and collective on that shard across the replicas (the ranks that
hold the same shard on the other nodes) and writes the mean back in place. This is the exchange of
``topology="nodes"`` (lightning_gc/comm/hierarchy.py) with FSDP2's reduce-scatter as its first
stage and no allgather at the end: the parameters stay sharded.

* **One group per FSDP module.** The hook receives the module's flat reduce output: each parameter's
  shard, dim 0 padded to equal rows on every shard rank (FSDP2's layout). :class:`ShardLayout`
  describes it; compressors see the real shard shapes (``lowrank`` factorises each shard's rows).
* **Error memory is sharded like the parameters**: each rank keeps ``p − sent`` for its own shard,
  one tensor per module, and nothing for the padding rows (their mean is never applied; zeroing
  them keeps a checkpoint of the real rows exact). It is staged in the hook and committed after the
  optimizer step (discarded on a non-finite step, so a NaN never enters it).
* **Dense** (``compressor="dense"``) is one sum-allreduce of the shard over the replicas divided by
  their number, in FSDP2's reduce dtype: native HSDP's arithmetic, bit for bit.

Random streams (QSGD's rounding, PowerSGD's start) are seeded per (seed, shard index), so the
replicas of a shard draw alike where they must and different shards draw independently.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .._finite import all_finite
from ..comm.exchange import ExchangeTimes, Timer, error_feedback_residual
from ..comm.hierarchy import NODE_COLLECTIVES, subgroup_refusal
from ..compressors.base import GroupContext
from ..engine.memory import ErrorMemory
from ..engine.slots import MethodSlot

#: the collectives that run on the replica group of one shard (the ones ``topology="nodes"`` runs,
#: and ``lowrank``: here the shards are whole rows of each matrix, so its factorisation applies)
REPLICA_COLLECTIVES = (*NODE_COLLECTIVES, "lowrank")
#: the only flat lightning_gc options that apply to the replica exchange (the others are refused)
REPLICA_OPTIONS = ("compressor", "ratio", "compressor_args", "collective", "error_feedback", "seed",
                   "min_compress_numel")
_OPTION_REASONS = {
    "sync": "FSDP2 shards the parameters, and lightning_gc's OSP and DiLoCo act on whole DDP parameters",
    "osp": "FSDP2 shards the parameters, and lightning_gc's OSP acts on whole DDP parameters",
    "diloco": "FSDP2 shards the parameters, and lightning_gc's DiLoCo acts on whole DDP parameters",
    "auto": "auto's cost model and trials drive GCStrategy's DDP engine, not a per-module FSDP2 hook",
    "topology": "the device mesh is the topology here: FSDP2 shards inside a node and lightning_gc sends "
                "between nodes already",
    "plan": "FSDP2's modules are the groups: each fully_shard call is one exchange",
    "omgs": "FSDP2's modules are the groups: each fully_shard call is one exchange",
}


def refusal(flat: dict[str, Any], collective: str | None) -> str | None:
    """Why :class:`~lightning_gc.model_parallel.GCModelParallelStrategy` cannot run these options
    (``flat``: the user's flat lightning_gc names; ``collective``: resolved, or None to check the
    options alone), with the fix; or None.
    Pure: the one list of what FSDP2's replica exchange refuses."""
    if flat.get("compressor") == "auto":
        return ("compressor='auto' is not supported under GCModelParallelStrategy: "
                f"{_OPTION_REASONS['auto']}. Pick the compressor yourself (e.g. 'topk', 'qsgd', 'bf16').")
    for name in flat:
        if name not in REPLICA_OPTIONS:
            key = next((k for k in _OPTION_REASONS if name == k or name.startswith(k + "_")), None)
            why = _OPTION_REASONS[key] if key else "it configures GCStrategy's DDP engine, which FSDP2 replaces"
            return (f"{name}={flat[name]!r} does not apply under GCModelParallelStrategy: {why}. Drop it; the "
                    f"options that apply are {list(REPLICA_OPTIONS)} (docs/fsdp.md).")
    if collective is None:
        return None
    return subgroup_refusal(collective, REPLICA_COLLECTIVES, "GCModelParallelStrategy")


@dataclass(frozen=True)
class ShardLayout:
    """One FSDP module's reduce output on this rank: each parameter's shard, flat, in order.

    Attributes:
        names: the parameters' fully qualified names.
        shapes: each shard's padded shape (dim 0: the padded rows every shard rank holds).
        rows: each shard's real rows (the rest, up to ``shapes[i][0]``, is padding).
    """

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    rows: tuple[int, ...]

    @property
    def segments(self) -> tuple[int, ...]:
        return tuple(math.prod(s) for s in self.shapes)

    @property
    def numel(self) -> int:
        return sum(self.segments)

    def padding(self) -> list[tuple[int, int]]:
        """The flat ``[start, end)`` ranges of padding rows."""
        out, start = [], 0
        for shape, rows, n in zip(self.shapes, self.rows, self.segments):
            row = n // shape[0] if shape[0] else 0
            if rows < shape[0]:
                out.append((start + rows * row, start + n))
            start += n
        return out

    def describe(self) -> str:
        return ";".join(f"{n}:{'x'.join(map(str, s))}/{r}" for n, s, r in zip(self.names, self.shapes, self.rows))


@dataclass
class ReplicaStats:
    """One step's replica exchanges on this rank (all FSDP modules): what crossed between nodes."""

    bytes_inter_node: int = 0
    bytes_payload: int = 0
    comm_s: float = 0.0
    compress_s: float = 0.0
    groups: int = 0


@dataclass
class ReplicaExchange:
    """The hooks of one model's FSDP modules: the method, the error memory, the step's statistics.

    Build it once per model on every rank, :meth:`hook` each module, and call :meth:`after_step`
    after every optimizer step."""

    slot: MethodSlot
    group: Any  # this rank's replica process group (the ranks holding the same shard)
    replica: int
    replicas: int
    shard: int
    seed: int = 0
    min_compress_numel: int = 0
    layouts: dict[int, ShardLayout] = field(default_factory=dict)
    step: int = 0
    last: ReplicaStats | None = None

    def __post_init__(self) -> None:
        self._memory = ErrorMemory()
        self._stats = ReplicaStats()
        self._finite = True
        self._totals = {"steps": 0, "bytes_sent": 0, "bytes_payload": 0, "comm_time_s": 0.0, "compress_time_s": 0.0}

    def hook(self, gid: int, layout: ShardLayout) -> Callable[[Tensor], None]:
        """The all-reduce hook of FSDP module ``gid`` (``set_all_reduce_hook``)."""
        self.layouts[gid] = layout
        return lambda out: self.exchange(gid, out)

    def exchange(self, gid: int, out: Tensor) -> None:
        """Replace ``out`` (this rank's shard of its node's mean) by the mean over the replicas."""
        layout = self.layouts[gid]
        if out.numel() != layout.numel:
            raise RuntimeError(
                f"lightning_gc: FSDP module {gid} ({layout.names[0]}, ...) reduced {out.numel()} elements, its "
                f"parameters' shards hold {layout.numel}: some of its parameters got no gradient this step. The "
                "replica exchange needs every parameter of a sharded module to get one (as DDP without "
                "find_unused_parameters): freeze unused parameters (requires_grad=False) or shard them apart.")
        if self.replicas == 1:
            return
        self._stats.groups += 1
        if not self.slot.compressor.lossy or layout.numel < self.min_compress_numel:
            self._dense(out)
        else:
            self._lossy(gid, layout, out)

    def _dense(self, out: Tensor) -> None:
        """Native HSDP's replica allreduce: sum, then divide by the replicas, in the reduce dtype."""
        timer = Timer(out.device, ExchangeTimes())
        timer.run("comm", lambda: dist.all_reduce(out, group=self.group))
        out.div_(self.replicas)
        self._add(timer, 2 * (self.replicas - 1) * out.numel() * out.element_size() // self.replicas, 0)
        self._finite = self._finite and all_finite(out)

    def _lossy(self, gid: int, layout: ShardLayout, out: Tensor) -> None:
        times = ExchangeTimes()
        timer = Timer(out.device, times)
        ctx = GroupContext(step=self.step, rank=self.replica, world_size=self.replicas, segments=layout.segments,
                           group_id=gid, seed=self.seed * 1_000_003 + self.shard, device=out.device,
                           shapes=layout.shapes, names=layout.names)
        p = out.detach().reshape(-1).to(torch.float32, copy=True)
        mem = self._memory.get(gid)
        if self.slot.error_feedback and mem is not None:
            p.add_(mem.to(p.device))
        mean, sent = self.slot.exchange.run(p, ctx, timer)
        timer.resolve()
        if self.slot.error_feedback:
            residual = error_feedback_residual(p, sent, in_place=True)
            for a, b in layout.padding():
                residual[a:b] = 0
            self._memory.stage(gid, residual)
        out.copy_(mean.view(out.shape))
        self._add(timer, times.bytes_sent, times.bytes_payload)
        self._finite = self._finite and all_finite(mean)

    def _add(self, timer: Timer, sent: int, payload: int) -> None:
        s = self._stats
        s.bytes_inter_node += sent
        s.bytes_payload += payload
        s.comm_s += timer.times.comm_s
        s.compress_s += timer.times.compress_s

    def after_step(self) -> bool:
        """Close the step (after the optimizer step): commit the staged memory if every mean was
        finite, else discard it. Returns whether the step was finite."""
        finite = self._finite
        if finite:
            self._memory.commit()
        else:
            self._memory.discard()
        s, t = self._stats, self._totals
        t["steps"] += 1
        t["bytes_sent"] += s.bytes_inter_node
        t["bytes_payload"] += s.bytes_payload
        t["comm_time_s"] += s.comm_s
        t["compress_time_s"] += s.compress_s
        self.last, self._stats, self._finite = s, ReplicaStats(), True
        self.step += 1
        return finite

    def totals(self) -> dict[str, float]:
        """Since the start: optimizer steps, bytes this rank sent between replicas (all of it crosses
        between nodes), payload bytes, seconds in collectives and in the codec."""
        return dict(self._totals)

    def memory(self, gid: int) -> Tensor | None:
        """Committed error memory of module ``gid`` (flat, its shard's layout), or None."""
        return self._memory.get(gid)

    # ------------------------------------------------------------------ checkpoints
    def signature(self) -> dict[str, Any]:
        """What a checkpoint's memory is valid for: the mesh position and every module's layout."""
        return {"replica": self.replica, "replicas": self.replicas, "shard": self.shard,
                "method": self.slot.describe(), "layouts": {g: lay.describe() for g, lay in self.layouts.items()}}

    def state_dict(self) -> dict[str, Any]:
        """This rank's memory (per module), the exchange's own state and the step: a rank's file."""
        return {"signature": self.signature(), "step": self.step,
                "memory": {g: m.detach().cpu().clone() for g, m in self._memory.groups.items()},
                "exchange": self.slot.exchange.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; refuses a file written at another mesh position or layout."""
        saved, now = state.get("signature"), self.signature()
        if saved != now:
            raise ValueError(
                f"lightning_gc: this checkpoint's error memory was saved for {saved}, this rank is {now}. It is "
                "per replica and per shard: resume on the same mesh, method and fully_shard layout, or load the "
                "weights alone (a new run without the memory).")
        self._memory.clear()
        for gid, mem in state["memory"].items():
            self._memory.stage(int(gid), mem)  # moved to the gradients' device at its first use
        self._memory.commit()
        self.slot.exchange.load_state_dict(state.get("exchange", {}), self.replicas)
        self.step = int(state["step"])


def layout_of(module: Any) -> ShardLayout | None:
    """The reduce-output layout of FSDP module ``module`` (None if it holds no parameters: FSDP2
    never calls its hook). Refuses parameters sharded on another dim than 0."""
    group = module._get_fsdp_state()._fsdp_param_group
    if group is None or not group.fsdp_params:
        return None
    names, shapes, rows = [], [], []
    for fp in group.fsdp_params:
        if fp.fsdp_placement.dim != 0:
            raise ValueError(f"lightning_gc: parameter {fp._param_fqn} is sharded on dim {fp.fsdp_placement.dim}; the "
                             "replica exchange lays shards out by dim 0 (FSDP2's default). Drop shard_placement_fn.")
        names.append(fp._param_fqn or f"param{len(names)}")
        shapes.append(tuple(fp.padded_sharded_param_size))
        rows.append(int(fp.sharded_size[0]) if len(fp.sharded_size) else 1)
    return ShardLayout(tuple(names), tuple(shapes), tuple(rows))


def attach(model: torch.nn.Module, exchange: ReplicaExchange) -> list[ShardLayout]:
    """Hook every FSDP module of ``model`` that holds parameters; returns their layouts in order.
    Refuses a model with no FSDP module, a module on a mesh with a replicate dimension (FSDP2 would
    all-reduce across replicas itself), and trainable parameters no FSDP module manages (nothing would
    average their gradients)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_common import DDPMeshInfo

    layouts: list[ShardLayout] = []
    managed: set[int] = set()
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        layout = layout_of(module)
        if layout is None:
            continue
        group = module._get_fsdp_state()._fsdp_param_group
        if isinstance(group.mesh_info, DDPMeshInfo):
            raise ValueError("lightning_gc: a module was sharded on a mesh with a replicate dimension (native HSDP), "
                             "so FSDP2 would all-reduce across replicas itself. In configure_model, shard on "
                             "self.device_mesh['data_parallel'] (the ranks of one node); lightning_gc sends between them.")
        managed.update(id(fp.sharded_param) for fp in group.fsdp_params)
        module.set_all_reduce_hook(exchange.hook(len(layouts), layout))
        layouts.append(layout)
    if not layouts:
        raise ValueError("lightning_gc: the model has no module sharded with FSDP2. In configure_model, call "
                         "fully_shard(layer, mesh=self.device_mesh['data_parallel']) on each block and on the model.")
    loose = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in managed]
    if loose:
        raise ValueError(f"lightning_gc: parameters {loose[:3]}{' ...' if len(loose) > 3 else ''} are not managed by an "
                         "FSDP module, so nothing would average their gradients across ranks. Call fully_shard on "
                         "the model (the root) too, after its blocks.")
    return layouts
