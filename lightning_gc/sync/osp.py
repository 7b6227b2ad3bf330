"""OSP two-stage synchronisation on collectives (Chen et al., ICPP 2023), inside DDP's comm hook.

Each optimizer step splits the model's layers (parameter tensors) in two:

* **Routine synchronisation (RS)**: the important layers go through the engine exactly as under
  BSP — with the configured compressor, plan and collective — and are in the gradient the
  optimizer sees. With nothing deferred, a step *is* a BSP step, bit for bit.
* **In-computation synchronisation (ICS)**: the unimportant layers are left out of the engine's
  plan for this step, so DDP hands the optimizer their *local* gradient. The hook copies it (the
  collective must own its data: DDP reuses the bucket) and, right after the optimizer step, a
  dense allreduce of the copies starts on OSP's own worker thread and process group, overlapping
  the next step's forward and backward. Before the next optimizer step the global gradient is
  waited for and the parameters (and momentum buffers) are corrected by LGP (:mod:`.lgp`).

Which layers are deferred: the least important by PGP importance ``Σ|g ⊙ p|`` of the previous
step's aggregated gradient (:mod:`.importance`), up to an element budget from the ``S(Gu)``
schedule or a pinned fraction (:mod:`.schedule`). All inputs are replicated, so every rank picks
the same split without exchanging it; the engine's per-step opening check compares the plan
signature (which lists the routine layers) anyway.

Everything is keyed by parameter (DDP rebuilds its buckets after step 0). Pending ICS work is
drained and its correction applied before a checkpoint is written, before validation, test and
predict, at the end of fit and on an exception (:meth:`OSPSync.drain`). A non-finite local
gradient in ICS data on any rank is agreed before the optimizer step (one 8-byte allreduce on
steps that defer something) and the step is then handled like any non-finite step.

Collectives on OSP's process group: the ICS allreduce (worker thread) and, on the main thread
while the worker is idle, the per-step agreement and, at the end of each schedule round, the
round's loss and compute-time sums (and one network probe if the engine has no network model).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor

from .._finite import all_finite
from ..comm.collectives import ring_allreduce_bytes
from ..comm.hierarchy import destroy_groups
from ..comm.probe import ProbeConfig
from ..comm.worker import InlineRunner, OrderedWorker
from ..engine.ports import EngineControl, LinkPort, PlanControl
from ..engine.session import StepParticipant
from ..plans import Group, Plan
from .importance import layer_importance, rank_split
from .lgp import LGPSnapshot
from .schedule import DeferredSchedule, ring_umax

#: OSP's probe where the link observer holds no model yet: small messages, since the default's 4 MB
#: would take seconds on a slow link, and the bound S(Gu) needs α and β only roughly
OSP_PROBE = ProbeConfig(sizes_bytes=(64, 64 * 1024, 256 * 1024), repeats=5)
_ICS_GROUP_ID = 1 << 20  # GroupContext.group_id of the deferred stage: random draws differ from the plan's groups


@dataclass(frozen=True)
class OSPConfig:
    """Options of two-stage synchronisation.

    Attributes:
        deferred_fraction: ``None`` (default) follows the ``S(Gu)`` schedule; a number in
            ``[0, 0.8]`` pins the fraction of the model's elements deferred to ICS from step 1 on
            (0 = BSP). Larger values hide more communication behind compute and make LGP's
            staleness larger; the paper caps it at 0.8.
        round_steps: optimizer steps per schedule round (the paper's epoch). Round 1 defers
            nothing and measures the reference loss; make it long enough for the loss to move
            (tens to hundreds of steps).
        max_fraction: the cap of ``Umax`` as a fraction of the model (paper: 0.8).
        deferred_compressor: how the deferred (ICS) stage is sent: ``"dense"`` (default: a dense
            allreduce, DDP's numerics) or any registered compressor name (``"topk"``, ``"qsgd"``,
            ``"bf16"``, ...), sent through that compressor's default collective on OSP's process
            group. Compressors that use error feedback keep the residual per layer and add it to
            the layer's next deferred send. Use a compressor when the routine stage is compressed
            too: a dense deferred stage otherwise dominates the bytes.
        deferred_ratio: the ratio of ``deferred_compressor`` when it takes one (``None``: its default).
    """

    deferred_fraction: float | None = None
    round_steps: int = 50
    max_fraction: float = 0.8
    deferred_compressor: str = "dense"
    deferred_ratio: float | None = None

    def __post_init__(self) -> None:
        mf = self.max_fraction
        if isinstance(mf, bool) or not isinstance(mf, (int, float)) or not (0.0 < mf <= 1.0):
            raise ValueError(f"osp max_fraction={mf!r} must lie in (0, 1]; the paper uses 0.8.")
        f = self.deferred_fraction
        if f is not None and (isinstance(f, bool) or not isinstance(f, (int, float)) or not (0.0 <= f <= mf)):
            raise ValueError(
                f"osp_deferred_fraction={f!r} is invalid: it is the fraction of the model's elements whose "
                f"synchronisation is deferred, a number in [0, {mf}] (beyond {mf} OSP degenerates into "
                "asynchronous training), or None to follow the S(Gu) schedule. E.g. 0.5."
            )
        if not isinstance(self.deferred_compressor, str):
            raise ValueError(f"osp_deferred_compressor={self.deferred_compressor!r} must be a compressor name, "
                             "e.g. 'dense' (default) or 'topk'.")
        if self.deferred_compressor != "dense" or self.deferred_ratio is not None:
            from ..compressors import build_compressor

            try:
                build_compressor(self.deferred_compressor, ratio=self.deferred_ratio)
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(
                    f"osp_deferred_compressor={self.deferred_compressor!r} with osp_deferred_ratio="
                    f"{self.deferred_ratio!r} cannot be built: {e}"
                ) from e
        rs = self.round_steps
        if isinstance(rs, bool) or not isinstance(rs, int) or rs < 2:
            raise ValueError(
                f"osp_round_steps={rs!r} must be an integer ≥ 2 (optimizer steps per S(Gu) round; "
                "the first round is synchronous). E.g. 50."
            )


@dataclass
class OSPStats:
    """What OSP did at one optimizer step (for :class:`~lightning_gc.callbacks.GCMonitor`)."""

    step: int
    deferred_fraction: float = 0.0  # elements deferred to ICS at this step / model elements
    deferred_layers: int = 0
    threshold: float = -1.0  # largest importance deferred at this step (-1: none)
    correction_norm: float = 0.0  # ‖p_corrected − p_local‖ of the correction applied before this step
    ics_wait_s: float = 0.0  # time the correction waited for the previous step's ICS (exposed comm)
    ics_comm_s: float = 0.0  # duration of the previous step's ICS allreduce on the worker
    budget: int = 0  # element budget in force
    umax: float | None = None
    clip_factor: float = 1.0  # norm clipping with something deferred: the factor every gradient got


@dataclass
class _Pending:
    step: int
    pids: list[int]
    snapshot: LGPSnapshot | None
    parts: list[Tensor]  # the deferred layers' captured gradients; the worker flattens them into ``flat``
    flat: Tensor | None = None
    comm_s: float = 0.0
    error: BaseException | None = None
    event: Any = None
    residual: Tensor | None = None  # compressed ICS with error feedback: what was not sent
    bytes_sent: int = 0
    bytes_payload: int = 0


def filter_plan(plan: Plan, keep: frozenset[int] | set[int]) -> Plan:
    """``plan`` restricted to the parameter ids in ``keep`` (empty groups dropped, renumbered)."""
    groups: list[Group] = []
    for g in plan.groups:
        idx = [i for i, pid in enumerate(g.param_ids) if pid in keep]
        if not idx:
            continue
        groups.append(Group(len(groups), tuple(g.param_ids[i] for i in idx), tuple(g.names[i] for i in idx),
                            tuple(g.numels[i] for i in idx), exact=g.exact))
    return Plan(plan.kind, tuple(groups))


@dataclass
class _Round:
    losses: list[float] = field(default_factory=list)
    tc: list[float] = field(default_factory=list)


class OSPSync(StepParticipant):
    """Two-stage synchronisation around a :class:`~lightning_gc.engine.GCEngine`.

    A participant of the :class:`~lightning_gc.engine.session.StepSession` that owns the merge
    plan (it leaves the deferred layers out of the engine's plan every step). Build it right after
    the engine, on every rank, in the same order (it creates a process group). Without a session
    (unit tests), register :func:`osp_comm_hook` with it and call the session's methods in its order.
    """

    name = "osp"
    owns_plan = True
    state_scope = "rank"

    def __init__(self, engine: EngineControl, config: OSPConfig) -> None:
        self.engine = engine
        self._plan_control: PlanControl = engine  # type: ignore[assignment] # the session re-binds it
        self.config = config
        self.params: list[Tensor] = list(engine.params)
        self.names: list[str] = list(engine.names)
        self.numels = [p.numel() for p in self.params]
        self.total_numel = sum(self.numels)
        self.base_plan: Plan = engine.plan
        self.world_size: int = engine.world_size
        self.device = engine.device
        self._pid_of_ptr = {p.data_ptr(): i for i, p in enumerate(self.params)}
        # two groups, one issuing thread each: the worker sends the deferred stage on ``group`` while
        # the main thread agrees (non-finite data, round statistics, the clipping norm) on ``control``
        self.group = self.control = None
        if self.world_size > 1:
            pg = engine.process_group
            ranks = dist.get_process_group_ranks(pg) if pg is not None else None
            self.group = dist.new_group(ranks=ranks, backend=dist.get_backend(pg))
            self.control = dist.new_group(ranks=ranks, backend=dist.get_backend(pg))
        self._ics_exchange = None  # compressed deferred stage (None: dense allreduce)
        self._ics_error_feedback = False
        if self.world_size > 1 and config.deferred_compressor != "dense":
            from ..compressors import build_compressor
            from ..exchanges.registry import make_exchange

            compressor = build_compressor(config.deferred_compressor, ratio=config.deferred_ratio)
            self._ics_exchange = make_exchange(compressor, group=self.group)
            self._ics_error_feedback = bool(compressor.default_error_feedback)
        self._runner: OrderedWorker | InlineRunner = (
            OrderedWorker(name="lightning_gc-osp", device=self.device) if self.world_size > 1 else InlineRunner())
        self.schedule = DeferredSchedule(self.total_numel, config.round_steps, config.deferred_fraction,
                                         config.max_fraction)
        self.importance: list[float] = [math.inf] * len(self.params)  # unknown ranks as most important
        self.step = 0
        self.deferred: frozenset[int] = frozenset()
        self.threshold = -1.0
        self._captured: dict[int, Tensor] = {}
        self._local_bad = False  # a deferred local gradient of this step is non-finite (this rank)
        self._carry: dict[int, Tensor] = {}  # routine error memory of layers that just became deferred
        self._carry_used: dict[int, Tensor] = {}  # ... added to this step's deferred data
        self._snapshot: LGPSnapshot | None = None
        self._pending: _Pending | None = None
        self._round = _Round()
        self._t_opt_end: float | None = None
        self._t_backward_end: float | None = None
        self._stats = OSPStats(step=0)
        self.last_stats: OSPStats | None = None
        self.carried_layers = 0  # layers whose error memory moved into the deferred stage (total)
        # for the end-of-fit summary, since this process started: steps, Σ deferred fraction, deferred bytes sent
        self.summary_steps, self.deferred_fraction_sum, self.deferred_bytes_sent = 0, 0.0, 0

    def bind_plan(self, control: PlanControl) -> None:
        self._plan_control = control

    # ------------------------------------------------------------------ hook (autograd thread)
    def on_bucket(self, bucket: dist.GradBucket) -> None:
        """Copy the deferred layers' local gradients (the engine then sees the bucket)."""
        if self.deferred:
            for p, g in zip(bucket.parameters(), bucket.gradients()):
                pid = self._pid_of_ptr.get(p.data_ptr())
                if pid in self.deferred:
                    # the collective must own its data: DDP reuses the bucket buffer
                    carry = self._carry.pop(pid, None)
                    if carry is None:
                        self._captured[pid] = g.detach().clone()
                    else:
                        self._carry_used[pid] = carry
                        self._captured[pid] = g.detach() + carry
        if bucket.is_last():
            self._t_backward_end = time.perf_counter()
            # the engine closes its step when it sees this bucket: a non-finite deferred gradient
            # must count there too, or the routine stage's error memory of a skipped step is kept
            self._local_bad = any(not all_finite(t) for t in self._captured.values())
            if self._local_bad:
                self.engine.report_nonfinite()

    # ------------------------------------------------------------------ lifecycle (main thread)
    def before_optimizer_step(self, loss: Any = None) -> bool:
        """After backward: apply the previous step's correction, agree on non-finite ICS data and,
        at a round's end, on the round's statistics. Returns whether ICS data was non-finite on
        some rank (identical on every rank)."""
        self._stats = OSPStats(step=self.step, budget=self.schedule.budget_for_step(self.step),
                               umax=self.schedule.umax)
        self._apply_pending()
        if loss is not None:
            value = float(loss.detach()) if isinstance(loss, Tensor) else float(loss)
            if math.isfinite(value):  # a non-finite loss (the step is skipped) would poison L for good
                self._round.losses.append(value)
        if self._t_opt_end is not None and self._t_backward_end is not None:
            self._round.tc.append(max(self._t_backward_end - self._t_opt_end, 0.0))
        round_end = self.schedule.round_ends_after(self.step)
        local_bad, self._local_bad = self._local_bad, False  # seen at the last bucket (on_bucket)
        if self.world_size == 1 or (not self.deferred and not round_end):
            if round_end:
                self._end_round(self._round_sums())
            return False
        fields = [1.0 if local_bad else 0.0] + (self._round_sums() if round_end else [])
        t = torch.tensor(fields, dtype=torch.float64, device=self._comm_device())
        dist.all_reduce(t, group=self.control)
        values = t.cpu().tolist()
        if round_end:
            self._end_round(values[1:])
        return values[0] > 0

    def prepare_step(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer step will be taken: start this step's ICS exchange, record the importance of
        the routine layers (their gradient is the aggregated one) and snapshot the deferred layers'
        optimizer state.

        The exchange needs only the captured gradients, so it starts here rather than after the
        optimizer step: the link carries the deferred stage while this rank snapshots, clips and
        steps, instead of idling through them. The link still idles while the rank waits for the
        previous exchange, replays its correction and agrees on the step."""
        with torch.no_grad():
            for pid, p in enumerate(self.params):
                if pid not in self.deferred and p.grad is not None:
                    self.importance[pid] = layer_importance(p.grad, p)
        if self.deferred:
            missing = sorted(self.deferred - set(self._captured))
            if missing:
                raise RuntimeError(
                    f"lightning_gc OSP: deferred parameters {[self.names[i] for i in missing][:5]} never "
                    "reached the comm hook this step; with unused parameters pass find_unused_parameters=True."
                )
            self._start_ics()
            self._snapshot = LGPSnapshot(optimizer, [self.params[pid] for pid in sorted(self.deferred)])
            assert self._pending is not None
            self._pending.snapshot = self._snapshot

    def _start_ics(self) -> None:
        """Submit this step's deferred stage to the worker (it flattens and sends the captured
        gradients on ``group``)."""
        pids = sorted(self.deferred)
        pending = _Pending(self.step, pids, None, [self._captured[pid] for pid in pids])
        if pending.parts[0].is_cuda:
            ev = torch.cuda.Event()
            ev.record()
            pending.event = ev
        self._pending = pending
        self._runner.submit(lambda: self._job_ics(pending))

    def clip_gradients(self, optimizer: torch.optim.Optimizer, max_value: float, algorithm: str,
                       plain: Callable[[], Any]) -> None:
        """Clip this step's gradients by a transform identical on every rank (docs/osp.md,
        "Gradient clipping"); called between :meth:`prepare_step` and ``optimizer.step()`` in
        place of the plain clipping ``plain()`` (Lightning's precision plugin).

        With nothing deferred every gradient is the global one and ``plain()`` runs. Otherwise:

        * ``"value"``: element-wise, so ``plain()`` gives the same result on every rank wherever the
          gradient is global; the replay clamps the global gradient of the deferred layers alike.
        * ``"norm"``: the norm of the global gradient is not known yet (the deferred part is still
          local), so the factor is computed from replicated values — the routine layers' global
          gradients and the rank-mean of the deferred layers' local norms, one 8-byte allreduce:
          ``n = √(‖g_R‖² + (mean_r ‖g_D,r‖)²)``, ``c = min(1, max_value / (n + 1e-6))`` (torch's
          ``clip_grad_norm_`` formula). By the triangle inequality ``mean_r ‖g_D,r‖ ≥ ‖mean_r
          g_D,r‖``, so ``n`` is never below the norm BSP would clip by: OSP clips at least as hard
          as BSP, never less. Every gradient of the optimizer (global and local) is multiplied by
          ``c``, and the replay multiplies the deferred layers' global gradient by the same ``c``.
        """
        snap = self._snapshot
        if self.world_size == 1 or snap is None or all(e is None for e in snap.entries):
            plain()
            return
        if algorithm == "value":
            plain()
            snap.clip_like_step(clamp=max_value)
            return
        if algorithm != "norm":
            raise ValueError(f"lightning_gc OSP: gradient_clip_algorithm={algorithm!r} is not 'norm' or 'value'.")
        deferred = {id(e.param) for e in snap.entries if e is not None}
        grads, routine_sq, local_sq = [], 0.0, 0.0
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grads.append(p.grad)
                sq = float(torch.linalg.vector_norm(p.grad, dtype=torch.float64)) ** 2
                if id(p) in deferred:
                    local_sq += sq
                else:
                    routine_sq += sq
        t = torch.tensor([math.sqrt(local_sq)], dtype=torch.float64, device=self._comm_device())
        dist.all_reduce(t, group=self.control)  # this step's deferred stage may be in flight on ``group``
        deferred_norm = float(t.cpu()[0]) / self.world_size
        factor = min(1.0, max_value / (math.sqrt(routine_sq + deferred_norm ** 2) + 1e-6))
        if factor < 1.0:
            with torch.no_grad():
                for g in grads:
                    g.mul_(factor)
        snap.clip_like_step(scale=factor)
        self._stats.clip_factor = factor

    def skip_step(self) -> None:
        """The optimizer step is skipped on every rank (non-finite): nothing to send or correct.

        What this step's deferred sends would have carried (error memory, older residuals) waits
        for the layer's next send, added to what arrived meanwhile: the previous step's residual,
        applied by :meth:`before_optimizer_step`, is already waiting for the same layer."""
        for pid, used in self._carry_used.items():
            waiting = self._carry.get(pid)
            self._carry[pid] = used if waiting is None else used + waiting
        self._carry_used = {}
        self._captured.clear()
        self._snapshot = None

    def after_optimizer_step(self) -> None:
        """Count this step's dense ICS bytes, then choose the next step's split."""
        if self._snapshot is not None:
            if self._ics_exchange is None:  # compressed: counted when it completes (_apply_pending)
                parts = [self._captured[pid] for pid in self.deferred]
                nbytes = sum(t.numel() for t in parts) * parts[0].element_size()
                self.engine.add_deferred_traffic(ring_allreduce_bytes(nbytes, self.world_size), nbytes)
                self.deferred_bytes_sent += ring_allreduce_bytes(nbytes, self.world_size)
        self._captured.clear()
        self._carry_used = {}
        self._snapshot = None
        s = self._stats
        s.deferred_layers = len(self.deferred)
        s.deferred_fraction = sum(self.numels[i] for i in self.deferred) / self.total_numel
        s.threshold = self.threshold
        self.last_stats = s
        self.summary_steps += 1
        self.deferred_fraction_sum += s.deferred_fraction
        self.step += 1
        self._choose_split()
        self._t_opt_end = time.perf_counter()

    def drain(self, timeout: float | None = None) -> bool:
        """Wait for pending ICS work and apply its correction (before checkpoints, validation, the
        end of fit, on exceptions). Returns False if it did not finish within ``timeout``.

        The next step's compute time is not measured: it would include what runs outside training
        steps here (validation, writing a checkpoint, the epoch's end), and a run resumed from a
        checkpoint cannot measure it either, so both runs leave it out alike."""
        done = self._apply_pending(timeout)
        if done:
            self._t_opt_end = None
        return done

    def close(self, timeout: float = 60.0) -> None:
        self.drain(timeout=timeout)
        stopped = self._runner.close(timeout)
        groups = [g for g in (self.group, self.control) if g is not None]
        self.group = self.control = None
        if groups and stopped and dist.is_available() and dist.is_initialized():
            destroy_groups(groups)

    # ------------------------------------------------------------------ internals
    def _comm_device(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    def _job_ics(self, pending: _Pending) -> None:
        try:
            if pending.event is not None:
                torch.cuda.current_stream().wait_event(pending.event)
            pending.flat, pending.parts = torch.cat([t.reshape(-1) for t in pending.parts]), []
            t0 = time.perf_counter()
            if self._ics_exchange is not None:
                self._compressed_ics(pending)
            else:
                pending.flat.div_(self.world_size)  # DDP's numerics: mean = sum of (g / N)
                dist.all_reduce(pending.flat, group=self.group)
            if pending.flat.is_cuda:
                ev = torch.cuda.Event()
                ev.record()
                pending.event = ev
                ev.synchronize()
            pending.comm_s = time.perf_counter() - t0
        except BaseException as e:  # noqa: BLE001 - surfaced on the main thread by _apply_pending
            pending.error = e

    def _compressed_ics(self, pending: _Pending) -> None:
        """Send the deferred data through the deferred compressor (worker thread): ``flat`` becomes
        the mean of what the ranks sent (identical on every rank) and, with error feedback, the
        residual ``flat − sent`` is kept for the layers' next deferred sends."""
        from ..comm.exchange import ExchangeTimes, Timer, error_feedback_residual
        from ..compressors import GroupContext

        ctx = GroupContext(
            step=pending.step, rank=dist.get_rank(self.group), world_size=self.world_size,
            segments=tuple(self.numels[pid] for pid in pending.pids), group_id=_ICS_GROUP_ID, seed=self.engine.config.seed,
            device=pending.flat.device, shapes=tuple(tuple(self.params[pid].shape) for pid in pending.pids),
            names=tuple(self.names[pid] for pid in pending.pids))
        # a payload of the wrong size (a compressor bug) is recorded and sent as zeros rather than raised on
        # its rank alone while the others wait in the collective; the ranks' workers then agree on it (a
        # 1-element allreduce, overlapped like the exchange) and every rank raises at the next step
        times = ExchangeTimes(malformed=[])
        p = pending.flat
        mean, sent = self._ics_exchange.run(p, ctx, Timer(p.device, times))
        times.raise_if_malformed_anywhere(self.group, self._comm_device(), self.world_size,
                                          "a compressed deferred (ICS) payload",
                                          self._ics_exchange.compressor.name,
                                          "the deferred layers are not corrected on any rank.")
        if self._ics_error_feedback:
            pending.residual = error_feedback_residual(p, sent, in_place=False)
        pending.flat = mean.to(p.dtype).reshape(-1)
        pending.bytes_sent, pending.bytes_payload = int(times.bytes_sent), int(times.bytes_payload)

    def _apply_pending(self, timeout: float | None = None) -> bool:
        pending = self._pending
        if pending is None:
            return True
        t0 = time.perf_counter()
        if not self._runner.drain(timeout):
            return False
        self._pending = None
        self._stats.ics_wait_s = time.perf_counter() - t0
        self._stats.ics_comm_s = pending.comm_s
        if pending.error is not None:
            raise RuntimeError(
                f"lightning_gc OSP: the deferred (ICS) allreduce of step {pending.step} failed on this rank "
                f"({pending.error!r}); the deferred layers cannot be corrected."
            ) from pending.error
        if self._ics_exchange is not None:
            self.engine.add_deferred_traffic(pending.bytes_sent, pending.bytes_payload)
            self.deferred_bytes_sent += pending.bytes_sent
        grads, offset = [], 0
        for pid in pending.pids:
            grads.append(pending.flat[offset:offset + self.numels[pid]].view_as(self.params[pid]))
            if pending.residual is not None:  # into the layer's next deferred send
                r = pending.residual[offset:offset + self.numels[pid]].view_as(self.params[pid])
                self._carry[pid] = self._carry[pid] + r if pid in self._carry else r.clone()
            offset += self.numels[pid]
        self._stats.correction_norm = pending.snapshot.replay(grads)
        for pid, e, g in zip(pending.pids, pending.snapshot.entries, grads):
            if e is not None:
                self.importance[pid] = layer_importance(g, e.p0)
        return True

    def _round_sums(self) -> list[float]:
        losses, tc = self._round.losses, self._round.tc
        half = losses[len(losses) // 2:]
        return [sum(losses), float(len(losses)), sum(half), float(len(half)), sum(tc), float(len(tc))]

    def _end_round(self, sums: list[float]) -> None:
        loss_sum, n_loss, recent_sum, n_recent, tc_sum, n_tc = sums
        self._round = _Round()
        mean = loss_sum / n_loss if n_loss else math.nan
        recent = recent_sum / n_recent if n_recent else math.nan
        net = self._network_model()
        elem = self.params[0].element_size()
        if n_tc:
            tc = tc_sum / n_tc
            umax = ring_umax(tc, net.alpha_s, net.beta_s_per_byte, self.world_size, elem) if net is not None else 0.0
        else:  # no step of the round was timed (each followed a drain): the previous bound stays
            umax = self.schedule.umax if self.schedule.umax is not None else 0.0
        self.schedule.end_round(mean, recent, umax)

    def _network_model(self) -> Any:
        """The engine's link observer's model; if it holds none yet (the engine keeps no model and no
        client probed), one probe on OSP's group, whose result every client of the observer reads."""
        link = cast(LinkPort, self.engine).link
        if link.model is None and self.world_size > 1:
            link.refresh(self.engine.step, self.control, self._comm_device(), OSP_PROBE)
        return link.model

    @property
    def probed_network(self) -> Any:
        """The model OSP's bound reads (the link observer's; None before any)."""
        return cast(LinkPort, self.engine).link.model

    def _choose_split(self) -> None:
        budget = self.schedule.budget_for_step(self.step) if self.world_size > 1 else 0
        deferred, self.threshold = rank_split(self.importance, self.numels, budget)
        if deferred != self.deferred:
            self._carry_memory(deferred - self.deferred)
            self.deferred = deferred
            keep = frozenset(range(len(self.params))) - deferred
            self._plan_control.replace_plan(filter_plan(self.base_plan, keep), verify=False)

    def _carry_memory(self, joining: frozenset[int]) -> None:
        """A layer leaving the routine stage takes its error memory (what the compressor has not
        sent yet) into its next deferred allreduce instead of dropping it: the global gradient then
        includes it, exactly as a dense send of ``g + e`` under error feedback would."""
        if not joining or not self.engine.error_feedback:
            return
        memory = self.engine.error_memory_by_name()  # per-name CPU copies
        for pid in joining:
            e = memory.get(self.names[pid])
            if e is not None:
                e = e.to(self.params[pid].device).view_as(self.params[pid])
                self._carry[pid] = self._carry[pid] + e if pid in self._carry else e
                self.carried_layers += 1

    # ------------------------------------------------------------------ rollback snapshot
    def snapshot(self) -> dict:
        """Exact copy of OSP's state at a step boundary, the ICS work in flight included.

        The pending deferred exchange is waited for but **not** applied: applying it would correct
        the deferred layers before the next forward instead of after the next backward, and the run
        would differ from one that never took the snapshot. Its result (the global gradients, the
        LGP snapshot, the residual) is not changed by being applied, so the same object is put back
        by :meth:`restore` (the replay reads the optimizer's state when it runs, so an optimizer
        restored from a ``state_dict`` is seen)."""
        if self._pending is not None and not self._runner.drain():
            raise RuntimeError("lightning_gc OSP: the deferred exchange did not finish for a snapshot")
        return {
            "state": self.state_dict(),
            "pending": self._pending,
            "last_stats": self.last_stats,
            "carried_layers": self.carried_layers,
        }

    def restore(self, snapshot: dict) -> None:
        self._runner.drain()
        self.load_state_dict(snapshot["state"])
        self._pending = snapshot["pending"]
        self._captured.clear()
        self._carry_used = {}
        self._snapshot = None
        self.last_stats = snapshot["last_stats"]
        self.carried_layers = snapshot["carried_layers"]
        # the compute-time sample of the next step would include the exploration: leave it out
        self._t_opt_end = None

    # ------------------------------------------------------------------ checkpoint state
    def state_dict(self) -> dict:
        """This rank's OSP state (call after :meth:`drain`: nothing is in flight)."""
        return {
            "version": 1,
            "step": self.step,
            "importance": list(self.importance),
            "deferred": [self.names[i] for i in sorted(self.deferred)],
            "threshold": self.threshold,
            "schedule": self.schedule.state_dict(),
            "round_losses": list(self._round.losses),
            "round_tc": list(self._round.tc),
            "carry": {self.names[pid]: t.detach().cpu().clone() for pid, t in self._carry.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != 1:
            raise ValueError(f"unsupported OSP state version {state.get('version')!r} (this version reads 1)")
        if len(state["importance"]) != len(self.params):
            raise ValueError(
                f"the checkpoint's OSP state has {len(state['importance'])} layers, the model {len(self.params)}: "
                "resume with the same model."
            )
        self.step = int(state["step"])
        self.importance = [float(v) for v in state["importance"]]
        self.threshold = float(state.get("threshold", -1.0))
        self.schedule.load_state_dict(state.get("schedule") or {})
        self._round = _Round(list(state.get("round_losses", [])), list(state.get("round_tc", [])))
        index = {n: i for i, n in enumerate(self.names)}
        self._carry = {index[n]: t.to(self.params[index[n]].device).view_as(self.params[index[n]])
                       for n, t in (state.get("carry") or {}).items()}
        deferred = frozenset(index[n] for n in state.get("deferred", []))
        self.deferred = deferred
        keep = frozenset(range(len(self.params))) - deferred
        self._plan_control.replace_plan(filter_plan(self.base_plan, keep), verify=False)


def osp_comm_hook(osp: OSPSync, bucket: dist.GradBucket) -> torch.futures.Future:
    """DDP communication hook for OSP without a step session (unit tests):
    ``ddp_model.register_comm_hook(osp, osp_comm_hook)``. The strategy uses the session's hook."""
    osp.on_bucket(bucket)
    return osp.engine.on_bucket(bucket)


osp_comm_hook.__annotations__ = {
    "osp": OSPSync,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}
