"""The step-time and progress model behind ``compressor="auto"`` and ``lightning-gc advise``.

Pure functions of measured inputs, so the live chooser, the offline advisor and the tests share one
definition, and every rank computes the same choice from the same agreed numbers.

**Inputs**: a :class:`Workload` (forward, each gradient's backward time in ready order, optimizer,
and ``other_s``, whatever a measured step holds beyond the model, calibrated on the dense warm-up:
:func:`calibrate_other`), a :class:`~lightning_gc.comm.cost_model.NetworkModel`, the world size ``N``,
and one :class:`MethodCost` per candidate (codec time, bytes per rank, wire format, error ``delta2``).

**Step time** (:func:`predict`). ``ddp``/``fp16``/``bf16`` run on DDP's buckets: tensors in ready order
are cut into DDP's buckets, and each bucket's ring allreduce starts when its last tensor is ready and
the previous bucket's allreduce has ended, so communication overlaps backward. Every compressor runs in
the engine with one group after backward: codec + its collective + the closing report + the exact
tensors' allreduce, each allreduce charged for the algorithm the engine takes for its size
(:func:`lightning_gc.comm.direct.allreduce_seconds`). ``step = forward + max(backward end, last
exchange end) + optimizer + other + overhead``, where ``overhead`` is the method's measured correction.

**Progress** (:func:`efficiency`): ``delta2 = ‖C(g) − g‖² / ‖g‖²`` on a live gradient (divided by ``N``
for methods without error feedback, whose errors average out), and
``efficiency = 1 / (1 + progress_weight · delta2)``; time per unit of progress = step / efficiency.
``progress_weight = 0`` ranks by step time alone; raise it if lossy picks need many more steps than
they save (docs/auto.md says how the default was fitted).

**Choice** (:func:`choose`): the least time per unit of progress, ties to the earlier candidate. The
live chooser decides with :func:`choose_measured`: measured methods with their corrections, unmeasured
ones by the raw (optimistic) model lowered by :func:`compute_shift`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields

from ..comm import cost_model
from ..comm.cost_model import NetworkModel
from ..comm.direct import allgather_seconds, allreduce_seconds
from ..comm.link import solve_beta
from ..engine.agreement import RiddenReport, StepReport

#: candidates that run on DDP's own bucket path (the value: bytes per element on the wire)
BUCKET_MODES: dict[str, int] = {"ddp": 4, "fp16": 2, "bf16": 2}
#: DDP's defaults: the first bucket is small so that communication starts early
DDP_FIRST_BUCKET_BYTES = 1024 * 1024
DDP_BUCKET_BYTES = 25 * 1024 * 1024
#: the engine's per-step control message on a compressed step: the closing report, one float64 per field
ENGINE_CONTROL_BYTES = 8 * len(fields(StepReport))
#: the same report riding in lowrank's last message (fp32 elements: an upper bound for bfloat16 messages)
RIDDEN_CONTROL_BYTES = 4 * RiddenReport.numel()

#: ``w`` of the progress proxy ``1/(1 + w·delta2)`` by default: fitted to the steps to a target that
#: lossy methods needed against dense ones on the bench (docs/auto.md). With it, a method that sends
#: half the gradient's energy (``delta2 = 0.5``) must take under half the exact step to be picked
DEFAULT_PROGRESS_WEIGHT = 2.0


@dataclass(frozen=True)
class Workload:
    """Measured compute of one training step (seconds), and the gradient tensors in ready order."""

    forward_s: float
    backward_s: tuple[float, ...]
    numels: tuple[int, ...]
    optimizer_s: float = 0.0
    other_s: float = 0.0

    def __post_init__(self) -> None:
        if len(self.backward_s) != len(self.numels) or not self.numels:
            raise ValueError(f"Workload needs one backward time per tensor and at least one tensor; got "
                             f"{len(self.backward_s)} times for {len(self.numels)} tensors.")
        for name in ("forward_s", "optimizer_s", "other_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"Workload.{name}={v!r} must be a finite number of seconds >= 0.")
        if any(not (math.isfinite(t) and t >= 0) for t in self.backward_s):
            raise ValueError("Workload.backward_s must hold finite times >= 0.")
        if any(int(n) < 1 for n in self.numels):
            raise ValueError("Workload.numels must be positive element counts.")

    @property
    def backward_total_s(self) -> float:
        return float(sum(self.backward_s))

    @property
    def numel(self) -> int:
        return int(sum(self.numels))

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class MethodCost:
    """What one candidate costs on this machine for this model's gradient.

    Attributes:
        name: the candidate's name (``"ddp"``, ``"fp16"``, ``"topk"``, ...).
        wire: how its bytes travel: ``"bucket"`` (DDP's bucketed allreduce), ``"allreduce"``,
            ``"allgather"``, ``"lowrank"`` (two allreduces), ``"sparse"`` (AR-Topk: the cheapest
            of allgather / ART-Ring / ART-Tree by the cost model) or ``"lowbit"`` (the k-bit P2P ring).
        codec_s: seconds per step of compression, aggregation and decompression on one rank.
        payload_bytes: bytes each rank contributes per step (bucket modes: 0, computed from
            ``numels``); for ``"sparse"``: ``4 * numel`` of the compressed group is ``M``.
        delta2: relative squared error of what is sent (0 for exact methods), before any ``/N``.
        error_feedback: whether the method keeps an error memory (its error is then not divided
            by ``N``: it is biased, not independent noise).
        sparse_ratio, value_bytes: AR-Topk only: kept fraction and bytes per value.
        exact_bytes: bytes of the small tensors the engine sends exactly beside the group (for the
            ``"lowrank"`` wire in its message type: they ride in its ``P`` message).
        overhead_s: measured per-step time of this method's path beyond the model (signed; the live
            chooser sets it per method from the method's first measured window, see
            :func:`choose_measured`). Without it (or with a positive one) the predicted step never
            drops below the profiled compute; a negative one is a measured step and is not floored.
        codec_timed: whether ``codec_s`` was measured. ``False``: not timed yet, ``codec_s`` is 0, and
            the prediction is a lower bound (every prediction grows with ``codec_s``): the live
            chooser times a codec only when such a bound would win (``AutoConfig.time_codecs``).
    """

    name: str
    wire: str
    codec_s: float
    payload_bytes: float = 0.0
    delta2: float = 0.0
    error_feedback: bool = False
    sparse_ratio: float = 0.0
    value_bytes: float = 4.0
    exact_bytes: float = 0.0
    overhead_s: float = 0.0
    codec_timed: bool = True

    def __post_init__(self) -> None:
        if self.wire not in ("bucket", "allreduce", "allgather", "lowrank", "sparse", "lowbit"):
            raise ValueError(f"MethodCost.wire={self.wire!r} is not a wire format: use 'bucket', 'allreduce', "
                             "'allgather', 'lowrank', 'sparse' or 'lowbit'.")
        if self.wire == "bucket" and self.name not in BUCKET_MODES:
            raise ValueError(f"bucket candidate {self.name!r} is not one of {sorted(BUCKET_MODES)}.")
        for f in ("codec_s", "payload_bytes", "delta2", "exact_bytes"):
            v = getattr(self, f)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"MethodCost.{f}={v!r} for {self.name!r} must be finite and >= 0.")
        if not math.isfinite(self.overhead_s):
            raise ValueError(f"MethodCost.overhead_s={self.overhead_s!r} for {self.name!r} must be finite.")
        if not self.codec_timed and self.codec_s != 0.0:
            raise ValueError(f"MethodCost {self.name!r}: codec_s={self.codec_s!r} with codec_timed=False; an "
                             "untimed codec is charged 0 (its prediction is a lower bound).")

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Prediction:
    """One candidate's predicted step (seconds) and progress."""

    name: str
    step_s: float
    compute_s: float
    codec_s: float
    comm_s: float
    exposed_s: float  # step − compute − other: the communication and codec time not hidden by backward
    efficiency: float
    time_per_progress_s: float
    details: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


#: floor of a prediction with a negative (measured) correction
MIN_PREDICTED_STEP_S = 1e-4


def ddp_buckets(numels: Sequence[int], first_bucket_bytes: int = DDP_FIRST_BUCKET_BYTES,
                bucket_bytes: int = DDP_BUCKET_BYTES) -> list[int]:
    """Bucket sizes in tensors, in ready order: a bucket closes once its fp32 bytes reach its cap
    (the first bucket's cap is ``first_bucket_bytes``, later ones ``bucket_bytes``)."""
    out: list[int] = []
    count, size, cap = 0, 0, first_bucket_bytes
    for n in numels:
        count += 1
        size += 4 * int(n)
        if size >= cap:
            out.append(count)
            count, size, cap = 0, 0, bucket_bytes
    if count:
        out.append(count)
    return out


def comm_seconds(cost: MethodCost, network: NetworkModel, world_size: int, numel: int) -> float:
    """Seconds the candidate's collective needs for its payload (engine candidates only)."""
    a, b, n, B = network.alpha_s, network.beta_s_per_byte, world_size, cost.payload_bytes
    if cost.wire == "allreduce":
        return allreduce_seconds(network, B, n)
    if cost.wire == "allgather":
        return allgather_seconds(network, B, n)
    if cost.wire == "lowbit":  # always the P2P ring (its hops requantise)
        return cost_model.lowbit_ring_cost(a, b, B, n)
    if cost.wire == "lowrank":  # P, then Q: two allreduces sharing the payload
        return 2 * allreduce_seconds(network, B / 2, n)
    if cost.wire == "sparse":
        return min(cost_model.sparse_collective_costs(a, b, 4.0 * numel, n, cost.sparse_ratio,
                                                      cost.value_bytes).values())
    raise ValueError(f"comm_seconds: {cost.name!r} runs on DDP's buckets; use predict().")


def efficiency(cost: MethodCost, world_size: int, progress_weight: float) -> float:
    """Progress of one step relative to an exact step: ``1 / (1 + w · delta2')`` with ``delta2' =
    delta2`` for error-feedback methods and ``delta2 / N`` for the others (see the module doc)."""
    if cost.wire == "lowbit":  # N roundings of growing partial sums, the worst case (equal gradients)
        from ..compressors.lowbit import ring_error_factor

        return 1.0 / (1.0 + float(progress_weight) * cost.delta2 * ring_error_factor(world_size))
    d2 = cost.delta2 if cost.error_feedback else cost.delta2 / max(int(world_size), 1)
    return 1.0 / (1.0 + float(progress_weight) * d2)


def predict(cost: MethodCost, workload: Workload, network: NetworkModel, world_size: int,
            progress_weight: float = 1.0, first_bucket_bytes: int = DDP_FIRST_BUCKET_BYTES,
            bucket_bytes: int = DDP_BUCKET_BYTES) -> Prediction:
    """Predicted step of one candidate (see the module docstring for the equations)."""
    w = workload
    n = int(world_size)
    bwd_end = w.backward_total_s
    compute = w.forward_s + bwd_end + w.optimizer_s
    a, b = network.alpha_s, network.beta_s_per_byte
    details: dict = {}
    if n == 1:
        comm_total, codec, end = 0.0, 0.0, bwd_end
    elif cost.wire == "bucket":
        per_elem = BUCKET_MODES[cost.name]
        total_elems = w.numel
        # DDP's own timeline: the engine's steady dense path adds no message of its own
        t_ready, t_net, i, comm_total = 0.0, 0.0, 0, 0.0
        sizes = ddp_buckets(w.numels, first_bucket_bytes, bucket_bytes)
        for size in sizes:
            t_ready += sum(w.backward_s[i:i + size])
            elems = sum(w.numels[i:i + size])
            # the cast of a 16-bit mode scales with the bucket's share of the model
            cast = cost.codec_s * elems / total_elems
            tc = cost_model.ring_allreduce_cost(a, b, per_elem * elems, n)
            t_net = max(t_ready, t_net) + cast + tc
            comm_total += tc
            i += size
        codec = cost.codec_s
        end = max(bwd_end, t_net)
        details["buckets"] = len(sizes)
    else:
        # the compressed group: the model without the small tensors sent exactly beside it
        # (only the sparse wire reads the element count, and it sends the small tensors in fp32)
        exact = 0.0
        if cost.wire == "lowrank":
            # P with the small tensors sent exactly (Exchange.carries_exact), then Q with the step's report
            # (Exchange.carries_report): two allreduces, each by the algorithm its size gets
            # (comm/direct.py); no latency of their own for the report and the exact tensors
            half = cost.payload_bytes / 2
            tc = (allreduce_seconds(network, half + cost.exact_bytes, n)
                  + allreduce_seconds(network, half + RIDDEN_CONTROL_BYTES, n))
            control = 0.0
        else:
            tc = comm_seconds(cost, network, n, max(w.numel - int(cost.exact_bytes // 4), 1))
            control = allreduce_seconds(network, ENGINE_CONTROL_BYTES, n)
            if cost.exact_bytes > 0:  # their own allreduce
                exact = allreduce_seconds(network, cost.exact_bytes, n)
        comm_total = tc + control + exact
        codec = cost.codec_s
        end = bwd_end + codec + comm_total
    step = w.forward_s + end + w.optimizer_s + w.other_s + cost.overhead_s
    # the raw model never predicts below the profiled compute; a negative correction is a measured step
    # (a settled step is faster than the profiled warm-up's): flooring it would make measured methods alike
    step = max(step, compute) if cost.overhead_s >= 0 else max(step, MIN_PREDICTED_STEP_S)
    eff = efficiency(cost, n, progress_weight)
    if not cost.codec_timed:
        details["lower_bound"] = True  # codec not timed: charged 0
    return Prediction(cost.name, step, compute, codec, comm_total, max(step - compute - w.other_s, 0.0), eff,
                      step / eff, details)


def choose(costs: Sequence[MethodCost], workload: Workload, network: NetworkModel, world_size: int,
           progress_weight: float = 1.0, **bucket_kw: int) -> tuple[str, dict[str, Prediction]]:
    """The candidate with the least predicted time per unit of progress, and every prediction.

    Ties go to the earlier candidate in ``costs``. Identical inputs give identical choices, so with
    agreed inputs every rank chooses alike."""
    if not costs:
        raise ValueError("choose() needs at least one candidate.")
    preds = {c.name: predict(c, workload, network, world_size, progress_weight, **bucket_kw) for c in costs}
    best = costs[0].name
    for c in costs[1:]:
        if preds[c.name].time_per_progress_s < preds[best].time_per_progress_s:
            best = c.name
    return best, preds


def choose_measured(costs: Sequence[MethodCost], corrections: Mapping[str, float], workload: Workload,
                    network: NetworkModel, world_size: int, progress_weight: float = 1.0, explore: bool = True,
                    shift_s: float = 0.0, settled: Collection[str] | None = None,
                    **bucket_kw: int) -> tuple[str, dict[str, Prediction]]:
    """:func:`choose` with what the run has measured: the live chooser's decision rule.

    A *measured* candidate (in ``corrections``: its measured step minus its raw prediction) is
    predicted with its own correction as ``overhead_s`` (a correction is per method: what one path
    adds says little about another's); an unmeasured one by the raw model, which leaves out time a
    real path adds and so is optimistic: a candidate better even so is worth one measured window.
    ``explore=True`` chooses among all candidates, ``explore=False`` among the measured ones (every
    candidate is still predicted, for the record).

    ``shift_s`` (``<= 0``, see :func:`compute_shift`) is added to the prediction of every candidate
    not in ``settled`` (the methods measured in a window of their own; ``None``: every name in
    ``corrections``), on top of its correction if it has one (``ddp``'s from the warm-up profile).
    The pool without exploration is unchanged: the names in ``corrections``."""
    eff = [dataclasses.replace(c, overhead_s=overhead_used(c.name, corrections, shift_s, settled)) for c in costs]
    preds = {c.name: predict(c, workload, network, world_size, progress_weight, **bucket_kw) for c in eff}
    pool = eff if explore else [c for c in eff if c.name in corrections]
    best, _ = choose(pool or eff, workload, network, world_size, progress_weight, **bucket_kw)
    return best, preds


def overhead_used(name: str, corrections: Mapping[str, float], shift_s: float,
                  settled: Collection[str] | None) -> float:
    """What :func:`choose_measured` adds to ``name``'s raw prediction: its correction if it was
    measured in a window of its own (``settled``; ``None``: every name in ``corrections``), else its
    correction (if any) plus ``shift_s``."""
    corr = float(corrections.get(name, 0.0))
    done = corrections if settled is None else settled
    return corr if name in done else corr + float(shift_s)


def compute_shift(settled_corrections: Sequence[float]) -> float:
    """The raw model's step shift for methods not yet measured in a window: the *least* speed-up
    among the methods that were (``min(0, max(corrections))``), 0 when none was measured or any of
    them ran at or above its prediction.

    Why: the raw model takes compute from the warm-up's profiled step, slower than a settled one
    (allocator and kernel warm-up, DDP's first buckets); judged by it, a method that would win can
    look too slow to try. That part of a correction is common to every method; the rest (a method's
    own unmodelled cost, the model's error on its communication) is not. The shift is the smallest
    speed-up that *every* measured method showed, so one method the model over-charged does not move
    the others; a positive correction is never shared. Unmeasured methods stay optimistic, so one the
    shifted model favours is measured next (``explore``)."""
    if not settled_corrections:
        return 0.0
    return min(0.0, max(float(c) for c in settled_corrections))


#: the dense warm-up step lowers the probed β by at most this factor (:func:`calibrate_beta`)
MIN_BETA_SCALE = 0.25


def calibrate_beta(measured_step_s: float, workload: Workload, ddp_cost: MethodCost, network: NetworkModel,
                   world_size: int, **bucket_kw: int) -> float:
    """The β (s/byte) at which the model's ``ddp`` step, with ``other_s = 0``, equals a measured dense
    (DDP) step that is *shorter* than the probed network predicts; the probed β when it is not.

    A DDP step shorter than the model gives it at the probed β is evidence that the link carried the
    step's bytes faster than the probe read it (the probe's messages are short and its β is the
    slowest rank's; a step's transfers are long). Solved by bisection (the prediction does not decrease with β) within
    ``[MIN_BETA_SCALE·β, β]``: never raised (a slow dense step is explained by ``other_s`` instead,
    :func:`calibrate_other`), and lowered by at most 4×, as a step faster than even that is more
    likely a profile that over-counts compute than a link 4× faster than probed."""
    hi = float(network.beta_s_per_byte)
    if hi <= 0.0:
        return hi
    lo = hi * MIN_BETA_SCALE
    # the unbounded solution, clamped to [lo, hi]: the prediction does not decrease with β, so the clamp
    # is the bounded solution (none at all: even β → 0 is too slow, so the lower bound)
    beta = beta_from_dense_step(measured_step_s, workload, ddp_cost, network.alpha_s, world_size, **bucket_kw)
    return lo if beta is None else min(max(beta, lo), hi)


def beta_from_dense_step(measured_step_s: float, workload: Workload, ddp_cost: MethodCost, latency_s: float,
                         world_size: int, latency_bytes: int = 0, **bucket_kw: int) -> float | None:
    """The β (s/byte) at which the model's ``ddp`` step, with ``other_s = 0``, equals a measured dense
    (DDP) step; ``None`` when no β does (the step is shorter than its compute and latency alone).
    α is ``latency_s − latency_bytes·β`` (a small message's measured time), at least 0, so the two
    are solved together.

    For a step that waited long on the network (``AutoConfig.dense_probe_s``): its several hundred
    kilobytes to megabytes per rank, sent while the step is timed anyway, measure the link better than
    a probe's shorter messages and cost nothing extra. Everything beyond compute is charged to the
    link, so β comes out slightly high by the step's framework time; per-method calibration corrects
    what that leaves. Solved by :func:`lightning_gc.comm.link.solve_beta` (the prediction does not
    decrease with β)."""
    base = Workload(workload.forward_s, workload.backward_s, workload.numels, workload.optimizer_s, 0.0)
    return solve_beta(lambda net: predict(ddp_cost, base, net, world_size, **bucket_kw).step_s,
                      measured_step_s, latency_s, latency_bytes)


def calibrate_other(measured_step_s: float, workload: Workload, ddp_cost: MethodCost, network: NetworkModel,
                    world_size: int, **bucket_kw: int) -> float:
    """``other_s`` that makes the model's ``ddp`` step equal a measured dense (DDP) step: the time a
    real step holds beyond forward, backward, optimizer and exposed communication (data loading,
    logging, framework overhead), never negative. Applied to every candidate alike."""
    base = Workload(workload.forward_s, workload.backward_s, workload.numels, workload.optimizer_s, 0.0)
    return max(float(measured_step_s) - predict(ddp_cost, base, network, world_size, **bucket_kw).step_s, 0.0)


def table(preds: Mapping[str, Prediction], chosen: str | None = None) -> str:
    """A plain-text table of predictions (milliseconds), the chosen one marked with ``*``; a candidate
    whose codec was not timed shows ``untimed`` and ``>=`` before its step and time per progress (lower
    bounds, see :attr:`MethodCost.codec_timed`)."""
    width = max([12] + [len(n) + 1 for n in preds])  # the mark and the longest name
    rows = [f"{'candidate':{width}s} {'step ms':>10s} {'compute':>9s} {'codec':>8s} {'comm':>9s} {'exposed':>9s} "
            f"{'effic.':>7s} {'ms/progress':>13s}"]
    for name, p in preds.items():
        mark = "*" if name == chosen else " "
        bound = ">=" if p.details.get("lower_bound") else ""
        codec = f"{'untimed':>8s}" if bound else f"{1e3 * p.codec_s:8.2f}"
        rows.append(f"{mark}{name:{width - 1}s} {bound + f'{1e3 * p.step_s:.2f}':>10s} {1e3 * p.compute_s:9.2f} {codec} "
                    f"{1e3 * p.comm_s:9.2f} {1e3 * p.exposed_s:9.2f} {p.efficiency:7.3f} "
                    f"{bound + f'{1e3 * p.time_per_progress_s:.2f}':>13s}")
    return "\n".join(rows)
