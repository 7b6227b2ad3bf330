"""``lightning-gc advise``: the ``compressor="auto"`` model offline, for a cluster you do not have yet.

Given a workload (a bench preset with its arguments, or ``package.module:factory``), a world size
``N`` and a link (bandwidth and per-message latency), it predicts every candidate's step with
:func:`lightning_gc.auto.model.choose` -- the same equations, the same candidates and the same
measurement functions as the live chooser (:mod:`lightning_gc.auto.chooser`) -- and names the pick.

**What is measured on this machine** (one process, no process group, the model on the CPU):

* the compute (:func:`profile_module`): ``skip_steps`` untimed then ``profile_steps`` timed training
  steps in a plain single-device Lightning ``Trainer``, timed as the chooser times its dense warm-up
  (forward, the moment each gradient is ready in backward, the optimizer), medians over the timed
  steps. A spread above :data:`SPREAD_WARN` between them means a busy host: advise warns
  (:func:`spread_warning`);
* the codec costs (:func:`measure_costs`): :func:`lightning_gc.auto.candidates.measure_method` on the
  last step's gradient, grouped like the engine's ``"model"`` plan. The aggregation is timed with
  ``min(N, TIMING_PAYLOADS)`` payloads (aggregating 1024 payloads on a CPU takes minutes); an
  allgather method's codec time is extrapolated to ``N`` by its per-payload slope. The error
  ``delta2`` is measured on the gradient; the model divides it by the real ``N`` (methods without
  error feedback).

**What the user gives instead** (:func:`override_workload`, ``codec_scale``): ``forward_ms``,
``backward_ms`` (the measured per-tensor profile is scaled to this total, so its shape is kept),
``optimizer_ms``, ``other_ms``, a factor on the measured compute (``compute_scale``) and one on every
measured codec time (``codec_scale``; a GPU's codec is 10-100x faster than this CPU's).

``compute_ms`` scales the measured forward, backward and optimizer to one total; ``model_params``
(with ``compute_ms``) replaces the workload altogether: nothing is trained (:func:`synthetic_profile`).

**Nodes.** ``ranks_per_node > 1``: every candidate is also predicted by nodes (``topology="nodes"``)
beside flat, with the link inside a node and the node's card between nodes
(:mod:`lightning_gc.bench.advise_nodes`; the byte and time model in :mod:`lightning_gc.comm.cost_model`).

**Limits.** The network is the alpha-beta model of :mod:`lightning_gc.comm.cost_model` (no
contention, two levels of links at most, no stragglers); compute and codec are this machine's unless
overridden; the progress proxy is the measured relative error of one gradient (docs/auto.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import logging
import math
import re
import statistics
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .._validation import check_int
from ..auto.candidates import (
    CANDIDATES,
    DEFAULT_CANDIDATES,
    AutoCandidate,
    candidate,
    measure_method,
    rank_payloads,
)
from ..auto.diloco_cost import DiLoCoCandidate, DiLoCoPrediction, predict_diloco
from ..auto.model import DEFAULT_PROGRESS_WEIGHT, MethodCost, Prediction, Workload, choose, table
from ..comm.cost_model import NetworkModel
from ..compressors import GroupContext, build_compressor
from ..compressors.timing import time_codec
from . import schedule
from .advise_nodes import Cluster, TopologyAdvice, check_ranks_per_node, compare, node_refusal, shard_of
from .workloads import WorkloadError, preset_arg, resolve_preset

__all__ = ["Advice", "AdviseError", "Profile", "PROFILE_STEPS", "SPREAD_WARN", "TIMING_PAYLOADS", "MAX_WORLD_SIZE",
           "advise", "aggregation_slope", "build_module", "build_parser", "compute_spread", "main", "measure_costs",
           "override_workload", "parse_bandwidth", "parse_candidates", "parse_count", "parse_latency", "profile_module",
           "run", "scale_costs", "spread_warning", "synthetic_profile"]

SCHEMA = "lightning_gc.advise/1"
#: payloads aggregated when timing a codec (``min(N, TIMING_PAYLOADS)``); beyond, allgather codecs are extrapolated
TIMING_PAYLOADS = 8
MAX_WORLD_SIZE = 1024
DEFAULT_LATENCY = "0.1ms"
#: the link between two ranks of a node when --ranks-per-node > 1 and --intra-bandwidth is not given:
#: a PCIe 4.0 x16 path (about 25 GB/s usable), the slowest link common inside GPU nodes. It is the
#: cautious choice: by nodes, the dense intra-node stages then cost the most. NVLink nodes are 10-30x
#: faster (e.g. --intra-bandwidth 2400gbit for 300 GB/s)
DEFAULT_INTRA_BANDWIDTH = "200gbit"
#: latency per message inside a node (a GPU-to-GPU copy's launch and synchronisation)
DEFAULT_INTRA_LATENCY = "10us"
#: the synthetic model of --model-params: square matrices of this side (a transformer's hidden size order)
SYNTHETIC_SIDE = 1024
#: elements of the synthetic gradient on which the codecs are measured, then scaled to --model-params
SYNTHETIC_SAMPLE = SYNTHETIC_SIDE ** 2
#: training steps timed by default: the medians need a few, and more show a host that is busy in some of them
PROFILE_STEPS = 5
#: the slowest timed step's compute over the fastest's above which advise warns that the host was busy
#: (the medians are then unreliable): rerun on a quiet host, with more --profile-steps, or give the figures
SPREAD_WARN = 2.0


class AdviseError(ValueError):
    """An input ``advise`` cannot use; the message names the value, the reason and the fix."""


# ---------------------------------------------------------------------------------------------- parsing
def parse_bandwidth(text: str, what: str = "--bandwidth") -> float:
    """``"100mbit"`` → 1e8 bits per second (the bench's rate syntax, :func:`lightning_gc.bench.schedule.parse_rate`).

    Unlike the bench, which shapes real links, any rate above the bench's shaping limit is accepted
    (a model needs no ``tc``): ``"800gbit"``, ``"2tbit"``. ``what``: the option named in errors."""
    try:
        return float(schedule.parse_rate(text, what=what, shaped=False))
    except schedule.ScheduleError as exc:
        raise AdviseError(str(exc)) from None


_LATENCY_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:e([+-]?[0-9]+))?\s*([a-zA-Zµ]*)\s*$")
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def parse_latency(text: str, what: str = "--latency") -> float:
    """``"0.5ms"`` → 5e-4 seconds per message (units ``s``, ``ms``, ``us``/``µs``, ``ns``; ``0`` alone is 0)."""
    m = _LATENCY_RE.match(text) if isinstance(text, str) else None
    if not m:
        raise AdviseError(f"{what} {text!r} is not a time: write a number and a unit ({', '.join(_TIME_UNITS)}), "
                          "e.g. 0.5ms or 50us (the one-way latency per message)")
    number, exp, unit = m.groups()
    value = float(number) * (10 ** int(exp) if exp else 1)
    if unit == "" and value == 0:
        return 0.0
    if unit.lower() not in _TIME_UNITS:
        raise AdviseError(f"{what} {text!r} has unit {unit!r}, which is not a time unit: use one of "
                          f"{', '.join(_TIME_UNITS)}, e.g. 0.5ms")
    seconds = value * _TIME_UNITS[unit.lower()]
    if not math.isfinite(seconds) or seconds > 10.0:
        raise AdviseError(f"{what} {text!r} = {seconds:g} s per message is not a network latency (at most 10 s); "
                          "write e.g. 0.5ms for a LAN or 50ms for a WAN")
    return seconds


def parse_candidates(text: str | Sequence[str]) -> tuple[str, ...]:
    """``"ddp,fp16,topk"`` → ``("ddp", "fp16", "topk")``, every name checked against ``CANDIDATES``."""
    names = [s.strip() for s in text.split(",")] if isinstance(text, str) else [str(s).strip() for s in text]
    names = [n for n in names if n]
    if not names:
        raise AdviseError(f"--candidates {text!r} names no method; give a comma-separated list of "
                          f"{', '.join(CANDIDATES)}, e.g. ddp,fp16,topk")
    for n in names:
        if n not in CANDIDATES:
            raise AdviseError(f"--candidates: {n!r} is not a candidate of compressor='auto'; valid: "
                              f"{', '.join(CANDIDATES)} (e.g. --candidates ddp,fp16,topk)")
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise AdviseError(f"--candidates {text!r} lists {dup} twice; name each method once")
    return tuple(names)


_COUNT_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([kKmMgGbBtT]?)\s*$")
_COUNT_UNITS = {"": 1, "k": 10 ** 3, "m": 10 ** 6, "g": 10 ** 9, "b": 10 ** 9, "t": 10 ** 12}


def parse_count(text: Any, what: str = "--model-params") -> int:
    """``"350M"`` → 350,000,000 (suffixes k, M, G or B, T; decimal); at least 1."""
    m = _COUNT_RE.match(text) if isinstance(text, str) else None
    value = float(m.group(1)) * _COUNT_UNITS[m.group(2).lower()] if m else 0.0
    if not m or not math.isfinite(value) or round(value) < 1:
        raise AdviseError(f"{what} {text!r} is not a number of parameters >= 1: write a count with an optional "
                          "suffix k, M, B (or G), T, e.g. --model-params 350M or 1.3B")
    return int(round(value))


def _check_world_size(world_size: Any) -> int:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or not 1 <= world_size <= MAX_WORLD_SIZE:
        raise AdviseError(f"--ranks {world_size!r} is out of range: the number of data-parallel ranks must be an "
                          f"integer from 1 to {MAX_WORLD_SIZE}, e.g. --ranks 64")
    return world_size


def _check_nonneg(flag: str, value: Any, example: str, positive: bool = False) -> float:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and (
        value > 0 if positive else value >= 0)
    if not ok:
        raise AdviseError(f"{flag} {value!r} must be a finite number {'> 0' if positive else '>= 0'}; e.g. {example}")
    return float(value)


# ---------------------------------------------------------------------------------------------- the workload
def build_module(preset: str, preset_args: dict[str, Any] | None = None, seed: int = 0) -> tuple[Any, Any, str]:
    """``(LightningModule, LightningDataModule, description)`` of a workload, loaded exactly as
    ``lightning-gc bench --preset`` loads it (:func:`lightning_gc.bench.workloads.resolve_preset`).
    Advise trains ``model`` on ``datamodule`` and reads nothing else of the preset."""
    args = dict(preset_args or {})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            w = resolve_preset(preset, seed=seed, **args)
        except (WorkloadError, ValueError) as exc:
            raise AdviseError(f"--preset {preset!r} with --preset-arg {args}: {exc}") from None
    return w.model, w.datamodule, preset


@dataclass
class Profile:
    """What :func:`profile_module` measured: the workload and the engine's compressed group."""

    workload: Workload
    flat: Tensor  # the compressed group's gradient, flattened as the engine does
    ctx: GroupContext
    exact_bytes: float  # fp32 bytes of the tensors below min_compress_numel (sent exactly)
    names: tuple[str, ...]  # tensor names in ready order (as in workload.numels)
    steps: int  # timed steps
    no_grad: tuple[str, ...] = ()  # trainable tensors that never received a gradient (left out)
    exact_names: tuple[str, ...] = ()
    step_s: tuple[float, ...] = ()  # each timed step's compute: forward + backward + optimizer

    @property
    def spread(self) -> float:
        """The slowest timed step's compute over the fastest's (1.0 with fewer than two steps)."""
        return compute_spread(self.step_s)

    def summary(self) -> dict:
        return {"tensors": len(self.names), "numel": self.workload.numel, "compressed_numel": int(self.flat.numel()),
                "compressed_tensors": len(self.ctx.segments), "exact_tensors": len(self.exact_names),
                "exact_bytes": self.exact_bytes, "timed_steps": self.steps, "no_grad": list(self.no_grad),
                "step_ms": [1e3 * t for t in self.step_s], "spread": self.spread}


def compute_spread(step_s: Sequence[float]) -> float:
    """``max / min`` of the timed steps' compute (1.0 for fewer than two steps; inf when one took 0 s)."""
    if len(step_s) < 2:
        return 1.0
    lo, hi = min(step_s), max(step_s)
    return hi / lo if lo > 0 else math.inf


def spread_warning(step_s: Sequence[float], factor: float = SPREAD_WARN) -> str | None:
    """A warning when the timed steps disagree by more than ``factor`` (max/min), else None.

    The compute advise models is the median of these steps; on a host busy with other work some
    steps take several times longer, and the median of a few steps can be such a step."""
    spread = compute_spread(step_s)
    if spread <= factor:
        return None
    ms = ", ".join(f"{1e3 * t:.1f}" for t in step_s)
    return (f"warning: the {len(step_s)} timed steps disagree (compute {ms} ms; slowest/fastest = {spread:.1f}x > "
            f"{factor:g}x): this host was busy, so the measured compute is unreliable. Rerun on a quiet host or "
            "with more --profile-steps (e.g. 10), or give --forward-ms/--backward-ms/--optimizer-ms")


def _timer_callback(params: list[Tensor], skip_steps: int):
    import lightning as L

    class _StepTimer(L.Callback):
        """The chooser's timing (AutoChooser.wrap_closure / after_optimizer_step) from Trainer hooks."""

        def __init__(self) -> None:
            self.records: list[dict] = []
            self.stamps: dict[int, float] = {}
            self.t_start = self.t_fwd = 0.0
            self.t_closure_end: float | None = None
            self.step = 0
            self.handles = [p.register_post_accumulate_grad_hook(self._stamp(i)) for i, p in enumerate(params)]

        def _stamp(self, i: int):
            def hook(_: Tensor) -> None:
                self.stamps[i] = time.perf_counter()
            return hook

        def on_forward(self, *_: Any) -> None:
            self.t_fwd = time.perf_counter()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.stamps = {}
            self.t_closure_end = None
            self.t_start = time.perf_counter()
            self.t_fwd = self.t_start

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            if self.t_closure_end is None:  # the end of the closure (forward + backward)
                self.t_closure_end = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            t_end = time.perf_counter()
            if self.step >= skip_steps and self.stamps:
                closure_end = self.t_closure_end if self.t_closure_end is not None else max(self.stamps.values())
                order = sorted(self.stamps, key=lambda i: self.stamps[i])
                self.records.append({"forward_s": max(self.t_fwd - self.t_start, 0.0),
                                     "ready": {i: self.stamps[i] - self.t_fwd for i in order},
                                     "optimizer_s": max(t_end - closure_end, 0.0)})
            self.step += 1

        def remove(self) -> None:
            for h in self.handles:
                h.remove()
            self.handles = []

    return _StepTimer()


def profile_module(model: Any, datamodule: Any = None, *, skip_steps: int = 1, profile_steps: int = PROFILE_STEPS,
                   min_compress_numel: int = 1024, seed: int = 0) -> Profile:
    """Train ``model`` for ``skip_steps + profile_steps`` steps in one process on the CPU and time them
    as the chooser does (see the module docstring); return the :class:`Profile`.

    The compressed group is built like the engine's ``"model"`` plan
    (:func:`lightning_gc.plans.base.build_plan`) over the trainable parameters in registration order."""
    import lightning as L

    from ..plans.base import build_plan

    for name, v, lo in (("skip_steps", skip_steps, 0), ("profile_steps", profile_steps, 1),
                        ("min_compress_numel", min_compress_numel, 0)):
        check_int(name, v, lo, f"e.g. {name}={lo + 1}", error=AdviseError, phrasing="must")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise AdviseError("the model has no trainable parameters: there is no gradient to communicate")
    params = [p for _, p in named]
    timer = _timer_callback(params, skip_steps)
    fwd_handle = model.register_forward_hook(timer.on_forward)
    quiet = [logging.getLogger(n) for n in ("lightning.pytorch", "lightning.fabric", "lightning")]
    levels = [lg.level for lg in quiet]
    try:
        for lg in quiet:
            lg.setLevel(logging.ERROR)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Lightning's advice about workers/loggers is not the user's business here
            trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=skip_steps + profile_steps, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                limit_val_batches=0, num_sanity_val_steps=0, callbacks=[timer])
            try:
                trainer.fit(model, datamodule=datamodule) if datamodule is not None else trainer.fit(model)
            except Exception as exc:  # noqa: BLE001 -- report whatever the user's workload raised, with the fix
                raise AdviseError(f"training the workload for {skip_steps + profile_steps} steps failed "
                                  f"({type(exc).__name__}: {exc}); advise needs a LightningModule that trains on the "
                                  "CPU in one process, with training data (a datamodule or train_dataloader)") from exc
    finally:
        for lg, lv in zip(quiet, levels):
            lg.setLevel(lv)
        fwd_handle.remove()
        timer.remove()
    records = timer.records
    if not records:
        raise AdviseError(f"no step could be timed: the workload ran {timer.step} step(s), advise needs "
                          f"{skip_steps + profile_steps} (skip_steps={skip_steps} + profile_steps={profile_steps}) "
                          "with gradients; give it more training data or fewer steps")
    # tensors that received a gradient in every timed step; the others are left out (as DDP leaves unused ones)
    seen = set.intersection(*(set(r["ready"]) for r in records))
    ids = [i for i in range(len(params)) if i in seen and params[i].grad is not None]
    no_grad = tuple(named[i][0] for i in range(len(params)) if i not in ids)
    if not ids:
        raise AdviseError("no parameter received a gradient in the timed steps; advise needs a model whose "
                          "training_step returns a loss that depends on its parameters")
    # the chooser's reduction: median ready time per tensor, sorted, turned into durations
    ready = {i: statistics.median(r["ready"][i] for r in records) for i in ids}
    order = sorted(ids, key=lambda i: (ready[i], i))
    t_prev, durations = 0.0, []
    for i in order:
        durations.append(max(ready[i] - t_prev, 0.0))
        t_prev = max(ready[i], t_prev)
    workload = Workload(statistics.median(r["forward_s"] for r in records), tuple(durations),
                        tuple(params[i].numel() for i in order), statistics.median(r["optimizer_s"] for r in records),
                        0.0)
    # the engine's "model" plan over the tensors that take part (registration order in, backward order out)
    plan = build_plan([named[i][0] for i in ids], [params[i].numel() for i in ids], kind="model",
                      min_compress_numel=min_compress_numel, compress=True)
    lossy = [g for g in plan.groups if not g.exact]
    if not lossy:
        raise AdviseError(f"every gradient tensor has fewer than min_compress_numel={min_compress_numel} elements, so "
                          "the engine would compress nothing; lower --min-compress-numel (e.g. 0)")
    exact = [g for g in plan.groups if g.exact]
    exact_bytes = float(sum(4 * n for g in exact for n in g.numels))
    g = lossy[0]
    members = [ids[k] for k in g.param_ids]
    flat = torch.cat([params[i].grad.detach().reshape(-1).float().cpu() for i in members])
    ctx = GroupContext(step=skip_steps + profile_steps, rank=0, world_size=1, segments=g.numels, group_id=g.gid,
                       seed=seed, device=flat.device, shapes=tuple(tuple(params[i].shape) for i in members),
                       names=g.names)
    step_s = tuple(r["forward_s"] + max(r["ready"][i] for i in ids) + r["optimizer_s"] for r in records)
    return Profile(workload, flat, ctx, exact_bytes, tuple(named[i][0] for i in order), len(records), no_grad,
                   tuple(n for e in exact for n in e.names), step_s)


def synthetic_profile(params: int, compute_ms: float, seed: int = 0) -> tuple[Profile, float]:
    """A model of ``params`` parameters known only by its size and compute (``--model-params`` with
    ``--compute-ms``), and the factor that scales what is measured on its sample to the whole model.

    The model is square ``SYNTHETIC_SIDE``-sided matrices (the last one shorter), each ready in
    backward after a time in proportion to its size; ``compute_ms`` is split 1:2 between forward and
    backward (a dense layer's backward computes two products to its forward's one), optimizer 0. The
    codecs are measured on a Gaussian gradient of its first ``SYNTHETIC_SAMPLE`` elements (whole
    matrices), and every codec time and payload is then multiplied by ``params / sample`` (each
    matrix is compressed alike, so both grow with the number of matrices). A Gaussian gradient has no
    large coordinates: Top-k's and sign's error ``delta2`` on it is higher than on a trained model's
    gradient; ``--progress-weight 0`` ranks by step time alone."""
    side2 = SYNTHETIC_SIDE ** 2
    full, rem = divmod(int(params), side2)
    numels = (side2,) * full + ((rem,) if rem else ())
    shapes = ((SYNTHETIC_SIDE, SYNTHETIC_SIDE),) * full + (((rem,),) if rem else ())
    count = max(1, min(len(numels), SYNTHETIC_SAMPLE // side2))
    sample = sum(numels[:count])
    c = _check_nonneg("--compute-ms", compute_ms, "--compute-ms 120") / 1e3
    workload = Workload(c / 3, tuple(2 * c / 3 * n / params for n in numels), numels, 0.0, 0.0)
    gen = torch.Generator().manual_seed(seed)
    flat = torch.randn(sample, generator=gen)
    names = tuple(f"synthetic.{i}" for i in range(len(numels)))
    ctx = GroupContext(step=2, rank=0, world_size=1, segments=numels[:count], group_id=0, seed=seed,
                       device=flat.device, shapes=shapes[:count], names=names[:count])
    return Profile(workload, flat, ctx, 0.0, names, 0), params / sample


def scale_costs(costs: Sequence[MethodCost], factor: float) -> list[MethodCost]:
    """Costs measured on a sample, for a model ``factor`` times its size: codec time and payload bytes
    scaled (error ``delta2`` is a ratio, and stays)."""
    if factor == 1:
        return list(costs)
    return [dataclasses.replace(c, codec_s=c.codec_s * factor, payload_bytes=c.payload_bytes * factor) for c in costs]


def override_workload(workload: Workload, forward_ms: float | None = None, backward_ms: float | None = None,
                      optimizer_ms: float | None = None, other_ms: float | None = None,
                      compute_scale: float = 1.0, compute_ms: float | None = None) -> Workload:
    """The workload with the user's figures in place of the measured ones (milliseconds; ``None`` keeps).

    ``compute_scale`` first multiplies the measured forward, backward and optimizer times (a GPU's
    compute is faster than this CPU's; 4 ranks sharing 2 cores are slower than one process alone);
    a figure given explicitly replaces the scaled one. ``backward_ms`` scales the per-tensor profile
    to that total (its shape, the tensors' ready order and relative times, is kept; a profile of
    all zeros is spread evenly). ``compute_ms`` scales forward, backward and optimizer together so that
    they add up to it (the measured shares kept); it replaces ``compute_scale`` and cannot be given
    with the separate figures."""
    k = _check_nonneg("--compute-scale", compute_scale, "--compute-scale 0.05 for a GPU ~20x faster than this CPU",
                      positive=True)
    if compute_ms is not None:
        if any(v is not None for v in (forward_ms, backward_ms, optimizer_ms)):
            raise AdviseError(f"--compute-ms {compute_ms!r} with --forward-ms/--backward-ms/--optimizer-ms: give the "
                              "step's compute once, either as a total (--compute-ms) or by its parts, not both")
        total = _check_nonneg("--compute-ms", compute_ms, "--compute-ms 120") / 1e3
        measured = workload.forward_s + workload.backward_total_s + workload.optimizer_s
        if measured <= 0:
            raise AdviseError("--compute-ms: the measured compute is 0 s, so it has no shares to scale; give "
                              "--forward-ms and --backward-ms instead")
        k = total / measured
    w = Workload(workload.forward_s * k, tuple(t * k for t in workload.backward_s), workload.numels,
                 workload.optimizer_s * k, workload.other_s)
    fwd = w.forward_s if forward_ms is None else _check_nonneg("--forward-ms", forward_ms, "--forward-ms 12") / 1e3
    opt = w.optimizer_s if optimizer_ms is None else _check_nonneg("--optimizer-ms", optimizer_ms,
                                                                   "--optimizer-ms 3") / 1e3
    other = w.other_s if other_ms is None else _check_nonneg("--other-ms", other_ms, "--other-ms 5") / 1e3
    bwd = w.backward_s
    if backward_ms is not None:
        total = _check_nonneg("--backward-ms", backward_ms, "--backward-ms 25") / 1e3
        measured = w.backward_total_s
        if measured > 0:
            bwd = tuple(t * total / measured for t in bwd)
        else:
            bwd = tuple(total / len(bwd) for _ in bwd)
    return Workload(fwd, tuple(bwd), w.numels, opt, other)


# ---------------------------------------------------------------------------------------------- codec costs
def _aggregate_s(cand: AutoCandidate, flat: Tensor, ctx: GroupContext, payloads: int, repeats: int) -> float:
    """Seconds of an allgather method's aggregation of ``payloads`` payloads, timed by
    :func:`lightning_gc.compressors.timing.time_codec` on :func:`rank_payloads` (as measure_method times; fastest run)."""
    comp = build_compressor(cand.compressor, cand.ratio, dict(cand.compressor_args) or None)
    xs, ctxs = rank_payloads(flat, ctx, payloads)
    return min(time_codec(comp, xs, ctxs, repeats)["timings"]["aggregate"])


def aggregation_slope(times: dict[int, float]) -> float:
    """Seconds per extra payload from ``{payloads: aggregation seconds}``: the median of the slopes
    between every pair of payload counts (Theil-Sen: one disturbed timing cannot move it much),
    never negative."""
    pts = sorted(times.items())
    slopes = [(tb - ta) / (pb - pa) for (pa, ta), (pb, tb) in itertools.combinations(pts, 2) if pb != pa]
    return max(statistics.median(slopes), 0.0) if slopes else 0.0


def measure_costs(candidates: Sequence[str | AutoCandidate], flat: Tensor, ctx: GroupContext, world_size: int,
                  exact_bytes: float = 0.0, repeats: int = 3, codec_scale: float = 1.0,
                  max_payloads: int = TIMING_PAYLOADS, rounds: int = 2) -> list[MethodCost]:
    """One :class:`~lightning_gc.auto.model.MethodCost` per candidate on this machine.

    Each is :func:`~lightning_gc.auto.candidates.measure_method` (median of ``repeats`` runs) with
    ``p = min(world_size, max_payloads)`` payloads, taken ``rounds`` times over all candidates; the
    least codec time is kept (the first round warms the allocator, and a shared machine only ever
    adds time). An allgather method's aggregation decodes every rank's payload: beyond ``p`` ranks
    it is charged the slope (:func:`aggregation_slope`) of its aggregation timed with 1, 2, 4, ...
    ``p`` payloads. Every codec time is then multiplied by ``codec_scale``."""
    n = _check_world_size(world_size)
    scale = _check_nonneg("--codec-scale", codec_scale, "--codec-scale 0.05 for a GPU ~20x faster than this CPU",
                          positive=True)
    for name, v in (("max_payloads", max_payloads), ("rounds", rounds), ("repeats", repeats)):
        check_int(name, v, 1, f"e.g. {name}=2", error=AdviseError, phrasing="must")
    timed = min(n, max_payloads)
    counts = sorted({timed, *(2 ** k for k in range(timed.bit_length()) if 2 ** k < timed)})  # 1, 2, 4, 8
    cands = [c if isinstance(c, AutoCandidate) else candidate(c) for c in candidates]
    best: dict[str, MethodCost] = {}
    agg: dict[str, dict[int, float]] = {}  # name -> payloads -> fastest aggregation
    for _ in range(rounds):
        for cand in cands:
            m = measure_method(cand, flat, ctx, timed, repeats, exact_bytes)
            if cand.name not in best or m.codec_s < best[cand.name].codec_s:
                best[cand.name] = m
            if m.wire == "allgather" and n > timed and len(counts) > 1:
                seen = agg.setdefault(cand.name, {})
                for p in counts:
                    t = _aggregate_s(cand, flat, ctx, p, repeats)
                    seen[p] = min(seen.get(p, t), t)
    out = []
    for cand in cands:
        m = best[cand.name]
        codec = m.codec_s
        if cand.name in agg:
            codec += aggregation_slope(agg[cand.name]) * (n - timed)
        out.append(MethodCost(m.name, m.wire, codec * scale, m.payload_bytes, m.delta2, m.error_feedback,
                              m.sparse_ratio, m.value_bytes, m.exact_bytes))
    return out


# ---------------------------------------------------------------------------------------------- the advice
def advise(workload: Workload, costs: Sequence[MethodCost], network: NetworkModel, world_size: int,
           progress_weight: float = DEFAULT_PROGRESS_WEIGHT) -> tuple[str, dict[str, Prediction]]:
    """The pick and every candidate's prediction: :func:`lightning_gc.auto.model.choose` after
    checking the inputs (``1 <= world_size <= 1024``, ``progress_weight >= 0``, distinct candidates)."""
    n = _check_world_size(world_size)
    w = _check_nonneg("--progress-weight", progress_weight, "--progress-weight 2 (0: step time only)")
    if not costs:
        raise AdviseError("advise needs at least one candidate cost; e.g. --candidates ddp,fp16,topk")
    names = [c.name for c in costs]
    if len(set(names)) != len(names):
        raise AdviseError(f"candidates {names} name a method twice; give each once")
    return choose(list(costs), workload, network, n, w)


@dataclass
class Advice:
    """Everything ``lightning-gc advise`` prints: the pick, the predictions and their inputs."""

    pick: str
    predictions: dict[str, Prediction]
    workload: Workload
    costs: list[MethodCost]
    network: NetworkModel
    world_size: int
    progress_weight: float
    inputs: dict = field(default_factory=dict)
    topology: TopologyAdvice | None = None  # with --ranks-per-node > 1: every candidate flat and by nodes
    diloco: list[DiLoCoPrediction] = field(default_factory=list)  # with --diloco: one per H, fp16 Δ

    def as_dict(self) -> dict:
        return {"topology": None if self.topology is None else self.topology.as_dict(),"schema": SCHEMA, "pick": self.pick,
                "predictions": {k: v.as_dict() for k, v in self.predictions.items()},
                "world_size": self.world_size, "progress_weight": self.progress_weight,
                "network": {"alpha_s": self.network.alpha_s, "beta_s_per_byte": self.network.beta_s_per_byte,
                            "bandwidth_bits_per_s": (None if math.isinf(self.network.bandwidth_bits_per_s)
                                                     else self.network.bandwidth_bits_per_s)},
                "workload": self.workload.as_dict(), "costs": [c.as_dict() for c in self.costs],
                "inputs": self.inputs,
                "diloco": [dataclasses.asdict(p) | {"inner_steps": h} for h, p in zip(self.inputs.get("diloco", ()),
                                                                                        self.diloco)]}

    def text(self) -> str:
        i, w = self.inputs, self.workload
        prof = i.get("profile", {})
        bw = self.network.bandwidth_bits_per_s
        link = "infinite bandwidth" if math.isinf(bw) else schedule.format_rate(round(bw))
        given = i.get("given", {})

        def src(key: str) -> str:
            total = given.get("compute_ms") is not None and key != "other_ms"
            return "given" if given.get(key) is not None or total else "measured"

        lines = [
            f"lightning-gc advise: {i.get('preset', '?')}, {w.numel:,} gradient elements in {len(w.numels)} tensors "
            f"({prof.get('compressed_numel', 0):,} compressed in one group; sent exactly: "
            f"{prof.get('exact_tensors', 0)} below min_compress_numel); N={self.world_size}, link {link}, latency "
            f"{1e3 * self.network.alpha_s:g} ms, progress weight {self.progress_weight:g}",
            f"compute ({i.get('compute_source', 'measured on this CPU')}): forward {1e3 * w.forward_s:.2f} ms "
            f"({src('forward_ms')}), backward {1e3 * w.backward_total_s:.2f} ms ({src('backward_ms')}), optimizer "
            f"{1e3 * w.optimizer_s:.2f} ms ({src('optimizer_ms')}), other {1e3 * w.other_s:.2f} ms"
            + (" (given)" if given.get("other_ms") is not None else ""),
        ]
        timing = i.get("codec_timing")
        if timing:
            lines.append(timing)
        lines.extend(i.get("warnings", ()))
        if prof.get("no_grad"):
            lines.append(f"left out (no gradient in the timed steps): {', '.join(prof['no_grad'])}")
        lines.append(table(self.predictions, self.pick))
        best = self.predictions[self.pick]
        line = f"pick: {self.pick} ({1e3 * best.time_per_progress_s:.2f} ms per unit of progress"
        if "ddp" in self.predictions and self.pick != "ddp":
            ddp = self.predictions["ddp"].time_per_progress_s
            line += f"; ddp {1e3 * ddp:.2f} ms, {ddp / best.time_per_progress_s:.2f}x"
        lines.append(line + ")")
        lines.append("ms/progress = step / efficiency, efficiency = 1/(1 + w*delta2) (docs/auto.md); a prediction "
                     "of the alpha-beta model, not a measurement on the cluster")
        if self.topology is not None:
            lines.extend(self._topology_lines())
        if self.diloco:
            lines.extend(self._diloco_lines())
        return "\n".join(lines)

    def _diloco_lines(self) -> list[str]:
        pick = self.predictions[self.pick].step_s
        lines = ["", "DiLoCo (sync='diloco', fp16 Δ, flat; auto/diloco_cost.py): step time only. It takes more steps "
                 "than per-step methods to a given loss as H grows, which this does not predict (docs/diloco.md)."]
        for h, p in zip(self.inputs["diloco"], self.diloco):
            lines.append(f"  H={h:<4} step {1e3 * p.step_s:9.2f} ms ({p.step_s / pick:.2f}x the pick's), exchange "
                         f"{1e3 * p.exchange_s:.1f} ms every {h} steps, {p.bytes_per_step / 1e6:.3f} MB/step per rank")
        return lines

    def _topology_lines(self) -> list[str]:
        c = self.topology.cluster
        rate = schedule.format_rate
        return [
            "",
            f"topology: {c.nodes} nodes x {c.ranks_per_node} ranks; between nodes {rate(round(c.inter.bandwidth_bits_per_s))} "
            f"per node's card (shared by its {c.ranks_per_node} ranks), latency {1e3 * c.inter.alpha_s:g} ms; inside a node "
            f"{rate(round(c.intra.bandwidth_bits_per_s))}, latency {1e3 * c.intra.alpha_s:g} ms",
            "flat: the table above (a flat ring is bounded by its slowest link, here the card); by nodes: dense "
            "reduce-scatter inside, the candidate on a 1/K shard between nodes, allgather inside (docs/topology.md). "
            "card MB: bytes a node's card sends per step",
            self.topology.text(),
        ]


def _check_inputs(n: int, k: int, intra_bandwidth: str | None, preset: str | None, model_params: Any,
                  compute_ms: float | None, parts: dict[str, float | None]) -> None:
    """The combinations of options ``run`` refuses (each option's value is checked where it is parsed)."""
    if intra_bandwidth is not None and k == 1:
        raise AdviseError(f"--intra-bandwidth {intra_bandwidth!r} with --ranks-per-node 1: with one rank per node "
                          "there is no link inside a node; give --ranks-per-node (e.g. 8), or drop --intra-bandwidth")
    if (preset is None) == (model_params is None):
        raise AdviseError("give the workload once: --preset (a bench preset or module:factory, profiled here) or "
                          "--model-params with --compute-ms (a model known by its size and step compute)")
    if model_params is not None and compute_ms is None:
        raise AdviseError(f"--model-params {model_params!r} needs --compute-ms (the step's forward + backward + "
                          "optimizer on one rank, in milliseconds, e.g. --compute-ms 120): nothing is profiled")
    if compute_ms is not None:
        _check_nonneg("--compute-ms", compute_ms, "--compute-ms 120")
    for flag, v in parts.items():
        if v is not None:
            _check_nonneg(flag, v, f"{flag} 12")


def _topology(cluster: Cluster, names: Sequence[str], prof: Profile, workload: Workload, costs: Sequence[MethodCost],
              scale: float, w: float, repeats: int, codec_scale: float) -> TopologyAdvice:
    """Every candidate flat and by nodes (lightning_gc/bench/advise_nodes.py); the engine methods that
    topology='nodes' runs are measured again on a shard, with ``nodes`` payloads."""
    cands = [candidate(nm) for nm in names]
    refusals = {c.name: r for c in cands if (r := node_refusal(c)) is not None}
    engine = [c for c in cands if c.compressor is not None and c.name not in refusals]
    node_costs = {c.name: c for c in costs if c.wire == "bucket"}
    if engine:
        shard, sctx = shard_of(prof.flat, prof.ctx, cluster.ranks_per_node, cluster.nodes)
        measured = measure_costs(engine, shard, sctx, cluster.nodes, prof.exact_bytes, repeats, codec_scale)
        node_costs.update({c.name: c for c in scale_costs(measured, scale)})
    topo = compare(workload, costs, node_costs, refusals, cluster, w)
    if cluster.world_size <= 8 and any(c.wire in ("allgather", "allreduce") for c in costs):
        topo.notes.append("flat column: the direct exchange (at most 8 ranks) sends K x (N - K) messages on a "
                          "node's card, which the table above (one link per rank) does not charge")
    return topo


def run(preset: str | None, world_size: int, bandwidth: str, latency: str = DEFAULT_LATENCY, *,
        preset_args: dict[str, Any] | None = None, candidates: str | Sequence[str] = DEFAULT_CANDIDATES,
        progress_weight: float = DEFAULT_PROGRESS_WEIGHT, forward_ms: float | None = None, backward_ms: float | None = None,
        optimizer_ms: float | None = None, other_ms: float | None = None, codec_scale: float = 1.0,
        compute_scale: float = 1.0, skip_steps: int = 1, profile_steps: int = PROFILE_STEPS, repeats: int = 3,
        min_compress_numel: int = 1024, seed: int = 0, ranks_per_node: int = 1, intra_bandwidth: str | None = None,
        intra_latency: str = DEFAULT_INTRA_LATENCY, compute_ms: float | None = None,
        model_params: int | str | None = None, diloco: Sequence[int] = ()) -> Advice:
    """Build, profile and measure the workload, then advise (what the command does; inputs are
    checked before anything is built, so a typo costs no training). ``model_params`` (with
    ``compute_ms``) replaces ``preset``: nothing is trained (:func:`synthetic_profile`).
    ``ranks_per_node > 1``: ``bandwidth``/``latency`` are a node's network card, ``intra_*`` the link
    inside a node, and every candidate is also predicted by nodes (:attr:`Advice.topology`). ``diloco``: the
    H of each DiLoCo configuration (fp16 Δ) whose step is predicted beside them (:attr:`Advice.diloco`)."""
    n = _check_world_size(world_size)
    k = check_ranks_per_node(ranks_per_node, n, AdviseError)
    bps = parse_bandwidth(bandwidth)
    alpha = parse_latency(latency)
    intra_bps = parse_bandwidth(intra_bandwidth or DEFAULT_INTRA_BANDWIDTH, "--intra-bandwidth")
    intra_alpha = parse_latency(intra_latency, "--intra-latency")
    names = parse_candidates(candidates)
    w = _check_nonneg("--progress-weight", progress_weight, "--progress-weight 2 (0: step time only)")
    _check_nonneg("--codec-scale", codec_scale, "--codec-scale 0.05", positive=True)
    _check_nonneg("--compute-scale", compute_scale, "--compute-scale 0.05", positive=True)
    _check_inputs(n, k, intra_bandwidth, preset, model_params, compute_ms,
                  {"--forward-ms": forward_ms, "--backward-ms": backward_ms, "--optimizer-ms": optimizer_ms,
                   "--other-ms": other_ms})
    params = parse_count(model_params) if isinstance(model_params, str) else model_params
    if params is not None and (isinstance(params, bool) or not isinstance(params, int) or params < 1):
        raise AdviseError(f"--model-params {model_params!r} must be a number of parameters >= 1, e.g. 350M")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise AdviseError(f"--repeats {repeats!r} must be an integer >= 1, e.g. 3")
    cluster = Cluster(n, k, NetworkModel.from_bandwidth(bps, alpha), NetworkModel.from_bandwidth(intra_bps, intra_alpha))
    network = cluster.flat
    if params is None:
        model, data, label = build_module(preset, preset_args, seed)
        prof = profile_module(model, data, skip_steps=skip_steps, profile_steps=profile_steps,
                              min_compress_numel=min_compress_numel, seed=seed)
        scale, summary = 1.0, prof.summary()
        workload = override_workload(prof.workload, forward_ms, backward_ms, optimizer_ms, other_ms, compute_scale,
                                     compute_ms)
    else:
        prof, scale = synthetic_profile(params, compute_ms, seed)
        label = f"{params:,} parameters (--model-params)"
        summary = {"tensors": len(prof.names), "numel": params, "compressed_numel": params,
                   "compressed_tensors": len(prof.names), "exact_tensors": 0, "exact_bytes": 0.0, "timed_steps": 0,
                   "no_grad": [], "sample_numel": int(prof.flat.numel()), "scale": scale}
        workload = override_workload(prof.workload, forward_ms, backward_ms, optimizer_ms, other_ms)
    costs = scale_costs(measure_costs(names, prof.flat, prof.ctx, n, prof.exact_bytes, repeats, codec_scale), scale)
    timed = min(n, TIMING_PAYLOADS)
    timing = (f"codec ({'measured on this CPU' if codec_scale == 1 else f'measured on this CPU x {codec_scale:g}'}): "
              f"aggregation timed with min(N, {TIMING_PAYLOADS}) = {timed} payloads")
    if n > timed and any(c.wire == "allgather" for c in costs):
        timing += f"; allgather methods' aggregation extrapolated linearly to N={n}"
    if scale != 1:
        timing += (f"; measured on a Gaussian sample of {prof.flat.numel():,} elements and scaled x {scale:.4g} to the "
                   "model (error delta2 of a Gaussian gradient: pessimistic for Top-k and sign)")
    pick, preds = advise(workload, costs, network, n, w)
    diloco_preds = [predict_diloco(DiLoCoCandidate(h, delta_bytes_per_element=2.0, wire="allreduce"), workload,
                                   network, n) for h in diloco]
    topo = _topology(cluster, names, prof, workload, costs, scale, w, repeats, codec_scale) if k > 1 else None
    args = dict(preset_args or {})
    inputs = {
        "preset": label if not args else f"{label} ({', '.join(f'{k}={v}' for k, v in args.items())})",
        "preset_name": label, "preset_args": {k: repr(v) if not isinstance(v, (int, float, str, bool)) else v
                                              for k, v in args.items()},
        "model_params": params, "ranks_per_node": k,
        "intra_bandwidth": intra_bandwidth or (DEFAULT_INTRA_BANDWIDTH if k > 1 else None),
        "intra_bandwidth_bits_per_s": intra_bps if k > 1 else None, "intra_latency": intra_latency,
        "bandwidth": bandwidth, "bandwidth_bits_per_s": bps, "latency": latency, "latency_s": alpha, "candidates": list(names), "seed": seed,
        "given": {"forward_ms": forward_ms, "backward_ms": backward_ms, "optimizer_ms": optimizer_ms,
                  "other_ms": other_ms, "compute_ms": compute_ms},
        "measured_workload": prof.workload.as_dict() if params is None else None, "profile": summary,
        "tensor_order": list(prof.names),
        "skip_steps": skip_steps, "profile_steps": profile_steps, "repeats": repeats,
        "min_compress_numel": min_compress_numel, "codec_scale": codec_scale, "compute_scale": compute_scale,
        "timing_payloads": timed,
        "codec_timing": timing,
        "compute_source": (f"{skip_steps} skipped + {prof.steps} timed steps on this CPU, medians"
                           + (f", x {compute_scale:g}" if compute_scale != 1 else "") + ", unless given")
                          if params is None else "given: --compute-ms split 1:2 between forward and backward",
        "torch_threads": torch.get_num_threads(),
        "warnings": [x for x in (spread_warning(prof.step_s),) if x],
        "diloco": list(diloco),
    }
    return Advice(pick, preds, workload, costs, network, n, w, inputs, topo, diloco_preds)


# ---------------------------------------------------------------------------------------------- the command
def _world_size_arg(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer; give the number of ranks, e.g. 64") from None
    return v  # the range is checked by run(), with the same message as the API


def _diloco_arg(text: str) -> tuple[int, ...]:
    try:
        hs = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        hs = ()
    if not hs or min(hs) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of inner-step counts H >= 1; e.g. --diloco 10,50")
    return hs


def _float_arg(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number, e.g. 12.5") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lightning-gc advise",
        description="Predict every compressor='auto' candidate's step time for a workload on N ranks over a given "
                    "link, and name the pick (the live chooser's model, offline). Compute and codec costs are "
                    "measured on this machine's CPU unless given; see docs/auto.md.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    w = p.add_argument_group("workload")
    w.add_argument("--preset", default=None,
                   help="mlp | cnn | lm | gpt | quickstart | probe | deep | package.module:factory (as for "
                        "`lightning-gc bench`: a callable returning an object with model, datamodule, metric, mode, "
                        "target, batch_size; docs/bench.md); profiled on this CPU. Or give --model-params")
    w.add_argument("--model-params", default=None, metavar="COUNT",
                   help="instead of --preset: a model known by its parameter count (350M, 1.3B), with --compute-ms; "
                        "nothing is trained, the codecs are measured on a Gaussian sample and scaled to it")
    w.add_argument("--preset-arg", action="append", type=preset_arg, default=[], metavar="KEY=VALUE",
                   help="keyword for the preset or factory (repeatable), e.g. width=16")
    w.add_argument("--seed", type=int, default=0, help="seed of the preset's data and initial weights")
    c = p.add_argument_group("cluster")
    c.add_argument("--ranks", "--world-size", "-N", dest="ranks", type=_world_size_arg, required=True,
                   help=f"data-parallel ranks, 1..{MAX_WORLD_SIZE} (as in `lightning-gc bench --ranks`)")
    c.add_argument("--bandwidth", required=True,
                   help="link rate per rank and direction, bits/s: 100mbit, 10gbit; with --ranks-per-node > 1 the "
                        "rate of a node's network card between nodes, which its ranks share")
    c.add_argument("--latency", default=DEFAULT_LATENCY,
                   help="latency per message (alpha): 50us, 0.5ms, 20ms (between nodes with --ranks-per-node > 1)")
    c.add_argument("--ranks-per-node", type=_world_size_arg, default=1, metavar="K",
                   help="ranks (GPUs) per node, dividing --ranks; above 1 every candidate is also predicted by nodes "
                        "(topology='nodes': dense inside a node, compressed between nodes) beside flat")
    c.add_argument("--intra-bandwidth", default=None,
                   help=f"link inside a node, bits/s (with --ranks-per-node > 1); default {DEFAULT_INTRA_BANDWIDTH}: "
                        "PCIe 4.0 x16 (~25 GB/s), the slowest common GPU-to-GPU path, so by nodes is not flattered; "
                        "NVLink is 10-30x faster (e.g. 2400gbit)")
    c.add_argument("--intra-latency", default=DEFAULT_INTRA_LATENCY, help="latency per message inside a node")
    m = p.add_argument_group("candidates and progress")
    m.add_argument("--candidates", default=",".join(DEFAULT_CANDIDATES),
                   help=f"comma-separated, in tie-break order; from {', '.join(CANDIDATES)}")
    m.add_argument("--diloco", type=_diloco_arg, default=(), metavar="H,...",
                   help="also predict DiLoCo's step (fp16 Δ) at each of these H, e.g. 10,50 (docs/diloco.md)")
    m.add_argument("--progress-weight", type=_float_arg, default=DEFAULT_PROGRESS_WEIGHT,
                   help="w in efficiency = 1/(1 + w*delta2); 0 ranks by step time alone")
    g = p.add_argument_group("figures that replace the measurement (milliseconds)")
    g.add_argument("--compute-ms", type=_float_arg, default=None,
                   help="one rank's step compute (forward + backward + optimizer): with --preset the measured parts "
                        "are scaled to it; with --model-params it is split 1:2 between forward and backward")
    g.add_argument("--forward-ms", type=_float_arg, default=None, help="forward time of one step")
    g.add_argument("--backward-ms", type=_float_arg, default=None,
                   help="backward time; the measured per-tensor profile is scaled to it")
    g.add_argument("--optimizer-ms", type=_float_arg, default=None, help="optimizer step time")
    g.add_argument("--other-ms", type=_float_arg, default=None, help="time beyond the model (data, logging)")
    g.add_argument("--codec-scale", type=_float_arg, default=1.0,
                   help="factor on every measured codec time (e.g. 0.05 for a GPU ~20x faster than this CPU)")
    g.add_argument("--compute-scale", type=_float_arg, default=1.0,
                   help="factor on the measured forward, backward and optimizer times (e.g. 0.05 for a GPU; 2 for "
                        "4 ranks sharing 2 cores); --forward-ms/--backward-ms/--optimizer-ms replace it")
    t = p.add_argument_group("measurement")
    t.add_argument("--skip-steps", type=int, default=1, help="training steps run first and not timed")
    t.add_argument("--profile-steps", type=int, default=PROFILE_STEPS,
                   help=f"training steps timed (medians); a warning names a spread above {SPREAD_WARN:g}x between them")
    t.add_argument("--repeats", type=int, default=3, help="timed runs per codec measurement (median)")
    t.add_argument("--min-compress-numel", type=int, default=1024,
                   help="tensors with fewer elements are sent exactly (GCStrategy's min_compress_numel)")
    p.add_argument("--json", action="store_true", help="print the result as JSON (predictions, pick, inputs)")
    return p


def main(argv: list[str] | None = None) -> int:
    """``lightning-gc advise``; exit 0 with advice, 2 for invalid input (the message says why)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse printed the usage and the reason
        return int(exc.code or 0)
    try:
        advice = run(args.preset, args.ranks, args.bandwidth, args.latency, preset_args=dict(args.preset_arg),
                     candidates=args.candidates, progress_weight=args.progress_weight, forward_ms=args.forward_ms,
                     backward_ms=args.backward_ms, optimizer_ms=args.optimizer_ms, other_ms=args.other_ms,
                     codec_scale=args.codec_scale, compute_scale=args.compute_scale, skip_steps=args.skip_steps,
                     profile_steps=args.profile_steps, repeats=args.repeats, min_compress_numel=args.min_compress_numel,
                     seed=args.seed, ranks_per_node=args.ranks_per_node, intra_bandwidth=args.intra_bandwidth,
                     intra_latency=args.intra_latency, compute_ms=args.compute_ms, model_params=args.model_params,
                     diloco=args.diloco)
    except (AdviseError, ValueError) as exc:
        print(f"lightning-gc advise: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(advice.as_dict(), indent=2, default=str))
    else:
        print(advice.text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
