"""The methods ``compressor="auto"`` chooses among, and how each is measured on a live gradient.

A candidate is either a **bucket mode** (``ddp``: fp32 DDP as without a hook; ``fp16``/``bf16``:
torch's 16-bit compress hook; both on DDP's own buckets, overlapped with backward) or an **engine
method** (a lightning_gc compressor on the engine's one-group plan, with its natural collective).
Defaults (docs/auto.md): the three baselines users already have (``ddp``, ``fp16``, ``lowrank_bf16``:
our PowerSGD-family compressor, rank 2, its two messages in bfloat16) and the compressors that pay
on slow links (``topk`` 1 % on allgather, ``qsgd``, ``efsign``); ``artopk`` (1 %,
allgather/ART-Ring/ART-Tree by the cost model), ``topk3`` (Top-k 3 % on allgather), ``lowrank``
(rank 2 in fp32 messages, as torch's hook sends), ``lowrank1`` (rank 1, torch's hook's default) and
``bf16`` on request.

:func:`measure_method` turns one candidate into a :class:`~lightning_gc.auto.model.MethodCost` on
this machine: its codec time comes from :func:`lightning_gc.bench.codec.time_codec` (the codec
micro-benchmark's one timing function) run on the live gradient, its bytes from the payload it
really produces, and its error ``delta2`` (:func:`measure_error`) from decompressing that payload.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..compressors import GroupContext, build_compressor
from ..engine.slots import MethodSpec
from .model import MethodCost

#: wire format of a compressor → how the model charges its bytes
_WIRE = {"allreduce": "allreduce", "allgather": "allgather", "lowrank": "lowrank", "artopk_auto": "sparse",
         "lowbit": "lowbit"}


@dataclass(frozen=True)
class AutoCandidate:
    """One method the chooser may pick: a bucket mode (``compressor is None``) or an engine method."""

    name: str
    compressor: str | None = None
    ratio: float | None = None
    compressor_args: dict[str, Any] = field(default_factory=dict)
    collective: str = "auto"

    def spec(self) -> MethodSpec:
        """The engine slot that runs this candidate (engine methods only)."""
        if self.compressor is None:
            raise ValueError(f"candidate {self.name!r} runs on DDP's buckets, not in an engine slot.")
        return MethodSpec(self.compressor, self.ratio, dict(self.compressor_args), self.collective, None)

    @property
    def dense_mode(self) -> str | None:
        """The engine's dense mode for a bucket candidate (``"fp32"``, ``"fp16"``, ``"bf16"``)."""
        if self.compressor is not None:
            return None
        return "fp32" if self.name == "ddp" else self.name


CANDIDATES: dict[str, AutoCandidate] = {
    "ddp": AutoCandidate("ddp"),
    "fp16": AutoCandidate("fp16"),
    "bf16": AutoCandidate("bf16"),
    "topk": AutoCandidate("topk", "topk", 0.01, {}, "allgather"),
    # 3 % on request: fewer steps to a target than 1 % where 1 % loses too much, for 3x its bytes
    "topk3": AutoCandidate("topk3", "topk", 0.03, {}, "allgather"),
    "artopk": AutoCandidate("artopk", "artopk_auto", 0.01, {}, "auto_sparse"),
    "qsgd": AutoCandidate("qsgd", "qsgd"),
    "efsign": AutoCandidate("efsign", "efsignsgd"),
    "lowrank": AutoCandidate("lowrank", "lowrank", None, {"rank": 2}),
    # rank 1 on request (torch's powerSGD_hook default, half of rank 2's bytes): its error can cost more
    # progress than the sample shows, so it is not a default
    "lowrank1": AutoCandidate("lowrank1", "lowrank", None, {"rank": 1}),
    # the k-bit ring (bytes flat in N), on request: not measured by auto's runs yet; its δ² is one
    # rounding's, which the model's efficiency scales by lowbit.ring_error_factor(N)
    "lowbit": AutoCandidate("lowbit", "lowbit", None, {"bits": 4}),
    "lowbit8": AutoCandidate("lowbit8", "lowbit", None, {"bits": 8}),
    # rank 2 in bfloat16 messages: rank 1's fp32 bytes at rank 2's error (LowRankConfig.wire_dtype)
    "lowrank_bf16": AutoCandidate("lowrank_bf16", "lowrank", None, {"rank": 2, "wire_dtype": "bfloat16"}),
}
#: the default candidate list, in tie-break order (earlier wins an exact tie)
#: ``artopk`` is not among them: its error on the gradient sample equals Top-k's, but its aggregate keeps
#: only one source rank's indices, which the sample cannot show. Add it to ``candidates`` to let auto choose it.
#: warm-started compressors' error is measured after this many steps on the live gradient (see
#: LowRankCompressor.warm_compress): the cold start and one warm-started step
WARM_STEPS = 2

DEFAULT_CANDIDATES: tuple[str, ...] = ("ddp", "fp16", "lowrank_bf16", "topk", "qsgd", "efsign")


def candidate(name: str) -> AutoCandidate:
    """The candidate called ``name``; unknown names are refused with the valid ones."""
    try:
        return CANDIDATES[name]
    except KeyError:
        raise ValueError(f"auto candidate {name!r} is unknown; valid: {', '.join(CANDIDATES)}.") from None


def _sum_of_squares(sq: Tensor) -> float:
    """The sum of a tensor of squares in float32 (torch's cascaded CPU sum is close to float64's and
    several times faster), again in float64 only where the float32 sum overflowed or came to 0."""
    v = float(sq.sum())
    if v == 0.0 or not math.isfinite(v):
        v = float(sq.sum(dtype=torch.float64))
    return v


def squared_norm(x: Tensor) -> float:
    """``‖x‖²``: the denominator of every candidate's :func:`measure_error` (compute it once per sample)."""
    return _sum_of_squares(x.square())


def _relative_error(x: Tensor, sent: Tensor, x2: float | None = None) -> float:
    """``‖sent − x‖² / ‖x‖²`` without float64 copies (the difference of two close float32 values is
    exact; the sums are :func:`_sum_of_squares`'s): the errors are measured again on the step's
    critical path. ``x2``: ``‖x‖²`` (:func:`squared_norm`) if the caller has it."""
    if x2 is None:
        x2 = squared_norm(x)
    if x2 == 0.0:
        return 0.0
    d2 = _sum_of_squares((sent - x).square_()) / x2
    return d2 if math.isfinite(d2) else 1e6  # an overflowing cast (fp16 past 65504) is as good as lost


def rank_payloads(flat: Tensor, ctx: GroupContext, world_size: int) -> tuple[list[Tensor], list[GroupContext]]:
    """``world_size`` ranks' inputs for timing a codec on one machine: ``flat`` slightly rescaled per
    rank (so that aggregation does real work) and each rank's context (``ctx`` with its rank and the
    world size). :func:`measure_method` and ``lightning-gc advise``'s aggregation timings use it."""
    n = max(int(world_size), 1)
    xs = [flat * (1.0 + 0.01 * r) for r in range(n)]
    ctxs = [GroupContext(step=ctx.step, rank=r, world_size=n, segments=ctx.segments, group_id=ctx.group_id,
                         seed=ctx.seed, device=flat.device, shapes=ctx.shapes, names=ctx.names) for r in range(n)]
    return xs, ctxs


def measure_error(cand: AutoCandidate, flat: Tensor, ctx: GroupContext, comp: Any = None,
                  norm2: float | None = None) -> float:
    """The relative error ``δ² = ‖C(g) − g‖² / ‖g‖²`` of what ``cand`` sends for the gradient ``flat``
    (this rank's own, as each rank compresses its own): a 16-bit cast's rounding, a compressor's
    decompressed payload — for a warm-started compressor (``lowrank``) after :data:`WARM_STEPS`
    steps, not its cold start from a random ``Q`` (``LowRankCompressor.warm_compress``). ``ddp`` is
    exact (0). The chooser's progress proxy (:func:`lightning_gc.auto.model.efficiency`). ``comp``: the
    candidate's compressor if the caller built one already (a fresh one otherwise); ``norm2``:
    ``‖flat‖²`` (:func:`squared_norm`) where the caller measures several candidates on one sample."""
    if cand.compressor is None:
        if cand.name == "ddp":
            return 0.0
        dtype = torch.float16 if cand.name == "fp16" else torch.bfloat16
        return _relative_error(flat, flat.to(dtype).float(), norm2)
    return _sent_error(cand, flat, ctx, comp, norm2)[0]


def _sent_error(cand: AutoCandidate, flat: Tensor, ctx: GroupContext, comp: Any = None,
                norm2: float | None = None) -> tuple[float, int]:
    """An engine candidate's ``δ²`` on ``flat`` (see :func:`measure_error`) and the bytes of that payload."""
    if comp is None:
        comp = build_compressor(cand.compressor, cand.ratio, dict(cand.compressor_args) or None)
    warm = getattr(comp, "warm_compress", None)
    c = warm(flat, ctx, WARM_STEPS) if warm is not None else comp.compress(flat, ctx)
    return _relative_error(flat, comp.decompress(c.payload, c.meta, ctx), norm2), int(c.nbytes)


def measure_method(cand: AutoCandidate, flat: Tensor, ctx: GroupContext, world_size: int, repeats: int = 3,
                   exact_bytes: float = 0.0, time_codec: bool = True, norm2: float | None = None) -> MethodCost:
    """Measure one candidate on this rank (local values; the chooser agrees them across ranks).

    ``flat``: the model's compressed group as the engine flattens it (a live gradient); ``ctx``: its
    group context (segments and shapes of its tensors). Bucket modes cost their cast (two passes)
    and no codec; engine methods run :func:`time_method_codec` with ``world_size`` payloads made
    from ``flat`` (slightly rescaled per rank, so aggregation does real work). The error is
    :func:`measure_error`'s.

    ``time_codec=False`` (engine methods): payload and error only, from one compression; the codec is
    left untimed (``codec_s`` 0, ``codec_timed`` False: a lower bound the chooser times on demand,
    ``AutoConfig.time_codecs``): timing is most of a measurement's cost. ``norm2``: as for
    :func:`measure_error`."""
    if cand.compressor is None:
        from ..compressors.timing import time_runs

        if cand.name == "ddp":
            return MethodCost("ddp", "bucket", 0.0)
        dtype = torch.float16 if cand.name == "fp16" else torch.bfloat16
        out = torch.empty_like(flat)
        cast_s = statistics.median(time_runs(lambda: out.copy_(flat.to(dtype).div_(world_size)), repeats))
        return MethodCost(cand.name, "bucket", cast_s, delta2=measure_error(cand, flat, ctx, norm2=norm2))
    comp = build_compressor(cand.compressor, cand.ratio, dict(cand.compressor_args) or None)
    wire = _WIRE.get(comp.wire_format)
    if wire is None:
        raise ValueError(f"auto cannot model compressor {cand.compressor!r} (wire format {comp.wire_format!r}); "
                         f"use one of the candidates {', '.join(CANDIDATES)}.")
    codec_s = time_method_codec(cand, flat, ctx, world_size, repeats, comp) if time_codec else 0.0
    # the error with this rank's context, as the gain re-measurement takes it; on a compressor the timing
    # did not run (a fresh one after it: timing leaves state, e.g. a warm start)
    delta2, payload = _sent_error(cand, flat, ctx, None if time_codec else comp, norm2)
    ratio = float(comp.ratio) if comp.has_ratio else 0.0
    if wire == "lowrank":  # the exact group rides in the P message, in its type
        exact_bytes = float(exact_bytes) * comp.wire_element_size / 4
    return MethodCost(cand.name, wire, codec_s, float(payload), delta2, bool(comp.default_error_feedback and comp.lossy),
                      sparse_ratio=ratio, value_bytes=float(flat.element_size()), exact_bytes=float(exact_bytes),
                      codec_timed=bool(time_codec))


def time_method_codec(cand: AutoCandidate, flat: Tensor, ctx: GroupContext, world_size: int, repeats: int = 3,
                      comp: Any = None) -> float:
    """One engine candidate's codec seconds per step on this rank:
    :func:`~lightning_gc.compressors.timing.time_codec` (the codec micro-benchmark's timing) on
    ``world_size`` payloads made from ``flat`` (:func:`rank_payloads`); ``comp``: the compressor to
    time (a fresh one otherwise)."""
    from ..compressors.timing import time_codec

    if comp is None:
        comp = build_compressor(cand.compressor, cand.ratio, dict(cand.compressor_args) or None)
    xs, ctxs = rank_payloads(flat, ctx, world_size)
    return float(time_codec(comp, xs, ctxs, repeats)["engine_codec_s"])
