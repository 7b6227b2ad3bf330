"""One optimizer state on every rank, from the ranks' drifted ones: what leaving DiLoCo for per-step
synchronisation needs.

During a DiLoCo round each rank's inner optimizer steps on its own gradients, so its state (AdamW's
moments, SGD's momentum buffer) drifts apart from the other ranks'. Per-step data parallelism needs
identical state on every rank, or identical gradients give different updates and the replicas split.

**Which state.** Every floating-point state tensor becomes its mean over the ranks. Keeping one
rank's state (rank 0's) would throw away the other replicas' estimates and lean on one data shard;
the mean uses all of them. For Adam's second moment the mean of the ranks' ``v`` is at least the
``v`` of the mean gradient (Jensen), so the first per-step updates after the switch are, if anything,
smaller than a freshly averaged gradient's moments would give: the cautious side. Integer and
boolean state and step counters (:data:`COUNTER_KEYS`) must already agree, because every rank took the same number of inner
steps; a disagreement raises on every rank rather than averaging counts.

The mean is a sum over the ranks by the backend's allreduce, divided by ``N``: every rank ends with
the same bits, because the allreduce hands every rank the same reduced values. The sum travels in
fp32 (or the state's own wider dtype) by default. ``wire_dtype=torch.bfloat16`` halves the bytes:
each rank's state is rounded to bfloat16 and summed in it, which moves each element by a few parts in
a thousand (8 bits of mantissa, rounded at each of the ``N − 1`` partial sums), while bfloat16 keeps
fp32's exponent range, which Adam's second moment needs (fp16 would flush small ``v`` to zero). An
optimizer's moments are running estimates, and an error of that size is far below their own noise;
the switch is taken once per trial, so what it costs is its time on a slow link.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .._finite import all_finite
from ..comm.cost_model import ring_allreduce_bytes

#: state keys that count steps: checked equal, never averaged (torch's Adam family keeps ``step`` as a
#: floating-point tensor)
COUNTER_KEYS = ("step",)


def _state_tensors(optimizer: torch.optim.Optimizer, only: list[Tensor] | None = None) -> list[tuple[str, Tensor, bool]]:
    """Every tensor of the optimizer's per-parameter state in parameter order (of the parameters
    ``only``, where given): (name, tensor, whether it is averaged: floating point and not a step counter)."""
    keep = None if only is None else {id(p) for p in only}
    out = []
    for gi, group in enumerate(optimizer.param_groups):
        for pi, p in enumerate(group["params"]):
            if keep is not None and id(p) not in keep:
                continue
            for key, value in sorted(optimizer.state.get(p, {}).items()):
                if isinstance(value, Tensor):
                    averaged = torch.is_floating_point(value) and key not in COUNTER_KEYS
                    out.append((f"group {gi} param {pi} {key!r}", value, averaged))
    return out


def _spread(values: Tensor, group: Any) -> tuple[Tensor, Tensor]:
    """The element-wise minimum and maximum of ``values`` over the ranks (float64)."""
    lo = values.detach().to(torch.float64).reshape(-1).clone()
    hi = lo.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    return lo, hi


def _check_layout(tensors: list[tuple[str, Tensor, bool]], group: Any) -> None:
    """Same number of state tensors with the same element counts on every rank (else a collective
    below would pair different tensors): a clear error on every rank."""
    lo, hi = _spread(torch.tensor([float(len(tensors)), float(sum(t.numel() for _, t, _ in tensors))]), group)
    if not torch.equal(lo, hi):
        raise ValueError(f"the ranks' optimizer states differ in layout ({int(lo[0])}–{int(hi[0])} state tensors, "
                         f"{int(lo[1])}–{int(hi[1])} elements): build the same optimizer on every rank, over the "
                         "same parameters, before averaging its state.")


def _check_equal(name: str, t: Tensor, group: Any) -> None:
    lo, hi = _spread(t, group)
    if not torch.equal(lo, hi):
        raise ValueError(f"optimizer state {name} differs between ranks ({lo.tolist()[:4]} … {hi.tolist()[:4]}); it "
                         "counts steps and cannot be averaged. Every rank must have taken the same optimizer steps.")


def average_optimizer_state(optimizer: torch.optim.Optimizer, group: Any = None,
                            wire_dtype: torch.dtype | None = None) -> int:
    """Replace every floating-point state tensor of ``optimizer`` by its mean over the ranks of
    ``group`` (see the module docstring); returns the bytes this rank sent. ``wire_dtype``: the
    dtype the sum travels and accumulates in (None: fp32, or the state's own wider dtype;
    ``torch.bfloat16``: half the bytes). A collective: every rank of the group calls it, with the
    same optimizer built over the same parameters and the same ``wire_dtype``."""
    if wire_dtype is not None and not (isinstance(wire_dtype, torch.dtype) and wire_dtype.is_floating_point):
        raise ValueError(f"wire_dtype={wire_dtype!r} must be a floating-point torch.dtype, e.g. torch.bfloat16, "
                         "or None for fp32.")
    world_size = dist.get_world_size(group)
    tensors = _state_tensors(optimizer)
    _check_layout(tensors, group)
    sent = 0
    for name, t, averaged in tensors:
        if not averaged:
            _check_equal(name, t, group)
            continue
        wire = _summed(t, wire_dtype, group)
        t.detach().copy_(wire.to(torch.promote_types(t.dtype, torch.float32)).div_(world_size))
        sent += ring_allreduce_bytes(wire.numel() * wire.element_size(), world_size)
    return sent


def _summed(t: Tensor, wire_dtype: torch.dtype | None, group: Any, send_zeros: bool = False) -> Tensor:
    """The sum over the ranks of ``t`` (of zeros of its shape, with ``send_zeros``), in ``wire_dtype``
    (None: fp32 or ``t``'s own wider dtype); a new tensor, ``t`` is left as it is."""
    dtype = wire_dtype or torch.promote_types(t.dtype, torch.float32)
    wire = torch.zeros(t.shape, dtype=dtype, device=t.device) if send_zeros else t.detach().to(dtype, copy=True)
    dist.all_reduce(wire, group=group)
    return wire


def repair_optimizer_state(optimizer: torch.optim.Optimizer, params: list[Tensor], group: Any = None,
                           wire_dtype: torch.dtype | None = None) -> int:
    """Where a rank's state of ``params`` holds a non-finite value, replace it by the mean of the ranks
    whose state is finite; returns the bytes this rank sent. A collective, called by every rank of
    ``group`` alike (DiLoCo calls it where it discards a round, which every rank knows).

    Why: a NaN gradient on one rank makes its momentum (or Adam's moments) NaN, so every later inner
    step on that rank is NaN again and every later round is discarded; and leaving DiLoCo would
    average it into every rank. The mean of the finite ranks is the estimate of the same quantity
    from the other shards, at the same step count, so bias corrections stay right (zeroing the moments
    at a late step would make Adam's next updates several times too large). Ranks whose state is
    finite keep their own. Where no rank's is, every rank drops that state (the optimizer starts it
    afresh at its next step, on every rank alike, so step counters still agree). Costs one flag
    allreduce where every rank is finite, and one allreduce of the state otherwise."""
    tensors = _state_tensors(optimizer, params)
    if not tensors:
        return 0
    _check_layout(tensors, group)
    world_size = dist.get_world_size(group)
    ok = all(all_finite(t) for _, t, averaged in tensors if averaged)
    flag = torch.tensor([float(ok)], device=tensors[0][1].device)
    dist.all_reduce(flag, group=group)
    n_ok, sent = int(flag.item()), ring_allreduce_bytes(4, world_size)
    if n_ok == world_size:
        return sent
    if n_ok == 0:
        for p in params:
            optimizer.state.pop(p, None)
        return sent
    for _, t, averaged in tensors:
        if not averaged:
            continue
        wire = _summed(t, wire_dtype, group, send_zeros=not ok)
        if not ok:
            t.detach().copy_(wire.to(torch.promote_types(t.dtype, torch.float32)).div_(n_ok))
        sent += ring_allreduce_bytes(wire.numel() * wire.element_size(), world_size)
    return sent


__all__ = ["COUNTER_KEYS", "average_optimizer_state", "repair_optimizer_state"]
