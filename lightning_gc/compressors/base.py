"""The contract every compressor implements.

A compressor is a *pure tensor transform* on one flat group of gradients: it never talks to the
network. The engine (``lightning_gc.engine``) decides which tensors form a group, adds error
memory, hands the flat tensor to :meth:`Compressor.compress`, moves the resulting payload with
the collective the compressor's *format* calls for, and asks the compressor to turn what arrived
back into the mean gradient.

Two wire formats exist, and each compressor declares which one it speaks:

``"allreduce"``
    The payload is *linear*: the element-wise sum of all ranks' payloads is a valid payload
    (dense, fp16/bf16 casts, RandomK values at shared indices). It travels by ``all_reduce`` and
    :meth:`Compressor.aggregate_summed` turns the sum into the mean.
``"allgather"``
    The payload has a *fixed size* for a given group size (Top-k values + int32 indices, QSGD
    levels, packed sign bits). Every rank receives every other rank's payload through one
    ``all_gather`` of a byte buffer and :meth:`Compressor.aggregate_gathered` combines them.

Other formats name an exchange family that needs more than one collective (``"artopk"``,
``"artopk_auto"``: broadcast of indices, then allreduce; ``"marsit"``: a P2P ring that merges sign
bits hop by hop, :mod:`lightning_gc.exchanges.marsit`; ``"lowrank"``: PowerSGD's two
allreduces with an orthogonalisation between them, :mod:`lightning_gc.exchanges.lowrank`; ``"lowbit"``:
a P2P ring that dequantises, sums in fp32 and requantises k-bit blocks at every hop,
:mod:`lightning_gc.exchanges.lowbit`);
only their own exchanges can carry them.

Randomness: ``ctx.shared_generator()`` returns a generator whose state is a pure function of
``(seed, step, group)`` and therefore identical on every rank (RandomK's indices);
``ctx.private_generator()`` additionally mixes in the rank (QSGD's stochastic rounding). No
compressor touches the global RNG, and because the streams are derived rather than carried, a run
resumed from a checkpoint draws exactly the numbers the uninterrupted run drew.
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor

WireFormat = Literal["allreduce", "allgather", "artopk", "artopk_auto", "marsit", "gradiveq", "lowrank", "lowbit"]

_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant for seed mixing


def _mix_seed(*parts: int) -> int:
    """Combine integers into a 63-bit seed (deterministic, platform independent)."""
    h = 0x243F6A8885A308D3
    for p in parts:
        h = (h ^ (int(p) & 0xFFFFFFFFFFFFFFFF)) * _MIX & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 29
    return h & 0x7FFFFFFFFFFFFFFF


@dataclass(frozen=True)
class GroupContext:
    """Everything a compressor may know about the group it is compressing.

    Attributes:
        step: optimizer step (identical on all ranks).
        rank: this process's rank in the communication group.
        world_size: number of ranks in the communication group.
        segments: number of elements of each parameter tensor in the flat group, in order
            (layer-wise compressors use them).
        group_id: index of the group in the merge plan.
        seed: the strategy's seed.
        device: device of the gradients.
        shapes: shape of each parameter tensor of the group, in order (empty when unknown;
            compressors that slice by layer structure, such as GradiVeQ, read them).
        names: parameter name of each tensor of the group, in order (empty when unknown).
        shard: which shard of the group this rank compresses when the exchange runs by nodes (its
            local rank; ``topology="nodes"``); 0 flat. It is mixed into the random streams, so the
            node's shards draw independently while the same shard on every node draws alike.
    """

    step: int
    rank: int
    world_size: int
    segments: tuple[int, ...]
    group_id: int = 0
    seed: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    shapes: tuple[tuple[int, ...], ...] = ()
    names: tuple[str, ...] = ()
    shard: int = 0

    @property
    def numel(self) -> int:
        return sum(self.segments)

    def shared_generator(self, salt: int = 0) -> torch.Generator:
        """A generator in the same state on every rank for this (seed, step, group, salt)."""
        g = torch.Generator(device=self.device)
        g.manual_seed(_mix_seed(self.seed, self.step, self.group_id, salt, 1, *self._shard_part()))
        return g

    def private_generator(self, salt: int = 0) -> torch.Generator:
        """A generator private to this rank for this (seed, step, group, salt)."""
        g = torch.Generator(device=self.device)
        g.manual_seed(_mix_seed(self.seed, self.step, self.group_id, salt, 2, self.rank + 1, *self._shard_part()))
        return g

    def _shard_part(self) -> tuple[int, ...]:
        """Nothing flat (the flat streams stay what they always were), else a tag and the shard."""
        return (3, self.shard) if self.shard else ()


@dataclass
class Compressed:
    """Result of :meth:`Compressor.compress`.

    ``payload`` is what travels (tensors, all of fixed shape for a given group size); ``meta`` is
    local bookkeeping that never travels (e.g. RandomK's shared indices).
    """

    payload: tuple[Tensor, ...]
    meta: Any = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.payload)


def ratio_to_k(ratio: float, numel: int) -> int:
    """Number of elements kept: ``k = max(1, ceil(ratio * numel))``, capped at ``numel``."""
    return min(numel, max(1, math.ceil(ratio * numel)))


def validate_ratio(ratio: float, compressor: str) -> float:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not (0.0 < float(ratio) <= 1.0):
        raise ValueError(
            f"ratio={ratio!r} is invalid for compressor {compressor!r}: it is the fraction of gradient "
            f"elements kept and must lie in (0, 1]. Use e.g. ratio=0.01 to keep 1%."
        )
    return float(ratio)


class Compressor(ABC):
    """Base class. Subclasses set the class attributes and implement compress/decompress."""

    #: registry name (also the strategy alias suffix: ``gc_<name>``)
    name: ClassVar[str]
    #: which collective moves the payload
    wire_format: ClassVar[WireFormat]
    #: whether the transform loses information (dense is the only lossless one)
    lossy: ClassVar[bool] = True
    #: error feedback on by default?
    default_error_feedback: ClassVar[bool] = True
    #: the default instead with an Adam-family optimizer (:func:`adam_family`); None: the same.
    #: Error memory in gradient units meets Adam's per-coordinate normalisation badly for some
    #: compressors (docs/compressors.md, "Error feedback under Adam").
    adam_error_feedback: ClassVar[bool | None] = None
    #: what travels, in words (used in messages, e.g. when a collective is refused)
    wire_description: ClassVar[str] = "its compressed payload"
    #: the payload is exactly the input at some indices: ``payload = (values, int32 indices)``
    sends_exact_subset: ClassVar[bool] = False

    #: the typed, validated options (a frozen dataclass); the single home of the ratio
    config: Any = None

    @property
    def has_ratio(self) -> bool:
        """Whether the compressor has a ``ratio`` option (Top-k family, RandomK)."""
        return dataclasses.is_dataclass(self.config) and "ratio" in {f.name for f in dataclasses.fields(self.config)}

    @property
    def ratio(self) -> float:
        """The ``ratio`` option — the fraction of elements kept — for compressors that have one
        (Top-k family, RandomK, AR-Topk); 1.0 for the others. How much a payload weighs is a
        different quantity, :attr:`payload_fraction`."""
        return float(self.config.ratio) if self.has_ratio else 1.0

    @property
    def payload_fraction(self) -> float:
        """Roughly the fraction of dense fp32 bytes the payload occupies (monitoring and reports
        only; the exact bytes are counted per exchange). Defaults to :attr:`ratio`; compressors
        without a ratio option override it (QSGD's levels, one bit per sign, 16-bit casts, ...)."""
        return self.ratio

    def set_ratio(self, ratio: float) -> None:
        """Replace the ratio (validated by the config). The ratio lives in ``self.config`` only.

        Do not call this on a running engine: use ``GCEngine.set_ratio``, which checks that every
        rank asks for the same value and applies it at a step boundary.
        """
        if not self.has_ratio:
            raise ValueError(
                f"compressor {self.name!r} has no ratio option, so ratio={ratio!r} cannot be applied; "
                "use a Top-k family compressor or RandomK."
            )
        self.config = dataclasses.replace(self.config, ratio=ratio)

    @abstractmethod
    def compress(self, x: Tensor, ctx: GroupContext) -> Compressed:
        """Compress the flat 1-D tensor ``x`` (gradient plus error memory)."""

    @abstractmethod
    def decompress(self, payload: tuple[Tensor, ...], meta: Any, ctx: GroupContext) -> Tensor:
        """Dense 1-D tensor (``ctx.numel`` elements) that one rank's payload stands for."""

    def aggregate_gathered(self, payloads: list[tuple[Tensor, ...]], meta: Any, ctx: GroupContext) -> Tensor:
        """Mean over ranks from every rank's payload (allgather format). Default: mean of decompress."""
        out = self.decompress(payloads[0], meta, ctx).clone()
        for p in payloads[1:]:
            out.add_(self.decompress(p, meta, ctx))
        return out.div_(ctx.world_size)

    def aggregate_summed(self, summed: tuple[Tensor, ...], meta: Any, ctx: GroupContext) -> Tensor:
        """Mean over ranks from the element-wise sum of payloads (allreduce format)."""
        return self.decompress(summed, meta, ctx).div_(ctx.world_size)

    def payload_specs(self, ctx: GroupContext, dtype: torch.dtype) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """Shapes and dtypes of the payload for a group of ``ctx.numel`` elements of ``dtype``.

        Used to unpack gathered byte buffers; the default compresses a zero tensor once.
        """
        probe = self.compress(torch.zeros(ctx.numel, dtype=dtype, device=ctx.device), ctx)
        return [(tuple(t.shape), t.dtype) for t in probe.payload]

    def describe(self) -> str:
        """Name and full configuration; part of the cross-rank signature (a rank-dependent option
        such as ``ratio`` is detected at setup instead of deadlocking a collective)."""
        return f"{self.name}({self.config!r})" if self.config is not None else self.name

    def error_feedback_default(self, optimizers: Sequence[torch.optim.Optimizer]) -> bool:
        """Error feedback when the user gives none (``error_feedback=None``), once the optimizers are
        known: :attr:`adam_error_feedback` if it is set and an optimizer is of the Adam family,
        :attr:`default_error_feedback` otherwise. Identical on every rank (same optimizers)."""
        if self.adam_error_feedback is not None and adam_family(optimizers):
            return bool(self.adam_error_feedback)
        return bool(self.default_error_feedback)

    def adds_memory(self, step: int) -> bool:
        """Whether the engine adds the error memory to the gradient at optimizer step ``step``
        (replicated: a function of the step only). ``True`` by default. A compressor returns
        ``False`` for a step whose exchange should send the bare gradient and discard what the memory
        held: its exchange returns ``sent = p``, so the memory restarts from zero (Marsit's
        ``release_compensation=False``)."""
        return True

    def advice(self, optimizers: Sequence[torch.optim.Optimizer], error_feedback: bool) -> list[str]:
        """Warnings about how this compressor meets the rest of the training setup (optimizers,
        error feedback), printed once at setup on rank zero by the strategy. The algorithm knows its
        own measured pitfalls; the strategy carries no per-algorithm advice. None by default."""
        return []


def adam_family(optimizers: Sequence[torch.optim.Optimizer]) -> bool:
    """Whether any parameter group of these optimizers keeps Adam's moments: it has ``betas``
    (Adam, AdamW, NAdam, RAdam, Adamax, ... in torch.optim and most third-party variants)."""
    return any("betas" in group for opt in optimizers for group in opt.param_groups)
