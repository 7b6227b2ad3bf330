"""PowerSGD-family low-rank compression (Vogels et al., NeurIPS 2019), the pure tensor math.

Why it exists. torch's ``powerSGD_hook`` is what users pick today when bandwidth is short; it is
a DDP hook, so it cannot take part in lightning_gc's decisions (plans, OSP, DiLoCo, a run-time
choice between methods, byte accounting). This is the same family inside the engine: one
compressor, ``compressor="lowrank"``, with error feedback and warm start, on its own exchange.

The method, per gradient tensor reshaped to a matrix ``M`` (``n × m``: the first dimension by
the product of the others, as torch's hook does), with a rank ``r`` and a matrix ``Q`` (``m × r``)
kept from the previous step (warm start):

1. ``P = M·Q`` on every rank; **allreduce** the ``P`` of all matrices (with the group's small
   tensors, which travel dense in the same message);
2. ``P̂ = orthonormal basis of ΣP`` (``torch.linalg.qr``; computed on every rank from the same
   sum, so identical);
3. ``Q = Mᵀ·P̂`` on every rank; **allreduce** the ``Q`` of all matrices; divide by N;
4. the aggregated gradient is ``M̂ = P̂·Q̄ᵀ`` (= ``P̂·P̂ᵀ·M̄``, the mean gradient projected onto the
   column space of ``P̂``), and ``Q̄`` is kept for the next step.

One power-iteration step per training step; with warm start, ``Q`` tracks the dominant subspace
across steps (the paper's Algorithm 1). Bytes per matrix: ``(n + m)·r`` floats against ``n·m``.

Decisions where the paper and torch's hook leave room (docs/compressors.md, lowrank):

* **Error feedback** keeps ``e = M − P̂·P̂ᵀ·M`` per rank — the part of *this rank's* ``M`` outside
  the agreed subspace, which is what the paper's Algorithm 2 writes as ``Δ − DECOMPRESS(C(Δ))``
  for the local ``Q = Mᵀ·P̂``. torch's hook keeps ``M − P̂·Q̄ᵀ`` instead (the local input minus
  the *global* approximation). Both leave the same mean error across ranks; the local form is
  orthogonal to ``P̂`` and never larger than ``M``, while the global form also carries each rank's
  deviation from the mean, a running sum of gradient noise (the mechanism described for Marsit in
  docs/compressors.md). The engine's conservation law then holds per rank: what was not sent is
  exactly what is remembered.
* **Which tensors are compressed**: a tensor with two or more dimensions whose matrix ``n × m``
  satisfies ``r < min(n, m)`` and ``n·m ≥ min_compression_rate·(n + m)·r`` (torch's rule, default
  2), unless its parameter name matches one of ``dense_names``; every other tensor (biases, norms,
  small matrices, the named ones) is sent dense in fp32 with the first allreduce, exactly, without
  error memory. ``dense_names`` exists for matrices whose gradient a rank-r subspace serves badly,
  such as a tied embedding that carries much of the gradient's energy: sending it dense narrows
  the loss gap to DDP at the price of its full bytes (docs/compressors.md).
* **Initial Q**: standard normal from a generator shared by all ranks (the strategy's seed and the
  parameter's position), as torch does; not orthogonalised (``P̂`` is).
* **Warm start state** (``Q̄`` per compressed tensor) is keyed by the parameter's name and shape,
  so a new merge plan keeps it; it is in checkpoints (the exchange's state) and is only updated when
  ``Q̄`` is finite on the step (a non-finite gradient is skipped by the engine; the subspace it
  would have produced is not kept).

* **16-bit messages** (``wire_dtype="bfloat16"``, not in the paper or torch's hook): both
  allreduces travel in bfloat16, halving the bytes, so rank 2 costs rank 1's fp32 bytes. Each rank
  divides its message by N first and casts; the sum is accumulated in bfloat16 by the backend and
  widened to fp32 before the orthogonalisation and the decompression, so every rank still computes
  the same ``P̂`` from the same sum. bfloat16, not float16: ``P = M·Q`` scales with the *square* of
  the gradient's scale (with warm start ``Q̄ ≈ Mᵀ·P̂``), which leaves float16's range (6e-5 to
  65504) for ordinary gradients; bfloat16 has float32's range. The rounding (8 significant bits,
  a relative 2⁻⁹ per element) is small against the rank-r approximation's own error; what this
  rank sent is taken *after* its rounding, so error feedback keeps the rounding of the compressed
  matrices and of the group's dense tensors too. The plan's exact group, carried in the ``P``
  message, is rounded without error memory, as torch's ``bf16_compress_hook`` rounds every
  gradient. Costs two casts per message (measured with the codec micro-benchmark, like any codec).

Tuning. ``rank`` (r): 1 sends the least and converges slowest; the paper's accuracy matched SGD at
r = 2 to 4 on its image and language models. ``min_compression_rate``: raise it to send more
tensors dense. ``warm_start=False`` draws a fresh Q every step (the paper's ablation: worse).
``dense_names``: parameter-name patterns (``fnmatch``: ``"tok_emb.weight"``, ``"*emb*"``) sent
dense; it costs their full fp32 bytes every step, so name only the matrices that a per-parameter
fidelity breakdown (``GradientFidelity(per_parameter=True)``) shows losing the most.
``wire_dtype="bfloat16"``: where bytes dominate the step (slow links), half the bytes at the same
rank; keep ``"float32"`` where the exact group must arrive exactly.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

#: the types a ``lowrank`` message may travel in (``LowRankConfig.wire_dtype``)
WIRE_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class LowRankConfig:
    """Options of the low-rank (PowerSGD-family) compressor.

    Attributes:
        rank: r, the rank of each compressed matrix's approximation (≥ 1). Typical 1–4.
        min_compression_rate: compress a matrix ``n × m`` only if ``n·m ≥ rate·(n + m)·r``; the
            others are sent dense (torch's rule, default 2).
        warm_start: reuse the previous step's ``Q̄`` (True, the paper's method) or draw a fresh one.
        dense_names: ``fnmatch`` patterns of parameter names sent dense (exactly) even where they
            would be compressed, e.g. ``("tok_emb.weight",)`` (a string is one pattern); empty by default.
        wire_dtype: the type both allreduces travel in: ``"float32"`` (default, torch's hook) or
            ``"bfloat16"`` (half the bytes; see :data:`WIRE_DTYPES` and the module docstring).
    """

    rank: int = 2
    min_compression_rate: float = 2.0
    warm_start: bool = True
    dense_names: tuple[str, ...] = ()
    wire_dtype: str = "float32"

    def __post_init__(self) -> None:
        r = self.rank
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise ValueError(
                f"rank={r!r} is invalid: it is the rank of each gradient matrix's low-rank approximation and "
                "must be an integer ≥ 1. Use e.g. rank=2 (1 sends the least, 4 is closer to dense)."
            )
        rate = self.min_compression_rate
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not math.isfinite(rate) or rate < 1.0:
            raise ValueError(
                f"min_compression_rate={rate!r} is invalid: a matrix n×m is compressed only if n·m ≥ rate·(n+m)·r, "
                "so the rate must be a finite number ≥ 1 (1: compress whenever it saves bytes). Default 2."
            )
        if not isinstance(self.warm_start, bool):
            raise ValueError(f"warm_start={self.warm_start!r} must be True or False.")
        names = (self.dense_names,) if isinstance(self.dense_names, str) else self.dense_names  # one pattern
        if not isinstance(names, Sequence) or not all(isinstance(n, str) and n for n in names):
            raise ValueError(
                f"dense_names={self.dense_names!r} is invalid: it is a list of parameter-name patterns (fnmatch) "
                "sent dense, e.g. ['tok_emb.weight'] or ['*emb*'] (or one pattern as a string)."
            )
        object.__setattr__(self, "dense_names", tuple(names))  # a YAML list becomes a hashable tuple
        if self.wire_dtype not in WIRE_DTYPES:
            raise ValueError(
                f"wire_dtype={self.wire_dtype!r} is invalid: it is the type the factors and the dense tensors "
                f"travel in; use one of {sorted(WIRE_DTYPES)} ('bfloat16' halves the bytes; 'float16' is not "
                "offered: P = M·Q has the square of the gradient's scale and leaves fp16's range)."
            )

    @property
    def wire_torch_dtype(self) -> torch.dtype:
        """The torch dtype of :attr:`wire_dtype`."""
        return WIRE_DTYPES[self.wire_dtype]

    def sends_dense(self, name: str) -> bool:
        """Whether parameter ``name`` is named by ``dense_names``."""
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in self.dense_names)


@dataclass(frozen=True)
class Block:
    """One tensor of a group: where it lies in the flat gradient and how it travels."""

    index: int  # position of the tensor in the group
    offset: int
    numel: int
    rows: int  # n (0: sent dense)
    cols: int  # m

    @property
    def compressed(self) -> bool:
        return self.rows > 0


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int] | None:
    """``(n, m)`` of a tensor seen as a matrix: first dimension by the rest (None below 2-D)."""
    if len(shape) < 2:
        return None
    n = int(shape[0])
    return n, int(math.prod(shape[1:]))


def plan_blocks(segments: tuple[int, ...], shapes: tuple[tuple[int, ...], ...], config: LowRankConfig,
                names: tuple[str, ...] = ()) -> list[Block]:
    """Which tensors of a group are compressed (see the module docstring), with their offsets.

    Without shapes (a caller that knows only the flat group) every tensor is sent dense; without
    names, ``dense_names`` cannot apply (every caller in the engine passes them)."""
    blocks, offset = [], 0
    for i, numel in enumerate(segments):
        nm = matrix_shape(shapes[i]) if i < len(shapes) else None
        if nm is not None and i < len(names) and config.sends_dense(names[i]):
            nm = None
        rows = cols = 0
        if nm is not None:
            n, m = nm
            r = config.rank
            if r < min(n, m) and n * m >= config.min_compression_rate * (n + m) * r:
                rows, cols = n, m
        blocks.append(Block(i, offset, numel, rows, cols))
        offset += numel
    return blocks


def initial_q(cols: int, rank: int, generator: torch.Generator, device: torch.device) -> Tensor:
    """A standard normal ``m × r`` start (identical on every rank for a shared generator)."""
    return torch.randn(cols, rank, generator=generator, dtype=torch.float32, device=device)


#: up to this many columns the thin products go short-wide (:func:`project`); above it torch's own form
SHORT_WIDE_MAX_RANK = 8


def project(m: Tensor, q: Tensor) -> Tensor:
    """``m·q`` for a matrix ``m`` (``n × k``) and a thin ``q`` (``k × r``): ``P = M·Q``.

    For r ≤ :data:`SHORT_WIDE_MAX_RANK`, computed as ``(qᵀ·mᵀ)ᵀ`` (``qᵀ`` copied, ``r × k``), the
    same product, returned as a transposed view (``n × r``). Why: the BLAS of torch's CPU wheel
    sends a product with 2 to 8 columns down a slow path (``sgemm_pst`` in a profile), the
    short-wide form down its blocked kernel, several times faster; at r = 1 both take the
    matrix-vector path, and at larger r the plain form is faster (hence the bound; re-time both
    with the codec micro-benchmark before moving it). On a GPU both forms are one cuBLAS call
    with transpose flags."""
    if q.shape[1] > SHORT_WIDE_MAX_RANK:
        return m @ q
    return (q.t().contiguous() @ m.t()).t()


def project_t(m: Tensor, p: Tensor) -> Tensor:
    """``mᵀ·p`` for a matrix ``m`` (``n × k``) and a thin ``p`` (``n × r``): ``Q = Mᵀ·P̂``.

    Computed as ``(pᵀ·m)ᵀ`` for r ≤ :data:`SHORT_WIDE_MAX_RANK`, for the reason :func:`project`
    gives; a ``k × r`` transposed view."""
    if p.shape[1] > SHORT_WIDE_MAX_RANK:
        return m.t() @ p
    return (p.t().contiguous() @ m).t()


def orthonormal(p: Tensor) -> Tensor:
    """Orthonormal basis of the columns of ``p`` (``n × r``), by a reduced QR (LAPACK).

    A column that is zero (a zero gradient) gives a zero or arbitrary unit column; either way
    ``P̂·P̂ᵀ·M`` stays the projection of ``M`` onto a space that contains ``span(p)``."""
    q, _ = torch.linalg.qr(p, mode="reduced")
    return q
