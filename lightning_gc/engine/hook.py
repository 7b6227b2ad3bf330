"""The engine: the step lifecycle that runs inside DDP's communication hook.

Per step, DDP hands the hook its gradient buckets one at a time, in bucket order, identically on
every rank. The hook itself does almost nothing: it records which parameters have arrived
(:mod:`.readiness`), and *submits* jobs to the engine's runner — the ordered worker thread
(``overlap=True``, the default) or the hook's own thread (``overlap=False``, the synchronous
oracle) — then returns a Future for the bucket. In submission order, identical on every rank:

1. **open**: the opening check when it is due (:mod:`.agreement`: every rank is about to do the
   same thing), and on compressed steps a network probe if the tracker's policy asks for one;
2. **one job per plan group**, submitted as soon as the group is complete:
   ``p = g + e`` (error feedback), ``mean, sent = exchange(p)``, ``e' = p − sent`` staged, ``mean``
   written back into the gradients' slots of their buckets;
   on dense steps (warm-up, lossless compressor) one job per bucket instead: DDP's own
   ``allreduce(bucket / N)``, asynchronous, completing the bucket's Future from its callback.
   Where each runs is the engine's *topology* (:mod:`lightning_gc.comm.hierarchy`): flat, on all
   ranks; or by nodes, on this rank's shard of its node's mean (error memory per shard);
3. **close**: the closing report (non-finite agreement, gain sums, exchange time) — an allreduce
   of its own, or, where the step's last job is an exchange that carries it (``lowrank``,
   ``EngineConfig.report_rides``), the sums that rode in that exchange's last message — then error
   memory is committed (or discarded on a non-finite step), statistics are finalised and the
   bucket Futures complete.

So the hook returns without waiting for the network: while group *i* is being compressed and
sent, backward keeps computing the gradients of the groups after it. DDP waits for the bucket
Futures at the end of backward, by which time statistics are final.

Every decision that changes communication — dense vs compressed step, plan, k, randomness,
collective — is a function of replicated values (the step counter, the plan built from identical
parameter lists, the agreed network model). Every compressed step's closing report verifies it
(a hash of the step's descriptor travels in it), and the opening check verifies it before the
exchanges on a replicated schedule (:mod:`.agreement`, ``EngineConfig.check_every``).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .._finite import all_finite
from ..comm.collectives import ring_allreduce_bytes, unflatten_into
from ..comm.cost_model import NetworkModel
from ..comm.exchange import (
    AllreduceExchange,
    Exchange,
    ExchangeTimes,
    SparseSent,
    Timer,
    error_feedback_residual,
    sent_sq_norm,
    sq_norm,
)
from ..comm.hierarchy import Topology, TopologyConfig, build_topology, destroy_groups
from ..comm.worker import InlineRunner, OrderedWorker
from ..compressors.base import Compressor, GroupContext
from ..compressors.dense import DenseCompressor
from ..compressors.workspace import empty_output
from ..exchanges.registry import make_exchange
from ..plans import Plan, build_plan
from . import checkpoint
from .agreement import RIDER_MAX_RANKS, RiddenReport, StepReport, agree, check_descriptor, descriptor_hash
from .config import EngineConfig
from .dense_stop import StopVerdict, defer_bucket
from .memory import ErrorMemory
from .network import NetworkTracker
from .readiness import Readiness, new_future
from .slots import MethodSlot, MethodSpec, build_slot
from .stats import OwnClock, StepStats, Totals, step_overhead


@dataclass
class _StepWork:
    """One step's shared state between the hook thread, the runner and backend callbacks."""

    step: int
    dense: bool
    stats: StepStats
    times: ExchangeTimes
    timer: Timer
    futures: list[tuple[torch.futures.Future, Tensor]] = field(default_factory=list)
    written: list[list[Tensor]] = field(default_factory=list)  # lossy groups' views, for NaN on a bad step
    flushed: list[tuple[str, ...]] = field(default_factory=list)  # groups whose memory this step sent out
    report: StepReport = field(default_factory=StepReport)
    descriptor: str = ""  # what this rank does this step (the opening check's and closing report's hash)
    control_comm_s: float = 0.0  # opening check + closing report
    async_comm_s: float = 0.0  # of times.comm_s, dense buckets' issue-to-callback time (no engine code waited)
    exchange_comm_s: float = 0.0  # inside the compressed groups' exchanges (what the cost model predicts)
    error: BaseException | None = None
    closed: bool = False
    dense_pending: int = 0
    dense_dtype: torch.dtype | None = None  # dense mode "fp16"/"bf16": the buckets travel in 16 bits
    steady: bool = False  # a dense step of a dense-only run past warm-up: no opening check
    inline: bool = False  # the step's jobs run on the hook's thread (steady, and no job before it)
    # GCEngine.run_before_step (engine/dense_stop.py): its verdict, whether this step can stop on it and
    # whether a job has read it; then whether the step stopped, and the compressed groups' deferred gradients
    pre_step: list | None = None  # [StopVerdict] or [the exception the job raised]
    can_stop: bool = False
    pre_step_read: bool = False
    stopped: bool = False
    deferred: dict[int, Tensor] = field(default_factory=dict)
    carried_flush: bool = False  # this dense step added the error memory to its buckets
    # (host gid, exact gid): the exact group travels inside the host group's exchange this step
    # (Exchange.carries_exact); the two are submitted as one job once both are complete
    rider: tuple[int, int] | None = None
    # GCEngine.enable_dense_carry: the value the first sending bucket of this dense step carries (NaN: none)
    dense_carry: float | None = None
    rider_views: dict[int, list[Tensor]] = field(default_factory=dict)
    # the closing report as it rode in the step's last message (set by that exchange's job), else None
    ridden: RiddenReport | None = None
    # a non-finite mean every rank computed alike (an exact group's sum), even after the report left
    replicated_nonfinite: bool = False
    finished: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)


class GCEngine:
    """State and lifecycle of the communication hook.

    Build it after DDP has wrapped the module (parameters must not move afterwards) and register it
    with :func:`gc_comm_hook`. All ranks build it with identical arguments (the constructor compares
    them and names the ranks that differ) and in the same order: it creates a process group of its own.
    The strategy calls :meth:`before_optimizer_step`, :meth:`after_optimizer_step` and :meth:`close`;
    :meth:`set_ratio` and :meth:`replace_plan` run between steps, on every rank.
    """

    def __init__(
        self,
        compressor: Compressor,
        config: EngineConfig,
        named_parameters: list[tuple[str, Tensor]],
        process_group: Any = None,
        verify_plan: bool = True,
        topology: TopologyConfig | None = None,
        ranks_per_node: int | None = None,
        topology_refused: str | None = None,
    ) -> None:
        self.compressor = compressor
        self.config = config
        self.process_group = process_group
        self.names = [n for n, _ in named_parameters]
        self.params = [p for _, p in named_parameters]
        self._shapes = {n: tuple(p.shape) for n, p in named_parameters}
        if not self.params:
            raise ValueError("the model has no trainable parameters; there is nothing to communicate")
        self.distributed = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size(process_group) if self.distributed else 1
        self.rank = dist.get_rank(process_group) if self.distributed else 0
        self.device = self.params[0].device
        self.error_feedback = bool(config.error_feedback) and compressor.lossy
        self.plan: Plan = build_plan(
            self.names, [p.numel() for p in self.params], kind=config.plan, threshold=config.plan_threshold,
            min_compress_numel=config.min_compress_numel, compress=compressor.lossy,
        )
        self._readiness = Readiness(self.plan, self.params)
        self._memory = ErrorMemory()
        # the engine's own process group: the only one its runner issues collectives on
        self.exchange_group = None
        if self.world_size > 1:
            ranks = dist.get_process_group_ranks(process_group) if process_group is not None else None
            self.exchange_group = dist.new_group(ranks=ranks, backend=dist.get_backend(process_group))
        #: where each group's exchange runs: all ranks (flat), or this rank's shard group between nodes
        #: (lightning_gc/comm/hierarchy.py); ``ranks_per_node``: the launcher's processes per node;
        #: ``topology_refused``: why ``nodes`` cannot run this configuration (``topology="auto"`` is flat)
        model_bytes = sum(p.numel() * p.element_size() for p in self.params)
        self.topology: Topology = build_topology(topology or TopologyConfig(), self.exchange_group,
                                                 self.world_size, self.rank, ranks_per_node, device=self.device,
                                                 model_bytes=model_bytes, refused=topology_refused)
        self.exchange: Exchange = make_exchange(compressor, config.collective, self.topology.group)
        self.exact_exchange = AllreduceExchange(DenseCompressor(), self.topology.group)
        self.tracker = NetworkTracker(config, type(self.exchange).needs_network, self.world_size)
        self.exchange.network = self.tracker.state
        #: the method of every lossy group without a slot of its own (the strategy's configuration)
        self.default_slot = MethodSlot(None, compressor, self.exchange, self.error_feedback)
        self._slots: dict[tuple[str, ...], MethodSlot] = {}  # keyed by the group's parameter names
        self._flush: set[tuple[str, ...]] = set()  # groups whose memory goes out once, then clears
        #: None, or "fp32"/"fp16"/"bf16": every step after warm-up is a dense step on DDP's buckets
        #: (in 16 bits for the latter two), as DDP without a hook or with torch's 16-bit hook would run
        self.dense_mode: str | None = None
        self._dense_flush = False  # error memory awaits its flush into the next dense step's buckets
        self._carried_wall: float | None = None  # GCEngine.carry_wall: for the next step's closing report
        self._dense_carry = False  # enable_dense_carry: dense steps carry it in their first bucket
        self._pre_step: list | None = None  # run_before_step's verdict box, for the next step
        self._layout: tuple[Plan, dict[int, tuple[int, int]]] | None = None  # (plan, pid -> (gid, offset))
        self._pid_of = {id(p): i for i, p in enumerate(self.params)}
        self.all_exact = all(g.exact for g in self.plan.groups)
        self._planned = frozenset(self.plan.group_of())  # param ids the plan sends (OSP may defer others)
        self.step = 0
        #: the next step opens with the opening check whatever ``check_every`` says: the first step,
        #: and after a change no collective compared (set from replicated events only)
        self._check_next = True
        #: opening checks run so far (a diagnostic; identical on every rank)
        self.opening_checks = 0
        self.gain_ewma: float | None = None
        self._last_stats: StepStats | None = None
        self._last_nonfinite = False
        self._outside_nonfinite = False  # set by report_nonfinite() for the step being hooked
        #: (step, this rank's time in its compressed exchanges) of the last compressed step closed: the
        #: next step's report carries it where the report rides in that step's last message
        self._last_exchange: tuple[int, float] | None = None
        self._totals = Totals()
        self.hook_calls = 0
        #: optional read-only ``fn(gid, p, ctx)``, called on the runner with each lossy group's ``p = g + e``
        #: before its exchange (the adaptive controller's shadow mode). Set between steps.
        self.group_observer: Callable[[int, Tensor, GroupContext], None] | None = None
        self._work: _StepWork | None = None  # the open step (hook thread)
        self._last_work: _StepWork | None = None
        self._failure: BaseException | None = None
        self._stats_lock = threading.Lock()
        self._own = OwnClock()  # the engine's own wall time per step (StepStats.overhead_s)
        self._dense_bytes_per_step = ring_allreduce_bytes(
            sum(p.numel() * p.element_size() for p in self.params), self.world_size
        )
        self._runner: OrderedWorker | InlineRunner
        if config.overlap and self.world_size > 1:
            self._runner = OrderedWorker(device=self.device)
        else:
            self._runner = InlineRunner()
        if verify_plan and self.world_size > 1:
            self._verify_identical(self.signature())

    # ------------------------------------------------------------------ setup helpers
    def signature(self) -> str:
        """Everything that fixes the sequence and sizes of collectives (identical on all ranks)."""
        return (f"{self.plan.signature()}|{self.compressor.describe()}|{self.exchange.describe()}"
                f"|ef={self.error_feedback}|{self.config}|{self.topology.describe()}{self._slots_signature()}")

    def _slots_signature(self) -> str:
        if not self._slots and not self._flush:
            return ""
        slots = ";".join(f"{','.join(k)}={v.describe()}" for k, v in sorted(self._slots.items()))
        return f"|slots={slots}|flush={sorted(self._flush)}"

    def _verify_identical(self, sig: str) -> None:
        sigs: list[Any] = [None] * self.world_size
        dist.all_gather_object(sigs, sig, group=self.process_group)
        if len(set(sigs)) > 1:
            by_sig: dict[str, list[int]] = {}
            for r, s in enumerate(sigs):
                by_sig.setdefault(s, []).append(r)
            detail = "; ".join(f"ranks {ranks}: {s}" for s, ranks in by_sig.items())
            raise RuntimeError(
                "lightning_gc: ranks built different communication setups and would deadlock. Ranks "
                f"grouped by setup: {list(by_sig.values())} ({detail}). Every rank must construct the "
                "same model (same parameter names, shapes and requires_grad) and the same GCStrategy "
                "arguments (compressor options such as ratio included)."
            )

    # ------------------------------------------------------------------ public API
    @property
    def memory(self) -> dict[int, Tensor]:
        """Committed error memory per plan group id (flat tensors)."""
        return dict(self._memory.groups)

    @property
    def network(self):
        """The network model in force (:class:`~lightning_gc.comm.network.NetworkState`)."""
        return self.tracker.state

    @property
    def link(self):
        """The link observer (:class:`~lightning_gc.comm.link.LinkObserver`): the model in force, when
        to probe again, and the probe; collaborators reach it through :class:`~.ports.LinkPort`."""
        return self.tracker.observer

    @property
    def overlap(self) -> bool:
        return isinstance(self._runner, OrderedWorker)

    @property
    def last_step(self) -> StepStats | None:
        """Statistics of the last finished step (waits for its communication to be final)."""
        self.synchronize()
        return self._last_stats

    @property
    def last_step_nonfinite(self) -> bool:
        """Whether the last finished step's gradient was non-finite on some rank."""
        self.synchronize()
        return self._last_nonfinite

    def reporting_state(self) -> tuple[StepStats | None, bool, int]:
        """What the engine reports but does not checkpoint (last step's statistics, its non-finite
        flag, the hook-call count), for a rollback to save beside :meth:`state_dict`. The statistics
        are a copy both ways: :meth:`add_deferred_traffic` may still change the live object, and a
        saved state must survive several restores unchanged."""
        self.synchronize()
        return copy.deepcopy(self._last_stats), self._last_nonfinite, self.hook_calls

    def restore_reporting_state(self, state: tuple[StepStats | None, bool, int]) -> None:
        self.synchronize()
        stats, self._last_nonfinite, self.hook_calls = state
        self._last_stats = copy.deepcopy(stats)

    def raise_warmup_steps(self, steps: int) -> None:
        """Make the dense warm-up at least ``steps`` optimizer steps (never shortens it). Call with
        the same value on every rank: the warm-up decides, per step, what every rank sends."""
        if steps > self.config.warmup_steps:
            self.config = dataclasses.replace(self.config, warmup_steps=int(steps))

    def carry_wall(self, wall_s: float) -> None:
        """Average ``wall_s`` (this rank's wall time of the step that just ended) over the ranks in the
        *next* step's closing report, into its :attr:`StepStats.carried_wall_mean_s`: a separate 8-byte
        all-reduce would be one more latency-bound collective ahead of the step's exchanges. A dense
        next step has no report and drops it, unless :meth:`enable_dense_carry` was called. Between
        steps, on every rank alike: a rank that carried none makes the mean None everywhere."""
        self._carried_wall = float(wall_s)

    def enable_dense_carry(self) -> None:
        """From now on every dense step sends the value of :meth:`carry_wall` as one more element of its
        first bucket's allreduce (NaN where a rank has none; in the bucket's dtype, so about 3 digits in
        16-bit modes). On every rank alike, before training: the buckets' sizes must match."""
        self._dense_carry = True

    def run_before_step(self, job: Callable[[], StopVerdict]) -> None:
        """Run ``job`` on the ordered worker before the next step's buckets (it overlaps forward and
        backward). Its :class:`StopVerdict` stops a dense mode's step (engine/dense_stop.py) and may
        carry ``carried_wall_mean_s``. A collective, between steps, on every rank alike; it needs the
        direct exchange (a stopped step's exact group goes by it) and a plan sending every parameter."""
        from ..comm.direct import DIRECT_MAX_RANKS, backend_allows
        if not (1 < self.world_size <= DIRECT_MAX_RANKS and backend_allows(self.exchange_group)):
            raise ValueError(f"run_before_step needs a process group of 2 to {DIRECT_MAX_RANKS} ranks on a backend "
                             f"other than NCCL (a stopped step goes by the direct exchange, lightning_gc/comm/direct.py); "
                             f"this one has {self.world_size} ranks.")
        if not self.plan_sends_every_param:
            raise ValueError("run_before_step needs a plan that sends every parameter every step (not OSP).")
        self.synchronize()
        box: list = []  # the verdict, or the exception the job raised (re-raised by the step's first job)
        self._pre_step = box

        def run() -> None:
            try:
                box.append(job())
            except BaseException as e:  # noqa: BLE001 - the step's jobs fail with it (_read_pre_step)
                box.append(e)
        self._runner.submit(run)

    def count_local_step(self) -> None:
        """An optimizer step that sent no gradient (DDP's synchronisation off: DiLoCo's inner step under
        ``compressor="auto"``): the step counter moves on, so everything keyed on it stays the
        optimizer's, and no step's non-finite verdict outlives it. Between steps, on every rank alike."""
        self.synchronize()
        self.step += 1
        self._last_nonfinite = False

    def shorten_warmup_steps(self, steps: int) -> None:
        """Make the dense warm-up ``steps`` optimizer steps if it is longer (never lengthens it). Between
        steps, with the same value on every rank, and with ``steps >= self.step`` (docs/auto.md)."""
        steps = max(int(steps), 0)
        if steps < self.config.warmup_steps:
            self.config = dataclasses.replace(self.config, warmup_steps=steps)

    def error_memory_by_name(self) -> dict[str, Tensor]:
        """Per-parameter copies (CPU) of the error-feedback memory of the current plan."""
        return self._memory.by_name(self.topology.memory_layout(self.plan))

    def load_error_memory(self, by_name: dict[str, Tensor]) -> list[str]:
        """Replace the error memory by per-parameter tensors (as :meth:`error_memory_by_name` gives
        them), laid out for the current plan. Returns the names that were missing (zero)."""
        self.synchronize()
        return self._memory.load_by_name(self.topology.memory_layout(self.plan), by_name,
                                         [p.dtype for p in self.params], self.device)

    def clear_error_memory(self) -> None:
        self.synchronize()
        self._memory.clear()

    def set_totals(self, totals: Totals) -> None:
        """Replace the cumulative counters (checkpoint restore)."""
        with self._stats_lock:
            self._totals = totals

    @property
    def keeps_network_model(self) -> bool:
        """Whether the engine maintains an agreed network model itself (pinned, or probed by its
        tracker for a model-chosen collective); otherwise a collaborator probes its own."""
        return self.tracker.state.pinned or self.tracker.policy is not None

    def set_group_observer(self, observer: Callable[[int, Tensor, GroupContext], None] | None) -> None:
        """Install (or remove, with ``None``) the read-only observer of each lossy group's
        error-fed gradient; between steps only (waits for the step in flight)."""
        self.synchronize()
        self.group_observer = observer

    def totals(self) -> dict:
        """Cumulative per-rank counters since the start of training (snapshot)."""
        self.synchronize()
        return self._totals.as_dict()

    @property
    def plan_sends_every_param(self) -> bool:
        """Whether the plan sends every parameter every step (OSP defers some: not)."""
        return len(self._planned) == len(self.params)

    def step_is_dense(self) -> bool:
        return (self.all_exact or self.world_size == 1 or self.step < self.config.warmup_steps
                or self.dense_mode is not None)

    @property
    def dense_flush_pending(self) -> bool:
        """Whether error memory waits to be added to the next finite dense step (see set_dense_mode)."""
        return self._dense_flush

    def restore_dense_mode(self, mode: str | None, flush_pending: bool) -> None:
        """Checkpoint restore of :attr:`dense_mode` and :attr:`dense_flush_pending` (replicated values
        saved by every rank alike; not compared across ranks again)."""
        if mode not in (None, "fp32", "fp16", "bf16"):
            raise ValueError(f"saved dense mode {mode!r} is invalid: expected None, 'fp32', 'fp16' or 'bf16'.")
        self.dense_mode, self._dense_flush = mode, bool(flush_pending)

    def adopt_network(self, model: NetworkModel) -> None:
        """Use ``model`` (agreed across ranks by the caller) as the network model, and leave re-probing
        to the caller (the engine's own probe's large messages take seconds on a slow link). Between
        steps, on every rank."""
        self.synchronize()
        self.tracker.state.model = model
        self.tracker.policy = None
        self._check_next = True

    def set_error_feedback(self, on: bool) -> None:
        """Turn the default slot's error feedback on or off, on every rank alike (it enters
        :meth:`signature`). Refused while error memory exists and ``on`` is False: that would drop
        what was not sent."""
        if not on and self._memory.groups:
            raise RuntimeError(f"set_error_feedback(False) at step {self.step} with error memory held: turning error "
                               "feedback off would drop what was not sent; pass error_feedback= to GCStrategy instead.")
        self.error_feedback = bool(on) and self.compressor.lossy
        self.default_slot = MethodSlot(None, self.compressor, self.exchange, self.error_feedback)

    def adopt_error_feedback_default(self, optimizers) -> str | None:
        """For ``error_feedback=None``: set the compressor's default knowing the optimizers
        (:meth:`Compressor.error_feedback_default`). Returns a message to log when that changed it.
        Collective when distributed (the ranks' signatures are compared): call it on every rank."""
        ef = self.compressor.error_feedback_default(optimizers)
        if self._memory.groups:  # restored from a run that kept memory (error feedback on): continue as it ran
            ef = self.error_feedback
        changed = ef != self.error_feedback
        if changed:
            self.set_error_feedback(ef)
        if self.world_size > 1:  # every rank, changed or not: a rank that decided otherwise is named here
            self._verify_identical(self.signature())
        if not changed:
            return None
        names = ", ".join(sorted({type(o).__name__ for o in optimizers}))
        return (f"lightning_gc: error_feedback={ef} for compressor={self.compressor.name} with {names} (its default "
                "with these optimizers; pass error_feedback= to choose; docs/compressors.md, 'Error feedback under Adam')")

    def set_dense_mode(self, mode: str | None) -> None:
        """From the next step on, send every step dense on DDP's buckets (``"fp32"``: as DDP without a
        hook; ``"fp16"``/``"bf16"``: as torch's 16-bit hooks), or go back to the plan's compressed
        groups (``None``). Between steps, on every rank alike (compared). Error memory is added once
        to the next finite dense step's gradient, then cleared; leaving before that keeps it."""
        if mode not in (None, "fp32", "fp16", "bf16"):
            raise ValueError(f"dense mode {mode!r} is invalid: use None (compressed steps), 'fp32', 'fp16' or 'bf16'.")
        self.synchronize()
        if self.world_size > 1:
            self._verify_identical(f"set_dense_mode({mode!r})")
        self.dense_mode = mode
        self._dense_flush = mode is not None and bool(self._memory.groups)

    def _flush_views(self, bucket: dist.GradBucket) -> list[tuple[Tensor, Tensor]]:
        """(gradient view in the bucket, its error memory) for the bucket's parameters with memory."""
        where = self._group_offsets()
        mems = self._memory.groups
        out = []
        for p, grad in zip(bucket.parameters(), bucket.gradients()):
            gid, off = where.get(self._pid_of.get(id(p)), (None, 0))
            mem = mems.get(gid)
            if mem is not None:
                out.append((grad, mem[off:off + grad.numel()]))
        return out

    def _group_offsets(self) -> dict[int, tuple[int, int]]:
        """Parameter id -> (its plan group's id, its offset in the group), cached per plan."""
        if self._layout is None or self._layout[0] is not self.plan:
            where: dict[int, tuple[int, int]] = {}
            for g in self.plan.groups:
                off = 0
                for pid, n in zip(g.param_ids, g.numels):
                    where[pid] = (g.gid, off)
                    off += n
            self._layout = (self.plan, where)
        return self._layout[1]

    def error_norm(self) -> float:
        """‖e‖₂ over all groups' error memory (kept up to date per group, no extra pass)."""
        return self._memory.norm()

    def synchronize(self) -> None:
        """Wait until every submitted job has run (the last step's communication is final)."""
        self._runner.drain()
        work = self._last_work
        if work is not None and work.closed:
            work.finished.wait()

    def before_optimizer_step(self) -> bool:
        """Called by the strategy before the optimizer step: returns whether the step's aggregated
        gradient is non-finite on some rank (identical on every rank)."""
        return self.last_step_nonfinite

    def report_nonfinite(self) -> None:
        """A participant found a non-finite local gradient this rank keeps out of the plan (OSP's
        deferred layers). Call it on the hook thread before the step's last bucket reaches the
        engine: the closing agreement then counts this rank as non-finite, so every rank discards
        the step's error memory."""
        self._outside_nonfinite = True

    def after_optimizer_step(self) -> None:
        """Called by the strategy after the optimizer step (a hook point for two-stage schedules)."""

    def add_deferred_traffic(self, bytes_sent: int, bytes_payload: int, bytes_inter_node: int = 0) -> None:
        """Count gradient bytes a two-stage schedule sent on its own process group (OSP's deferred
        allreduce, DiLoCo's exchanges) in the last step's statistics and the totals, so byte counts
        cover the step; ``bytes_inter_node``: of ``bytes_sent``, those sent between nodes."""
        with self._stats_lock:
            self._totals.bytes_sent += bytes_sent
            self._totals.bytes_payload += bytes_payload
            self._totals.bytes_inter_node += bytes_inter_node
            if self._last_stats is not None:
                self._last_stats.bytes_sent += bytes_sent
                self._last_stats.bytes_payload += bytes_payload
                self._last_stats.bytes_inter_node += bytes_inter_node

    def set_ratio(self, ratio: float) -> None:
        """Change the compression ratio from the next step on. Between steps, on every rank with the
        same value: it is compared across ranks, and a rank-dependent value raises on every rank
        instead of deadlocking the next exchange."""
        if not self.compressor.has_ratio:
            raise ValueError(
                f"compressor {self.compressor.name!r} has no ratio option, so set_ratio({ratio!r}) cannot "
                "apply; use a Top-k family compressor or RandomK."
            )
        dataclasses.replace(self.compressor.config, ratio=ratio)  # validates before anything changes
        self.synchronize()
        if self.world_size > 1:
            mine = torch.tensor([float(ratio)], dtype=torch.float64)
            if self.device.type == "cuda":
                mine = mine.to(self.device)
            all_r = [torch.empty_like(mine) for _ in range(self.world_size)]
            dist.all_gather(all_r, mine, group=self.process_group)
            values = [float(t.item()) for t in all_r]
            if len(set(values)) > 1:
                raise RuntimeError(
                    f"lightning_gc: set_ratio was called with different ratios on different ranks "
                    f"(rank → ratio: {dict(enumerate(values))}); every rank must apply the same ratio, "
                    "computed from replicated values (e.g. all-reduced statistics) or broadcast from rank 0."
                )
        self.compressor.set_ratio(ratio)

    def replace_plan(self, plan: Plan, verify: bool = True) -> list[str]:
        """Switch to another plan between steps; error memory is remapped by parameter name.

        ``verify=False`` skips comparing the plan across ranks (for callers that change it every step
        from replicated values; the next opening check compares it). Parameters a plan leaves out are
        neither sent nor changed (OSP defers them). Returns the names whose memory starts at zero.
        """
        self.synchronize()
        if verify and self.world_size > 1:
            self._verify_identical(f"plan {plan.signature()}")
        elif not verify:  # nothing compared it: the next step's opening check does
            self._check_next = True
        dtypes = [p.dtype for p in self.params]
        missing = self._memory.remap(self.plan, plan, dtypes, self.device)
        kept = {g.names for g in plan.groups if not g.exact}
        self._slots = {k: v for k, v in self._slots.items() if k in kept}
        self._flush &= kept
        self.plan = plan
        self._readiness = Readiness(plan, self.params)
        self.all_exact = all(g.exact for g in plan.groups)
        self._planned = frozenset(plan.group_of())
        return missing

    # ------------------------------------------------------------------ per-group method slots
    def slot_of(self, gid: int) -> MethodSlot:
        """The method group ``gid`` of the current plan is sent with."""
        return self._slots.get(self.plan.groups[gid].names, self.default_slot)

    def set_group_method(self, gid: int, spec: MethodSpec | None) -> None:
        """Send group ``gid`` of the current plan with ``spec`` from the next step on (``None``: the
        default method). Between steps, on every rank alike (compared). Error memory follows
        :mod:`lightning_gc.engine.slots`: kept with error feedback, else flushed in the next send."""
        group = self.plan.groups[gid]
        if group.exact:
            raise ValueError(
                f"group {gid} ({list(group.names)[:3]}) is sent exactly (its tensors are below min_compress_numel, "
                "or the compressor is lossless), so it has no method to switch. Pick a compressed group "
                f"(ids {[g.gid for g in self.plan.groups if not g.exact]})."
            )
        self.synchronize()
        slot = build_slot(spec, self.topology.group, self.tracker.state,
                          type(self.exchange).needs_network) if spec is not None else self.default_slot
        if self.world_size > 1:
            described = "default" if spec is None else repr(spec.as_dict())
            self._verify_identical(f"set_group_method(group {gid} = {group.names}, {described})")
        if spec is None:
            self._slots.pop(group.names, None)
        else:
            self._slots[group.names] = slot
        if slot.error_feedback:
            self._flush.discard(group.names)
        elif self._memory.get(gid) is not None:
            self._flush.add(group.names)

    def slot_specs(self) -> list[dict]:
        """The groups' own methods (checkpoint state): names, spec, the slot's exchange state (e.g. the
        low-rank warm start ``Q̄``), and whether memory awaits a flush."""
        return [{"names": list(k), "spec": v.spec.as_dict() if v.spec else None, "exchange": v.exchange.state_dict()}
                for k, v in self._slots.items()] + [{"names": list(k), "flush": True} for k in self._flush]

    def load_slot_specs(self, entries: list[dict]) -> None:
        """Rebuild the slots of :meth:`slot_specs` (groups not in the current plan are skipped)."""
        self._slots, self._flush = {}, set()
        groups = {g.names: g for g in self.plan.groups if not g.exact}
        for e in entries:
            names = tuple(e["names"])
            if names not in groups:
                continue
            if e.get("flush"):
                self._flush.add(names)
            elif e.get("spec") is not None:
                slot = build_slot(MethodSpec(**e["spec"]), self.topology.group, self.tracker.state,
                                  type(self.exchange).needs_network)
                # written before slots carried their exchange's state: a fresh one (as the run had then)
                slot.exchange.load_state_dict(e.get("exchange") or {}, world_size=self.world_size)
                self._slots[names] = slot

    def close(self, timeout: float = 60.0) -> None:
        """Finish queued work, stop the worker and release the exchange process group."""
        stopped = self._runner.close(timeout)
        if stopped:
            self.topology.close()
        group, self.exchange_group = self.exchange_group, None
        if group is not None and stopped and dist.is_available() and dist.is_initialized():
            destroy_groups([group])  # skipped if already gone with the default group

    # ------------------------------------------------------------------ the hook (autograd thread)
    def on_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future:
        with self._own.region():
            return self._on_bucket(bucket)

    def _on_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future:
        self.hook_calls += 1
        if self._failure is not None:
            raise RuntimeError(
                f"lightning_gc: an earlier exchange failed on this rank ({self._failure!r}); training "
                "cannot continue with this engine."
            ) from self._failure
        buffer = bucket.buffer()
        if self._work is None:
            self._open_step()
        work = self._work
        assert work is not None
        fut = new_future(buffer)
        with work.lock:
            work.futures.append((fut, buffer))
            failed = work.error
        if failed is not None:  # the step already failed on the runner: fail this bucket too
            fut.set_exception(failed)
            return fut
        if self.world_size == 1:
            pass
        elif work.dense:
            with work.lock:
                work.dense_pending += 1
            ready_event = self._ready_event(buffer)
            views = self._planned_views(bucket)
            flush = self._flush_views(bucket) if work.carried_flush else None
            carry = None
            if work.dense_carry is not None and (views is None or views):  # the first bucket that sends
                carry, work.dense_carry = work.dense_carry, None
            layout = self._bucket_layout(bucket) if work.can_stop else None
            if work.inline:
                self._guard(work, self._job_dense_bucket, work, buffer, fut, ready_event, views, flush, carry)
            else:
                self._runner.submit(lambda: self._guard(work, self._job_dense_bucket, work, buffer, fut, ready_event,
                                                        views, flush, carry, layout))
        else:
            ready_event = self._ready_event(buffer)
            last = bucket.is_last()
            if last and self._outside_nonfinite:  # before the step's last job: its report may ride there
                self._outside_nonfinite = False
                work.report.nonfinite_ranks = 1.0
            jobs: list[tuple[int, list[Tensor], list[Tensor] | None]] = []
            for gid in self._readiness.add_bucket(bucket):
                views = self._readiness.take_views(gid)
                if work.rider is not None and gid in work.rider:
                    # host and exact group go as one job, at the later one's place in the order (the
                    # same on every rank: readiness follows DDP's bucket order)
                    work.rider_views[gid] = views
                    if len(work.rider_views) < 2:
                        continue
                    host, exact = work.rider
                    jobs.append((host, work.rider_views.pop(host), work.rider_views.pop(exact)))
                    continue
                jobs.append((gid, views, None))
            for i, (g, v, e) in enumerate(jobs):
                # the step's last job (the last bucket's last group; the same on every rank) may carry
                # the closing report in its last message (_report_rides)
                closes = last and i == len(jobs) - 1
                self._runner.submit(lambda g=g, v=v, e=e, c=closes: self._guard(
                    work, self._job_group, work, g, v, ready_event, e, c))
        if bucket.is_last():
            self._close_step()
        return fut

    def _planned_views(self, bucket: dist.GradBucket) -> list[Tensor] | None:
        """None if the plan sends the whole bucket, else the gradient views it sends (OSP)."""
        if len(self._planned) == len(self.params):
            return None
        pids = [self._readiness.pid_of(p) for p in bucket.parameters()]
        return [g for pid, g in zip(pids, bucket.gradients()) if pid in self._planned]

    def _ready_event(self, buffer: Tensor):
        if not buffer.is_cuda:
            return None
        ev = torch.cuda.Event()
        ev.record()
        return ev

    def _open_step(self) -> None:
        dense = self.step_is_dense()
        c = self.compressor  # StepStats.ratio: the ratio option, or the payload's weight without one
        stats = StepStats(step=self.step, dense=dense,
                          ratio=1.0 if dense else float(c.ratio if c.has_ratio else c.payload_fraction))
        # a payload of the wrong size is recorded, sent as zeros and stops the step on every rank at the
        # close (below), instead of raising on its rank alone while the others wait in the collective
        times = ExchangeTimes(malformed=[])
        work = _StepWork(self.step, dense, stats, times, Timer(self.device, times))
        if dense and self._dense_carry and self.world_size > 1:  # the first bucket carries it (NaN: none)
            work.dense_carry = float("nan") if self._carried_wall is None else self._carried_wall
        elif self._carried_wall is not None:  # taken by this step's closing report
            work.report.carried_wall_s, work.report.carried_ranks = self._carried_wall, 1.0
        self._carried_wall = None
        if dense and self.dense_mode is not None and self.step >= self.config.warmup_steps:
            work.dense_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(self.dense_mode)
            work.carried_flush = self._dense_flush
        # Every step of this kind issues the same bucket allreduces in DDP's order, and entering it was
        # agreed (set_dense_mode, or a lossless compressor): no opening check, and the buckets go out
        # from the hook thread as DDP's own hook would.
        work.steady = (dense and self.world_size > 1 and self.step >= self.config.warmup_steps
                       and (self.all_exact or self.dense_mode is not None) and self.plan_sends_every_param)
        # after run_before_step the step's jobs queue on the runner behind its job, to read its verdict
        work.pre_step, self._pre_step = self._pre_step, None
        work.can_stop = (work.pre_step is not None and work.steady and self.dense_mode is not None
                         and not self.all_exact)
        work.inline = work.steady and work.pre_step is None
        if not dense and self.world_size > 1:
            work.rider = self._rider()
        self._work = work
        self._readiness.begin()
        if self.world_size > 1 and not work.steady:
            work.descriptor = self._descriptor(work)
            # dense steps outside the steady path (warm-up, a flush, a plan's deferred layers) have no
            # closing report: they always check; compressed steps on the replicated schedule
            check = dense or self._check_next or work.step % self.config.check_every == 0
            self._check_next = False
            self._runner.submit(lambda: self._guard(work, self._job_open, work, check))

    def _rider(self) -> tuple[int, int] | None:
        """(host gid, exact gid) when the plan's exact group can travel inside the last compressed
        group's exchange this step, else None.

        Otherwise the exact group costs an allreduce of its own every compressed step. The host is
        the last compressed group in gid order (the earliest layers, complete last in backward, as
        the exact group usually is) if its exchange ``carries_exact`` (``lowrank``). Replicated
        state only (plan, slots), so every rank decides alike."""
        if len(self._planned) != len(self.params):  # a plan that defers layers this step (OSP)
            return None
        exact = [g.gid for g in self.plan.groups if g.exact]
        lossy = [g.gid for g in self.plan.groups if not g.exact]
        if len(exact) != 1 or not lossy:
            return None
        host = lossy[-1]
        if not type(self.slot_of(host).exchange).carries_exact:
            return None
        return host, exact[0]

    def _descriptor(self, work: _StepWork) -> str:
        if work.dense:
            mode = "" if self.dense_mode is None else f"/{self.dense_mode}"
            return f"step={work.step} dense{mode} flush={work.carried_flush} plan={self.plan.signature()}"
        # the network model also picks each small allreduce's algorithm (comm/direct.py): compared too
        net = self.tracker.describe() if (type(self.exchange).needs_network or self.tracker.state.model is not None) else "-"
        return (f"step={work.step} compressed plan={self.plan.signature()} compressor={self.compressor.describe()} "
                f"collective={self.exchange.describe()} net={net}{self._slots_signature()}")

    def _close_step(self) -> None:
        work = self._work
        assert work is not None
        self._work = None
        self._last_work = work
        self.step += 1
        if self._outside_nonfinite:  # before the closing job is queued: the runner reads it there
            self._outside_nonfinite = False
            work.report.nonfinite_ranks = 1.0
        if self.world_size == 1:
            self._finish(work)
            return
        incomplete = self._readiness.incomplete() if not work.dense else []
        if incomplete:
            err = RuntimeError(
                f"lightning_gc: step {work.step} ended with plan groups {incomplete} incomplete; some "
                "parameters' gradients never reached the hook. This happens when parameters are "
                "unused in forward: pass find_unused_parameters=True to the strategy."
            )
            self._fail(work, err)
            raise err
        if work.inline:
            self._guard(work, self._job_close, work)
        else:
            self._runner.submit(lambda: self._guard(work, self._job_close, work))

    # ------------------------------------------------------------------ jobs (runner thread)
    def _guard(self, work: _StepWork, job, *args) -> None:
        if work.error is not None:
            return
        try:
            with self._own.region():
                job(*args)
        except BaseException as e:  # noqa: BLE001 - every Future of the step must learn about it
            self._fail(work, e)

    def _fail(self, work: _StepWork, error: BaseException) -> None:
        with work.lock:
            if work.error is None:
                work.error = error
            futures = list(work.futures)
        self._failure = self._failure or error
        for fut, _ in futures:
            if not fut.done():
                try:
                    fut.set_exception(error)
                except RuntimeError:  # completed concurrently
                    pass
        work.finished.set()

    def _job_open(self, work: _StepWork, check: bool) -> None:
        if check:
            t0 = time.perf_counter()
            work.times.bytes_sent += check_descriptor(work.descriptor, work.step, self.exchange_group,
                                                      self.world_size, self.device)
            work.control_comm_s += time.perf_counter() - t0
            self.opening_checks += 1
        if not work.dense:
            probe_s = self.tracker.maybe_probe(work.step, self.exchange_group, self.device)
            work.stats.probe_s += probe_s
            if probe_s > 0:  # a new agreed network model: the next step's descriptor differs
                self._check_next = True

    def _job_dense_bucket(self, work: _StepWork, buffer: Tensor, fut: torch.futures.Future, ready_event,
                          views: list[Tensor] | None = None,
                          flush: list[tuple[Tensor, Tensor]] | None = None, carry: float | None = None,
                          layout: list[tuple[Tensor, int | None, int]] | None = None) -> None:
        """DDP's own hook: async allreduce of bucket / N; in a 16-bit dense mode, torch's
        ``fp16_compress_hook`` numerics (cast, divide, allreduce, copy back).

        ``views``: the gradient views the plan sends, where it defers others (OSP); they are averaged
        through a copy. ``flush``: (gradient view, error memory) pairs added first (set_dense_mode).
        ``carry``: one more element sent (:meth:`enable_dense_carry`). ``layout``: the
        :meth:`_bucket_layout` of a step that can stop (:meth:`run_before_step`)."""
        if ready_event is not None:
            torch.cuda.current_stream().wait_event(ready_event)
        t0 = time.perf_counter()
        if views is not None and not views:  # nothing of this bucket is sent this step
            self._dense_bucket_done(work, fut, buffer)
            return
        for grad, mem in flush or ():
            grad.view(-1).add_(mem.to(grad.dtype))
        self._read_pre_step(work)
        if work.stopped:  # the job before the step said stop: nothing more of it goes dense
            self._defer_dense_bucket(work, fut, buffer, layout, t0)
            return
        data = buffer if views is None else torch.cat([v.reshape(-1) for v in views])
        half = work.dense_dtype
        if carry is None:
            wire = data if half is None else data.to(half)
        else:
            wire = torch.empty(data.numel() + 1, dtype=half or data.dtype, device=data.device)
            wire[:-1].copy_(data.reshape(-1))
            wire[-1] = carry
        nbytes = wire.numel() * wire.element_size()
        sent, inter = self.topology.dense_bytes(nbytes)
        with work.lock:
            work.times.bytes_sent += sent
            work.times.bytes_inter_node += inter
            work.times.bytes_payload += nbytes
        wire.div_(self.world_size)
        reduced = self.topology.allreduce_sum(wire, self.exchange_group)

        def done(f: torch.futures.Future) -> None:
            try:
                out = f.value()[0]
                carried = None
                if carry is not None:
                    carried = float(out[-1])
                    out = data.copy_(out[:-1].view_as(data))
                elif half is not None:
                    out = data.copy_(out)
                bad = not all_finite(out)
                if views is not None:
                    unflatten_into(out, views)
                    out = buffer
            except BaseException as e:  # noqa: BLE001
                self._fail(work, e)
                return
            waited = time.perf_counter() - t0
            with work.lock:
                work.times.comm_s += waited
                work.async_comm_s += waited
                work.stats.nonfinite = work.stats.nonfinite or bad
                if carried is not None and math.isfinite(carried):
                    work.stats.carried_wall_mean_s = carried
            self._dense_bucket_done(work, fut, out)

        reduced.add_done_callback(self._own.wrap(done))

    def _dense_bucket_done(self, work: _StepWork, fut: torch.futures.Future, out: Tensor) -> None:
        with work.lock:
            work.dense_pending -= 1
            last = work.closed and work.dense_pending == 0
        if last:
            self._finish(work)
        fut.set_result(out)

    def _defer_dense_bucket(self, work: _StepWork, fut: torch.futures.Future, buffer: Tensor,
                            layout: list[tuple[Tensor, int | None, int]] | None, t0: float) -> None:
        """A bucket of a stopped step (engine/dense_stop.py): the compressed groups' gradients into
        the step's deferred memory, the exact group's averaged."""
        assert layout is not None
        sizes = {g.gid: (sum(g.numels), self.params[g.param_ids[0]].dtype) for g in self.plan.groups if not g.exact}
        bad, sent = defer_bucket(layout, work.deferred, sizes, self.exchange_group, self.world_size)
        with work.lock:
            work.times.bytes_sent += sent
            work.times.comm_s += time.perf_counter() - t0
            work.stats.nonfinite = work.stats.nonfinite or bad
            work.stats.dense_stopped = True
        self._dense_bucket_done(work, fut, buffer)

    def _read_pre_step(self, work: _StepWork) -> None:
        """The verdict of the job run before this step (runner thread: it ran before this one), into the
        step's statistics, once; a dense mode's step stops on it."""
        if work.pre_step is None or work.pre_step_read:
            return
        work.pre_step_read = True
        res: StopVerdict | BaseException = work.pre_step[0]
        if isinstance(res, BaseException):
            raise RuntimeError(f"lightning_gc: the job before step {work.step} failed: {res!r}") from res
        with work.lock:
            work.stats.dense_check_s, work.stats.dense_check_predicted_s = res.check_s, res.predicted_s
            work.stats.dense_check_bytes = res.nbytes
            if math.isfinite(res.carried):
                work.stats.carried_wall_mean_s = res.carried
        work.stopped = res.stop and work.can_stop

    def _bucket_layout(self, bucket: dist.GradBucket) -> list[tuple[Tensor, int | None, int]]:
        """(gradient view, compressed group id or None for an exact group's parameter, offset in the
        group) of the bucket's parameters, in the bucket's order."""
        where = self._group_offsets()
        out = []
        for p, grad in zip(bucket.parameters(), bucket.gradients()):
            gid, off = where.get(self._pid_of[id(p)], (None, 0))
            out.append((grad, None if gid is None or self.plan.groups[gid].exact else gid, off))
        return out

    def _job_group(self, work: _StepWork, gid: int, views: list[Tensor], ready_event,
                   exact_views: list[Tensor] | None = None, closes: bool = False) -> None:
        """Exchange group ``gid`` and write its mean into ``views``; with ``exact_views`` (the exact
        group's views, :meth:`_rider`), that group rides in the same exchange. ``closes``: the step's
        last job (its closing report may ride in this exchange: :meth:`_report_rides`)."""
        if ready_event is not None:
            torch.cuda.current_stream().wait_event(ready_event)
        group = self.plan.groups[gid]
        timer = work.timer
        # into a huge-page backed tensor: a fresh group-sized tensor otherwise page-faults 4 KiB at a
        # time, which costs several times the copy itself on CPU (lightning-gc bench --codec, 'flatten' rows)
        dtype = views[0].dtype
        for v in views[1:]:
            dtype = torch.promote_types(dtype, v.dtype)  # what torch.cat would produce
        flat = timer.run("compress", lambda: torch.cat(
            [v.reshape(-1) for v in views], out=empty_output(group.numel, dtype, views[0].device)))
        ctx = GroupContext(step=work.step, rank=self.rank, world_size=self.world_size, segments=group.numels,
                           group_id=gid, seed=self.config.seed, device=flat.device,
                           shapes=tuple(self._shapes[n] for n in group.names), names=group.names)
        if group.exact:
            visit = self.topology.enter(flat, ctx, timer)
            mean, _ = self.exact_exchange.run(visit.tensor, visit.ctx, timer)
            mean = self.topology.leave(visit, mean, timer)
            if not all_finite(mean):  # identical on all ranks after the sum
                work.report.nonfinite_ranks = 1.0
                work.replicated_nonfinite = True
        else:
            exact = None
            if exact_views is not None:
                exact = timer.run("compress", lambda: torch.cat([v.reshape(-1).float() for v in exact_views]))
            mean, exact_mean = self._exchange_lossy(work, gid, flat, ctx, timer, exact, closes)
            work.written.append(views)
            if exact_views is not None:
                if not all_finite(exact_mean):  # identical on all ranks after the sum
                    work.report.nonfinite_ranks = 1.0
                    work.replicated_nonfinite = True
                unflatten_into(exact_mean, exact_views)
        unflatten_into(mean, views)

    def _exchange_lossy(self, work: _StepWork, gid: int, flat: Tensor, ctx: GroupContext, timer: Timer,
                        exact: Tensor | None = None, closes: bool = False) -> tuple[Tensor, Tensor | None]:
        """(mean of group ``gid``, mean of ``exact`` or None): ``exact`` rides in the exchange, and
        the step's closing report too where ``closes`` and :meth:`_report_rides` allow."""
        slot = self.slot_of(gid)
        names = self.plan.groups[gid].names
        flush = names in self._flush
        # by nodes: this rank's shard of its node's mean, and memory per shard (comm/hierarchy.py)
        visit = self.topology.enter(flat, ctx, timer)
        flat, ctx = visit.tensor, visit.ctx
        mem = self._memory.get(gid)
        # flat is a fresh tensor (torch.cat into a new output): add the memory in place
        # a flush always sends the memory; a compressor may discard it at this step (adds_memory)
        add = flush or (slot.error_feedback and slot.compressor.adds_memory(ctx.step))
        p = flat.add_(mem) if (add and mem is not None) else flat
        p2 = sq_norm(p)  # the gain needs it; a NaN/inf anywhere shows here
        if not math.isfinite(p2) and not all_finite(p):  # p2 may overflow on finite p
            work.report.nonfinite_ranks = 1.0
        if self.group_observer is not None:
            self.group_observer(gid, p, ctx)
        timer.resolve()
        c0 = work.times.comm_s
        work.report.p2 += p2
        exact_mean = None
        if closes and self._report_rides(work, slot):
            def share(sent: Tensor) -> Tensor:  # called by the exchange just before its last collective
                work.report.sent2 += sent_sq_norm(sent)
                work.report.malformed_ranks = 1.0 if work.times.malformed else 0.0
                previous = self._last_exchange
                prev_s = previous[1] if previous is not None and previous[0] == work.step - 1 else None
                return RiddenReport.encode(work.report, descriptor_hash(work.descriptor), prev_s, p.device)

            mean, sent, exact_mean, summed = slot.exchange.run_riding(p, ctx, timer, exact, share)
            work.ridden = RiddenReport.decode(summed, self.world_size, work.step)
            sent2 = None  # in the report already
        else:
            if exact is None:
                mean, sent = slot.exchange.run(p, ctx, timer)
            else:
                mean, sent, exact_mean = slot.exchange.run_with_exact(p, ctx, timer, exact)
            sent2 = sent_sq_norm(sent)  # a LazySent knows it without expanding
            work.report.sent2 += sent2
        timer.resolve()  # CUDA: wait for this exchange's events (worker thread only)
        work.exchange_comm_s += work.times.comm_s - c0
        if flush and not slot.error_feedback:  # the memory went out with this send: none is kept
            self._memory.stage_clear(gid)
            work.flushed.append(names)
        if slot.error_feedback:
            # p is a fresh tensor (torch.cat / the sum above always allocate): reuse it in place
            residual = error_feedback_residual(p, sent, in_place=True)
            # sparse: sent == p at its indices, so ‖p − sent‖² = ‖p‖² − ‖sent‖² without another pass
            r2 = (max(p2 - sent2, 0.0) if isinstance(sent, SparseSent) and sent2 is not None
                  else sq_norm(residual))
            self._memory.stage(gid, residual, r2)
        return self.topology.leave(visit, mean, timer), exact_mean

    def _report_rides(self, work: _StepWork, slot: MethodSlot) -> bool:
        """Whether the step's closing report rides in this (the step's last) exchange's last message
        (``EngineConfig.report_rides``, ``RiddenReport``). Only where the exchange ``carries_report``
        in a dtype that counts this many ranks exactly, where no exchange chose its collective from
        the network model (the tracker needs that step's own time), and where the plan sends every
        parameter (OSP's deferred layers report from outside). Replicated inputs only."""
        if not (self.config.report_rides and type(slot.exchange).carries_report and self.world_size > 1):
            return False
        limit = RIDER_MAX_RANKS.get(slot.exchange.report_dtype())
        return (limit is not None and self.world_size <= limit and not work.times.choices
                and len(self._planned) == len(self.params))

    def _job_close(self, work: _StepWork) -> None:
        self._read_pre_step(work)  # a step none of whose jobs read it (no dense bucket)
        if work.dense:
            with work.lock:
                work.closed = True
                last = work.dense_pending == 0
            if last:
                self._finish(work)
            return
        work.timer.resolve()
        choices = work.times.choices
        predicted = work.times.predicted_comm_s if choices else None
        work.report.exchange_comm_s = work.exchange_comm_s
        if predicted is not None:
            work.report.predicted_comm_s, work.report.has_prediction = float(predicted), 1.0
        ridden = work.ridden
        if ridden is None:
            work.report.malformed_ranks = 1.0 if work.times.malformed else 0.0
            work.report.set_digest(descriptor_hash(work.descriptor))
            t0 = time.perf_counter()
            total, nbytes = agree(work.report, self.exchange_group, self.world_size, self.device)
            work.control_comm_s += time.perf_counter() - t0
            work.times.bytes_sent += nbytes
            digests_agree = total.digests_agree(self.world_size)
        else:  # it rode in the step's last message (summed there; its bytes counted by that exchange)
            total, digests_agree = ridden.report, ridden.digests_agree
        if not digests_agree:  # on every rank alike: name the ranks, then stop
            check_descriptor(work.descriptor, work.step, self.exchange_group, self.world_size, self.device,
                             at_close=True)
        if total.malformed_ranks > 0:  # on every rank alike: the step's futures fail, training stops
            here = f"this rank's: {work.times.malformed[0]}" if work.times.malformed else "not this rank's"
            raise RuntimeError(
                f"lightning_gc: at step {work.step} {int(total.malformed_ranks)} of {self.world_size} ranks produced a "
                f"compressed payload of another size than every rank expects ({here}). Zeros were sent in its "
                "place so that no rank waits in the collective, and training stops here on every rank: the step "
                f"is not applied. A payload size that depends on a rank's data is a bug of the compressor "
                f"({self.compressor.name!r}, or a group's own method); please report it with its configuration."
            )
        s = work.stats
        s.exchange_comm_s = work.exchange_comm_s
        if ridden is None:
            s.exchange_comm_mean_s, s.exchange_comm_mean_step = total.exchange_comm_s / self.world_size, work.step
        elif ridden.exchange_comm_s is not None:  # the step before's, carried in this step's last message
            s.exchange_comm_mean_s = ridden.exchange_comm_s / self.world_size
            s.exchange_comm_mean_step = ridden.exchange_step
        self._last_exchange = (work.step, work.exchange_comm_s)
        if total.carried_ranks == self.world_size:
            s.carried_wall_mean_s = total.carried_wall_s / self.world_size
        s.full_precision = work.times.full_precision
        s.compressor_metrics = work.times.metrics or None
        bad = total.nonfinite_ranks > 0 or work.replicated_nonfinite
        if bad and self.config.check_finite:
            s.nonfinite = True
            self._memory.discard()
            for views in work.written:
                for v in views:
                    v.fill_(float("nan"))
        else:
            s.nonfinite = bad
            self._memory.commit()
            self._flush.difference_update(work.flushed)
            if total.p2 > 0 and not bad and math.isfinite(total.p2) and math.isfinite(total.sent2):
                self._record_gain(s, total.sent2, total.p2)
        if choices:
            s.collective = "+".join(sorted(set(choices)))
            s.predicted_comm_s = predicted
            if total.has_prediction > 0 and not bad:
                n = self.world_size
                self.tracker.last_measurement = (total.exchange_comm_s / n, total.predicted_comm_s / n)
        with work.lock:
            work.closed = True
        self._finish(work)

    def _record_gain(self, s: StepStats, sent2: float, p2: float) -> None:
        gain = sent2 / p2
        b = self.config.gain_ewma_beta
        self.gain_ewma = gain if self.gain_ewma is None else b * self.gain_ewma + (1 - b) * gain
        s.gain, s.gain_ewma = gain, self.gain_ewma

    def _finish(self, work: _StepWork) -> None:
        """Finalise the step's statistics, then complete every bucket Future of the step."""
        s = work.stats
        model = self.tracker.state.model
        if model is not None:
            s.alpha_s, s.beta_s_per_byte = model.alpha_s, model.beta_s_per_byte
        s.bytes_sent += work.times.bytes_sent
        s.bytes_payload += work.times.bytes_payload
        s.bytes_inter_node += work.times.bytes_inter_node
        s.bytes_dense = self._dense_bytes_per_step if self.world_size > 1 else 0
        s.compress_time_s += work.times.compress_s
        s.comm_time_s += work.times.comm_s + work.control_comm_s
        s.error_norm = self.error_norm() if (self.error_feedback or self._slots) else 0.0
        if s.gain_ewma is None:
            s.gain_ewma = self.gain_ewma
        if work.carried_flush and not s.nonfinite:  # the memory went out with this dense step
            self._memory.clear()
            self._flush.clear()
            self._dense_flush = False
        if work.stopped and not s.nonfinite:  # what the stopped step did not send (each rank its own)
            self._memory.clear()
            for gid, mem in work.deferred.items():
                self._memory.stage(gid, mem)
            self._memory.commit()
            self._dense_flush = True  # a dense mode sends it with its next step's buckets
        s.control_comm_s = work.control_comm_s
        s.engine_own_s = self._own.take()  # this step's own time, up to here
        s.overhead_s = step_overhead(s.engine_own_s, work.times.comm_s, work.async_comm_s, work.times.compress_s,
                                     s.probe_s)
        with self._stats_lock:
            self._last_stats = s
            self._last_nonfinite = s.nonfinite
            self._totals.add(s)
        if not work.dense or self.world_size == 1:  # dense buckets complete in their own callbacks
            for fut, buffer in work.futures:
                fut.set_result(buffer)
        work.finished.set()

    # ------------------------------------------------------------------ checkpoint state
    def state_dict(self) -> dict:
        """This rank's state; error memory keyed by parameter name (CPU tensors)."""
        self.synchronize()
        return checkpoint.engine_state(self)

    @property
    def check_pending(self) -> bool:
        """Whether the next step opens with the opening check whatever ``check_every`` says."""
        return self._check_next

    def load_state_dict(self, state: dict, restore_memory: bool = True, check_next: bool = True) -> list[str]:
        """Restore from :meth:`state_dict`. Returns names whose memory was missing (reset to 0).

        ``check_next``: open the next step with the opening check (a resumed rank proves it resumed
        from the same checkpoint); a rollback within the run passes the value it had then."""
        self.synchronize()
        missing = checkpoint.load_engine_state(self, state, restore_memory)
        self._check_next = bool(check_next)
        self._last_exchange = None  # a time of another timeline: the next ridden report carries none
        return missing


def gc_comm_hook(engine: GCEngine, bucket: dist.GradBucket) -> torch.futures.Future:
    """DDP communication hook: ``ddp_model.register_comm_hook(engine, gc_comm_hook)``; the state may
    also be a :class:`~lightning_gc.engine.session.StepSession` (what the strategy registers)."""
    return engine.on_bucket(bucket)


# DDP inspects the hook's annotations and rejects string annotations (this module uses postponed
# evaluation), so give it the real objects.
gc_comm_hook.__annotations__ = {
    "engine": GCEngine,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}
