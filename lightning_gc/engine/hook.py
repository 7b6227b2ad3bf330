"""The engine: what runs inside DDP's communication hook on every optimizer step.

Per step, DDP hands us its gradient buckets one at a time, in bucket order, identically on every
rank. For each bucket the engine records which parameters' gradients have arrived; as soon as
every parameter of a plan group has arrived it runs, for that group,

    p = g + e                               (error feedback; e starts at zero)
    [nonfinite?, carried stats] ← allreduce (tiny; rank agreement on non-finite gradients)
    mean, sent = exchange(p)                (compress → collective → decompress → mean)
    e ← p − sent

writes ``mean`` into the gradients' slots of their buckets, and completes every bucket Future
whose groups are all done. The last bucket of a step closes the step (statistics, step counter).

Dense steps (warm-up, the dense compressor, plans with nothing to compress) take a fast path that
is DDP's own hook: per-bucket asynchronous allreduce of ``bucket / N``, overlapping with the rest
of backward exactly like DDP. Compressed groups run their collectives synchronously inside the
hook (the caller is the autograd thread); a group's communication therefore overlaps only with
the gradients computed *before* it is complete, not after. This is documented in docs/concepts.md.

Every decision that changes communication — dense vs compressed step, plan, k, randomness — is a
function of replicated values (the step counter, the plan built from identical parameter lists,
all-reduced flags), so all ranks issue the same collectives in the same order with the same sizes.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..comm.artopk import NetworkState
from ..comm.collectives import ring_allreduce_bytes
from ..comm.cost_model import NetworkModel
from ..comm.exchange import AllreduceExchange, ExchangeTimes, SparseSent, Timer, make_exchange
from ..comm.probe import ProbeConfig, ProbePolicy, probe_network
from ..compressors.base import Compressor, GroupContext
from ..compressors.dense import DenseCompressor
from .config import EngineConfig
from .plans import Plan, build_plan
from .state import StepStats, Totals

STATE_VERSION = 1


class _PendingBucket:
    __slots__ = ("future", "buffer", "groups")

    def __init__(self, future: torch.futures.Future, buffer: Tensor, groups: set[int]) -> None:
        self.future = future
        self.buffer = buffer
        self.groups = groups


class GCEngine:
    """State of the communication hook: plan, compressor, error memory, counters, statistics.

    Build it after DDP has wrapped the module (parameters must not move afterwards) and register it
    with :func:`gc_comm_hook`. All ranks must build it with identical arguments; the constructor
    verifies the plan is the same everywhere and fails fast naming the ranks that differ.
    """

    def __init__(
        self,
        compressor: Compressor,
        config: EngineConfig,
        named_parameters: list[tuple[str, Tensor]],
        process_group: Any = None,
        verify_plan: bool = True,
    ) -> None:
        self.compressor = compressor
        self.config = config
        self.process_group = process_group
        self.names = [n for n, _ in named_parameters]
        self.params = [p for _, p in named_parameters]
        if not self.params:
            raise ValueError("the model has no trainable parameters; there is nothing to communicate")
        self.distributed = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size(process_group) if self.distributed else 1
        self.rank = dist.get_rank(process_group) if self.distributed else 0
        self.device = self.params[0].device
        self.plan: Plan = build_plan(
            self.names,
            [p.numel() for p in self.params],
            kind=config.plan,
            threshold=config.plan_threshold,
            min_compress_numel=config.min_compress_numel,
            compress=compressor.lossy,
        )
        self._group_of = self.plan.group_of()
        self._pid_of_ptr = {p.data_ptr(): i for i, p in enumerate(self.params)}
        self.exchange = make_exchange(compressor, config.collective, process_group)
        self.exact_exchange = AllreduceExchange(DenseCompressor(), process_group)
        self.all_exact = all(g.exact for g in self.plan.groups)
        self.error_feedback = bool(config.error_feedback) and compressor.lossy
        # network model: pinned by the user, or measured in-band by the probe when an exchange
        # needs it (the model-chosen collective). Replicated: pinned values are arguments every
        # rank receives, probed values are agreed by the probe (MAX over ranks).
        pinned = config.network_alpha_s is not None
        self.network = NetworkState(
            NetworkModel(config.network_alpha_s, config.network_beta_s_per_byte) if pinned else None, pinned
        )
        if hasattr(self.exchange, "network"):
            self.exchange.network = self.network
        needs_probe = hasattr(self.exchange, "network") and not pinned and self.world_size > 1
        self.probe_policy = (
            ProbePolicy(config.probe_every, config.probe_drift, config.probe_patience, probe_at_start=True)
            if needs_probe else None
        )
        self.probe_config = ProbeConfig(sizes_bytes=(64, 65536, 1048576, 4194304), warmup=2, repeats=7)
        self._meas_carry: tuple[float, float] | None = None  # (exchange comm s, predicted s), prev step
        self.memory: dict[int, Tensor] = {}
        self._mem_sq: dict[int, float] = {}  # ‖e‖² per group, maintained with the memory
        self.step = 0
        self.gain_ewma: float | None = None
        self.last_step: StepStats | None = None
        self.last_step_nonfinite = False
        self._totals = Totals()
        self.hook_calls = 0
        # (Σ‖sent‖², Σ‖p‖²) of the previous compressed step on this rank; travels with the next
        # step's stats allreduce so the gain is averaged over ranks without a collective of its own
        self._carry: tuple[float, float] | None = None
        self._step_open = False
        self._dense_bytes_per_step = ring_allreduce_bytes(
            sum(p.numel() * p.element_size() for p in self.params), self.world_size
        )
        if verify_plan and self.world_size > 1:
            self._verify_identical(self.signature())

    # ------------------------------------------------------------------ setup helpers
    def signature(self) -> str:
        return f"{self.plan.signature()}|{self.compressor.describe()}|{self.exchange.name}|{self.config}"

    def _verify_identical(self, sig: str) -> None:
        sigs: list[Any] = [None] * self.world_size
        dist.all_gather_object(sigs, sig, group=self.process_group)
        if len(set(sigs)) > 1:
            by_sig: dict[str, list[int]] = {}
            for r, s in enumerate(sigs):
                by_sig.setdefault(s, []).append(r)
            raise RuntimeError(
                "lightning_gc: ranks built different communication plans and would deadlock. Ranks "
                f"grouped by plan: {list(by_sig.values())}. Every rank must construct the same model "
                "(same parameter names, shapes and requires_grad) and the same GCStrategy arguments."
            )

    # ------------------------------------------------------------------ public API
    def totals(self) -> dict:
        """Cumulative per-rank counters since the start of training (snapshot)."""
        return self._totals.as_dict()

    def step_is_dense(self) -> bool:
        return self.all_exact or self.world_size == 1 or self.step < self.config.warmup_steps

    def error_norm(self) -> float:
        """‖e‖₂ over all groups' error memory (kept up to date per group, no extra pass)."""
        for gid, m in self.memory.items():
            if gid not in self._mem_sq:  # e.g. restored from a checkpoint
                self._mem_sq[gid] = float(m.float().pow(2).sum())
        return math.sqrt(sum(self._mem_sq[g] for g in self.memory))

    # ------------------------------------------------------------------ the hook
    def on_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future:
        self.hook_calls += 1
        if not self._step_open:
            self._begin_step()
        buffer = bucket.buffer()
        if self.world_size == 1:
            fut = self._completed(buffer)
        elif self._dense_step:
            fut = self._dense_bucket(buffer)
        else:
            fut = self._compressed_bucket(bucket, buffer)
        if bucket.is_last():
            self._end_step()
        return fut

    def _completed(self, buffer: Tensor) -> torch.futures.Future:
        fut = self._new_future(buffer)
        fut.set_result(buffer)
        return fut

    def _new_future(self, buffer: Tensor) -> torch.futures.Future:
        if buffer.is_cuda:
            return torch.futures.Future(devices=[buffer.device])
        return torch.futures.Future()

    def _begin_step(self) -> None:
        self._step_open = True
        self._dense_step = self.step_is_dense()
        self._stats = StepStats(step=self.step, dense=self._dense_step,
                                ratio=1.0 if self._dense_step else float(self.compressor.ratio))
        self._times = ExchangeTimes()
        self._nonfinite = False
        self._views: dict[int, Tensor] = {}
        self._remaining = {g.gid: len(g.param_ids) for g in self.plan.groups}
        self._done: set[int] = set()
        self._pending: list[_PendingBucket] = []
        self._first_stats_sent = False
        self._step_sent2 = 0.0
        self._step_p2 = 0.0
        self._exchange_comm_s = 0.0

    def _dense_bucket(self, buffer: Tensor) -> torch.futures.Future:
        """DDP's own hook: async allreduce of bucket / N (same numerics as DDP without a hook)."""
        t0 = time.perf_counter()
        nbytes = buffer.numel() * buffer.element_size()
        self._times.bytes_sent += ring_allreduce_bytes(nbytes, self.world_size)
        self._times.bytes_payload += nbytes
        buffer.div_(self.world_size)
        fut = dist.all_reduce(buffer, group=self.process_group, async_op=True).get_future()
        stats = self._stats

        totals = self._totals

        def done(f: torch.futures.Future) -> Tensor:
            out = f.value()[0]
            dt = time.perf_counter() - t0
            stats.comm_time_s += dt  # the step was closed at the last bucket's call; keep both current
            totals.comm_time_s += dt
            if not bool(torch.isfinite(out).all()):
                stats.nonfinite = True
                self.last_step_nonfinite = True
            return out

        return fut.then(done)

    def _compressed_bucket(self, bucket: dist.GradBucket, buffer: Tensor) -> torch.futures.Future:
        fut = self._new_future(buffer)
        pending = _PendingBucket(fut, buffer, set())
        ready = []
        for p, g in zip(bucket.parameters(), bucket.gradients()):
            pid = self._pid_of_ptr.get(p.data_ptr())
            if pid is None:
                raise RuntimeError(
                    "lightning_gc: DDP handed the hook a parameter the engine does not know (shape "
                    f"{tuple(p.shape)}). Parameters must not be added, re-created or moved after the "
                    "strategy has set up the model."
                )
            self._views[pid] = g
            gid = self._group_of[pid]
            pending.groups.add(gid)
            self._remaining[gid] -= 1
            if self._remaining[gid] == 0:
                ready.append(gid)
        self._pending.append(pending)
        for gid in sorted(ready):
            self._process_group(gid)
        still = []
        for pb in self._pending:
            if pb.groups <= self._done:
                pb.future.set_result(pb.buffer)
            else:
                still.append(pb)
        self._pending = still
        return fut

    def _process_group(self, gid: int) -> None:
        group = self.plan.groups[gid]
        views = [self._views.pop(pid) for pid in group.param_ids]
        flat = torch.cat([v.reshape(-1) for v in views])
        ctx = GroupContext(step=self.step, rank=self.rank, world_size=self.world_size,
                           segments=group.numels, group_id=gid, seed=self.config.seed, device=flat.device)
        timer = Timer(flat.device, self._times)
        if group.exact:
            mean, _ = self.exact_exchange.run(flat, ctx, timer)
            if not bool(torch.isfinite(mean).all()):  # identical on all ranks after the sum
                self._nonfinite = True
        else:
            mean = self._process_lossy(gid, flat, ctx, timer)
        offset = 0
        for v, n in zip(views, group.numels):
            v.copy_(mean[offset:offset + n].view_as(v))
            offset += n
        self._done.add(gid)

    def _process_lossy(self, gid: int, flat: Tensor, ctx: GroupContext, timer: Timer) -> Tensor:
        mem = self.memory.get(gid)
        p = flat + mem if (self.error_feedback and mem is not None) else flat
        first = not self._first_stats_sent
        if self.config.check_finite or self.probe_policy is not None:
            carry = self._carry if first else None
            meas = self._meas_carry if first else None
            p2 = float(p.float().pow(2).sum())  # needed for the gain anyway; NaN/inf propagate
            local_bad = 0.0 if math.isfinite(p2) or bool(torch.isfinite(p).all()) else 1.0
            stats = torch.tensor(
                [local_bad, float(carry is not None), *(carry or (0.0, 0.0)),
                 float(meas is not None), *(meas or (0.0, 0.0))],
                dtype=torch.float64, device=flat.device,
            )
            timer.run("comm", lambda: dist.all_reduce(stats, group=self.process_group))
            self._times.bytes_sent += ring_allreduce_bytes(stats.numel() * 8, self.world_size)
            if first:
                self._first_stats_sent = True
                self._carry = None
                self._meas_carry = None
                if float(stats[1]) > 0:  # carried values are identical in presence on all ranks
                    self._record_gain(float(stats[2]), float(stats[3]))
                if self.probe_policy is not None:
                    has = float(stats[4]) > 0
                    measured = float(stats[5]) / self.world_size if has else None  # mean over ranks
                    predicted = float(stats[6]) / self.world_size if has else None  # replicated anyway
                    if self.probe_policy.update(self.step, measured, predicted):
                        self._run_probe()
            if float(stats[0]) > 0:
                self._nonfinite = True
                return torch.full_like(flat, float("nan"))
        else:
            p2 = float(p.float().pow(2).sum())
        c0 = self._times.comm_s
        mean, sent = self.exchange.run(p, ctx, timer)
        self._exchange_comm_s += self._times.comm_s - c0
        self._step_p2 += p2
        if isinstance(sent, SparseSent):  # sent == p at these indices: residual = p with them zeroed
            sent2 = float(sent.values.float().pow(2).sum())
            if self.error_feedback:
                # p is a fresh tensor (torch.cat / the sum above always allocate): reuse it in place
                self.memory[gid] = p.index_fill_(0, sent.indices.long(), 0)
                self._mem_sq[gid] = max(p2 - sent2, 0.0)  # ‖e‖² exactly, without another pass
        else:
            sent2 = float(sent.float().pow(2).sum())
            if self.error_feedback:
                self.memory[gid] = p - sent
                self._mem_sq[gid] = float(self.memory[gid].float().pow(2).sum())
        self._step_sent2 += sent2
        return mean

    def _run_probe(self) -> None:
        """Measure alpha/beta in-band (a collective: every rank decided identically to call it)."""
        t0 = time.perf_counter()
        result = probe_network(self.process_group, self.probe_config, device=self.device)
        self.network.model = result.network
        self.network.probes += 1
        self._stats.probe_s += time.perf_counter() - t0

    def _record_gain(self, sent2: float, p2: float) -> None:
        gain = sent2 / p2 if p2 > 0 else 1.0
        self._stats.gain = gain
        b = self.config.gain_ewma_beta
        self.gain_ewma = gain if self.gain_ewma is None else b * self.gain_ewma + (1 - b) * gain
        self._stats.gain_ewma = self.gain_ewma

    def _end_step(self) -> None:
        if self._pending:
            missing = sorted(set().union(*(pb.groups for pb in self._pending)) - self._done)
            raise RuntimeError(
                f"lightning_gc: step {self.step} ended with plan groups {missing} incomplete; some "
                "parameters' gradients never reached the hook. This happens when parameters are "
                "unused in forward: pass find_unused_parameters=True to the strategy."
            )
        s = self._stats
        s.nonfinite = s.nonfinite or self._nonfinite
        self.last_step_nonfinite = s.nonfinite
        if not self._dense_step:
            if self._step_p2 > 0 and not s.nonfinite:
                self._carry = (self._step_sent2, self._step_p2)
            if not self.config.check_finite and self._step_p2 > 0:
                self._record_gain(self._step_sent2, self._step_p2)  # local estimate only
        s.exchange_comm_s = self._exchange_comm_s
        s.full_precision = self._times.extra.get("full_precision")
        choices = self._times.extra.get("choices")
        if choices:
            s.collective = "+".join(sorted(set(choices)))
            s.predicted_comm_s = self._times.extra.get("predicted_comm_s")
            if s.predicted_comm_s is not None and not s.nonfinite:
                self._meas_carry = (self._exchange_comm_s, s.predicted_comm_s)
        if self.network.model is not None:
            s.alpha_s = self.network.model.alpha_s
            s.beta_s_per_byte = self.network.model.beta_s_per_byte
        s.bytes_sent += self._times.bytes_sent
        s.bytes_payload += self._times.bytes_payload
        s.bytes_dense = self._dense_bytes_per_step if self.world_size > 1 else 0
        s.compress_time_s += self._times.compress_s
        s.comm_time_s += self._times.comm_s
        s.error_norm = self.error_norm() if self.error_feedback else 0.0
        if s.gain_ewma is None:
            s.gain_ewma = self.gain_ewma
        self.last_step = s
        self._totals.add(s)
        self.step += 1
        self._step_open = False

    # ------------------------------------------------------------------ checkpoint state
    def state_dict(self) -> dict:
        """This rank's state; error memory keyed by parameter name (CPU tensors)."""
        memory: dict[str, Tensor] = {}
        for gid, mem in self.memory.items():
            g = self.plan.groups[gid]
            off = 0
            for name, n in zip(g.names, g.numels):
                memory[name] = mem[off:off + n].detach().cpu().clone()
                off += n
        return {
            "version": STATE_VERSION,
            "world_size": self.world_size,
            "rank": self.rank,
            "step": self.step,
            "memory": memory,
            "gain_ewma": self.gain_ewma,
            "carry": self._carry,
            "totals": self._totals.as_dict(),
            "plan": self.plan.signature(),
            "seed": self.config.seed,
            "network": None if self.network.model is None or self.network.pinned
            else (self.network.model.alpha_s, self.network.model.beta_s_per_byte),
            "probe_policy": self.probe_policy.state_dict() if self.probe_policy is not None else None,
            "meas_carry": self._meas_carry,
        }

    def load_state_dict(self, state: dict, restore_memory: bool = True) -> list[str]:
        """Restore from :meth:`state_dict`. Returns names whose memory was missing (reset to 0)."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"unsupported lightning_gc state version {state.get('version')!r}")
        self.step = int(state["step"])
        self.gain_ewma = state.get("gain_ewma")
        carry = state.get("carry")
        self._carry = tuple(carry) if carry is not None else None  # type: ignore[assignment]
        self._totals = Totals(**state.get("totals", {}))
        net = state.get("network")
        if net is not None and not self.network.pinned:
            self.network.model = NetworkModel(*net)
        if self.probe_policy is not None and state.get("probe_policy") is not None:
            self.probe_policy.load_state_dict(state["probe_policy"])
        meas = state.get("meas_carry")
        self._meas_carry = tuple(meas) if meas is not None else None  # type: ignore[assignment]
        missing: list[str] = []
        self.memory = {}
        self._mem_sq = {}
        if not restore_memory:
            return missing
        saved = state.get("memory", {})
        if not saved:  # nothing compressed yet when the checkpoint was written
            return missing
        for g in self.plan.groups:
            if g.exact:
                continue
            parts = []
            for name, n, pid in zip(g.names, g.numels, g.param_ids):
                t = saved.get(name)
                if t is None or t.numel() != n:
                    missing.append(name)
                    t = torch.zeros(n, dtype=self.params[pid].dtype)
                parts.append(t.to(dtype=self.params[pid].dtype))
            self.memory[g.gid] = torch.cat(parts).to(self.device)
        return missing


def gc_comm_hook(engine: GCEngine, bucket: dist.GradBucket) -> torch.futures.Future:
    """DDP communication hook: ``ddp_model.register_comm_hook(engine, gc_comm_hook)``."""
    return engine.on_bucket(bucket)


# DDP inspects the hook's annotations and rejects string annotations (this module uses postponed
# evaluation), so give it the real objects.
gc_comm_hook.__annotations__ = {
    "engine": GCEngine,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}
