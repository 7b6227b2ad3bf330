"""GradiVeQ: a PCA compressor that commutes with summation (Yu et al., NeurIPS 2018).

What it does. Every weight tensor of a group is *packed* so that the gradients of one layer's
F filters at the same (input channel, kernel position) sit next to each other, then cut into
slices of K elements. Slice m of rank r is sent as ``z = Uᵀ(x − μ̄_m)`` (d numbers, d < K), with
a K×d orthonormal basis ``U`` and a whitening vector ``μ̄_m``. Because this is *linear*,

    Σ_r z_r = Uᵀ(Σ_r x_r − N·μ̄_m)                                    (Eq. 4)

so compressed slices add up on the wire (any allreduce, or the ring of Algorithm 1 that compresses
the next segment while the previous one travels), and one decompression per slice gives the mean

    x̂ = U·(Σ_r z_r)/N + μ̄_m = P·x̄ + (I − P)·μ̄_m,   P = U Uᵀ             (Eq. 5, divided by N)

i.e. the projection of the true mean ``x̄`` onto span(U) plus the part of μ̄ outside span(U). (The
paper's μ is the mean of the *summed* gradients; here ``μ̄ = μ/N`` is kept in mean units, so
``z = Uᵀ(x − μ/N)`` is exactly Eq. 3.) That is ``outside_span="mu"``. The default,
``outside_span="zero"``, decompresses to ``U (Σz/N + Uᵀμ̄) = P·x̄``: outside span(U) the paper's
form re-applies the sampled mean μ̄ — a gradient from the sample phase — at every compressed step,
a stale gradient that costs accuracy (docs/compressors.md).

Packing and the slice size K (the paper's §3 "Parameter selection"). A weight of shape
``(F, D, *kernel)`` (a convolution: F filters of depth D; P = prod(kernel) positions) is laid out
as ``(P, D, F)``: the F collocated gradients first, then depth, then position (Fig. 3a). The unit
of correlation is ``F·D``; K is the largest multiple ``F·D·m`` (m divides P) that is at most
``max_slice``. When ``F·D`` itself exceeds ``max_slice`` (deep layers) the unit falls back to F
(the F filters at one (depth, position)): ``K = F·m`` with m dividing ``D·P``; when even F exceeds
it, K is the largest divisor of the tensor's size not above ``max_slice``. A linear layer
``(out, in)`` is a 1×1 convolution on one pixel (F = out, D = in, P = 1), so the same rule gives
``K = F·D`` for small layers and ``K = out·m`` for larger ones. The paper applies GradiVeQ to
convolutions only; here linear layers are compressed too (set ``compress_linear=False`` to keep
them exact). Tensors with fewer than two dimensions (biases, norms) or fewer than ``min_numel``
elements stay exact: their values travel, summed, in the same message.

The basis (Eq. 6). During the ``sample_steps`` (L_t) uncompressed steps the exchange records the
*aggregated* mean gradient (identical on every rank). For each block of ``reuse`` (s) consecutive
slices of a tensor (``reuse=0``: one basis per tensor, the paper's s = ∞) the covariance of the
sampled slices around their own slice means is decomposed (float64) and d is the smallest
dimension whose eigenvalue share reaches ``1 − lam`` (λ = 0.01 by default). The covariance has
rank ≤ n = L_t·``pca_slices``, usually far below K, so :func:`principal_axes` decomposes the n×n
Gram matrix of the samples with ``torch.linalg.eigh`` and maps its eigenvectors back (O(n²K)
instead of the K×K covariance's O(K³), which stalls training for seconds at large K). Because the
sampled spectrum is flat beyond the gradient's few strong directions, Eq. 6 keeps most of the sample
rank: **d grows with L_t·``pca_slices``**, which is the knob that trades bytes for accuracy. The
paper's first-slice sampling caps d at L_t − 1, which is where its K/d ≈ 8 comes from.
Samples per step and block: up to ``pca_slices`` evenly spaced slices of the block (the paper uses
the first slice only, which caps the covariance rank at L_t − 1; several slices give a usable
covariance from a short L_t). ``μ̄_m`` is the sample mean of slice m. U, μ̄ and d are computed from
replicated values by the same deterministic code on every rank, so they are bit-identical; the
exchange checks this with an 8-byte digest allgather after every fit.

Schedule (§3 "System overview"), by optimizer step (replicated):

* steps ``< warmup``: exact allreduce (the paper warms up 2,500 steps);
* then alternating: ``sample_steps`` (L_t) steps exchanged uncompressed — QSGD-quantised
  (``sample_levels`` levels, 7 = 4 bits as in the paper; 0 = exact fp32) — whose aggregated
  gradients are the PCA samples, then up to ``compress_steps`` (L_c) GradiVeQ steps;
* the compressed phase ends early when a majority of ranks report a local compression loss
  (Eq. 7, relative: ``‖x − x̂‖² / ‖x‖²`` over the compressed tensors, x̂ = ``P x`` or, with
  ``outside_span="mu"``, ``U z + μ̄``) above
  ``loss_threshold``; the counts are summed by one 16-byte allreduce per compressed step, so every
  rank switches at the same step (the next one).

Defaults are scaled to short runs: warm-up 50, L_t = 10, L_c = 20, so compression starts at step
60 (the paper: 2,500 / 100 / 400 on 45,000-step runs); both L_t = 10 (over 20) and
``outside_span="zero"`` (over the paper's Eq. 5) were chosen by measured accuracy
(docs/compressors.md). Tuning: smaller ``lam`` keeps more
dimensions (better accuracy, less compression); larger ``max_slice`` can find more correlation
(higher K/d) but costs O(K³) per basis fit and O(K·d) per slice per step; a longer L_t gives a
steadier basis but more uncompressed steps; L_c as long as the loss stays low.

Bytes per element on compressed steps: ``2·d/K`` for the compressed tensors and 2 for the exact
ones with the default ``coef_dtype="bfloat16"`` (``4·d/K`` and 4 with ``"float32"``), times the
ring's ``2(N−1)/N``; on sample steps those of QSGD (≈0.51 for 4 bits). bfloat16 coefficients are
an addition to the paper (which sends floats): they keep the linearity (partial sums are added in
the gradient's dtype and rounded to bfloat16 before each hop, so every rank ends with the same
bits) at a relative rounding of 2⁻⁹ per hop, far below the projection's own loss.
Error feedback is off by default (the paper has none); with it, the memory keeps
``p − (U z + μ̄)`` (the part outside span(U)) on compressed steps and QSGD's residual on sample
steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..._validation import check_int
from ..base import GroupContext

PHASES = ("warmup", "sample", "compress")
COEF_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class GradiVeQConfig:
    """Attributes (see the module docstring for the algorithm and tuning):
    lam: λ, loss threshold of Eq. 6 — d is the smallest dimension keeping a 1 − λ share of the
        sampled variance (0 ≤ λ < 1; 0.01 as in the paper).
    max_slice: upper bound of the slice size K (K = F·D·m, F·m or a divisor of the tensor size).
    reuse: s, consecutive slices sharing one basis; 0 = one basis per tensor (the paper's s = ∞).
    pca_slices: slices per basis block sampled at every sample step (evenly spaced; 1 = the
        paper's first slice only).
    warmup: optimizer steps exchanged exactly before the first sample step.
    sample_steps: L_t, uncompressed steps collecting PCA samples before each compressed phase.
    compress_steps: L_c, the longest compressed phase (it ends earlier on a high loss).
    loss_threshold: relative local loss (Eq. 7) above which a rank votes to end the compressed
        phase; the phase ends when more than half of the ranks vote. ``None`` disables.
    sample_levels: QSGD levels on sample steps (7 → 4 bits, as the paper); 0 = exact fp32.
    sample_bucket: QSGD bucket size on sample steps.
    min_numel: tensors with fewer elements stay exact.
    compress_linear: compress 2-D (linear) weights too; False keeps them exact (the paper).
    dim: fix d (capped at K) instead of choosing it by λ — for ablations and the d = K oracle.
    coef_dtype: dtype of the coefficients on the wire, ``"bfloat16"`` (default: 2 bytes, fp32's
        range, partial sums rounded to 8 significant bits at each ring hop) or ``"float32"`` (the
        paper). Compression, the basis and decompression always run in the gradient's dtype.
    outside_span: what the decompressed mean holds outside span(U): ``"zero"`` (default:
        ``U (Σz/N + Uᵀμ̄)`` = ``P x̄``, the projection of the true mean alone) or ``"mu"`` (the
        paper, Eq. 5: ``U Σz/N + μ̄`` = ``P x̄ + (I − P) μ̄``, the sampled mean's part there, which
        re-applies a stale gradient at every compressed step). Same bytes and cost.
    """

    lam: float = 0.01
    max_slice: int = 1024
    reuse: int = 0
    pca_slices: int = 32
    warmup: int = 50
    sample_steps: int = 10
    compress_steps: int = 20
    loss_threshold: float | None = 0.9
    sample_levels: int = 7
    sample_bucket: int = 512
    min_numel: int = 256
    compress_linear: bool = True
    dim: int | None = None
    coef_dtype: str = "bfloat16"
    outside_span: str = "zero"

    def __post_init__(self) -> None:
        lam = self.lam
        if isinstance(lam, bool) or not isinstance(lam, (int, float)) or not (0.0 <= float(lam) < 1.0):
            raise ValueError(
                f"lam={lam!r} is invalid: λ is the share of sampled gradient variance GradiVeQ may drop "
                "(Eq. 6) and must lie in [0, 1). Use 0.01 (the paper), smaller for more accuracy."
            )
        check_int("max_slice", self.max_slice, 2, "K is at most this; use e.g. 1024 (the paper: 768 for a 3x3x16x16 layer).")
        check_int("reuse", self.reuse, 0, "Use 0 for one basis per tensor (the paper's s = ∞).")
        check_int("pca_slices", self.pca_slices, 1, "Use e.g. 32 (1 = the paper's first slice only).")
        check_int("warmup", self.warmup, 0, "Use e.g. 50 (the paper: 2500).")
        check_int("sample_steps", self.sample_steps, 2, "L_t needs ≥ 2 samples for a covariance; use e.g. 10.")
        check_int("compress_steps", self.compress_steps, 1, "Use e.g. 20 (the paper: 400).")
        t = self.loss_threshold
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0):
            raise ValueError(
                f"loss_threshold={t!r} is invalid: it is the relative compression loss ‖x − x̂‖²/‖x‖² above "
                "which a rank votes to stop compressing, a number > 0 (e.g. 0.9), or None to disable."
            )
        check_int("sample_levels", self.sample_levels, 0, "Use 7 (4-bit QSGD, the paper) or 0 for exact samples.")
        check_int("sample_bucket", self.sample_bucket, 1, "Use 512.")
        check_int("min_numel", self.min_numel, 0, "Use e.g. 256.")
        if not isinstance(self.compress_linear, bool):
            raise ValueError(f"compress_linear={self.compress_linear!r} must be True or False.")
        if self.dim is not None:
            check_int("dim", self.dim, 1, "Use None to choose d by λ.")
        if self.outside_span not in ("mu", "zero"):
            raise ValueError(
                f"outside_span={self.outside_span!r} is invalid: use 'mu' (the paper: the sampled mean fills "
                "the directions outside the basis) or 'zero' (the projection of the mean alone)."
            )
        if self.coef_dtype not in COEF_DTYPES:
            raise ValueError(
                f"coef_dtype={self.coef_dtype!r} is invalid: the coefficients travel as one of "
                f"{sorted(COEF_DTYPES)}. Use 'bfloat16' (half the bytes) or 'float32' (the paper)."
            )

    @property
    def wire_dtype(self) -> torch.dtype:
        return COEF_DTYPES[self.coef_dtype]


# ----------------------------------------------------------------------------- slicing
def _largest_divisor_at_most(n: int, cap: int) -> int:
    best = 1
    for m in range(1, min(n, cap) + 1):
        if n % m == 0:
            best = m
    return best


@dataclass(frozen=True)
class LayerSlicing:
    """How one tensor of a group is packed and sliced.

    ``offset``/``numel``: its place in the flat group; ``shape``: its shape. For compressed
    tensors ``F, D, P`` (filters, depth, positions), ``K`` (slice size) and ``rows = numel / K``;
    ``exact`` tensors travel as raw values.
    """

    index: int
    name: str
    offset: int
    numel: int
    shape: tuple[int, ...]
    exact: bool
    F: int = 0
    D: int = 0
    P: int = 0
    K: int = 0

    @property
    def rows(self) -> int:
        return self.numel // self.K if self.K else 0

    def pack(self, flat: Tensor) -> Tensor:
        """``(rows, K)`` view-or-copy of this tensor's part of ``flat``, in (P, D, F) order."""
        x = flat.narrow(0, self.offset, self.numel).view(self.F, self.D, self.P)
        return x.permute(2, 1, 0).reshape(self.rows, self.K)

    def unpack_into(self, packed: Tensor, flat: Tensor) -> None:
        """Write ``packed`` (rows, K) back into ``flat`` in the parameter's own layout."""
        dst = flat.narrow(0, self.offset, self.numel).view(self.F, self.D, self.P)
        dst.copy_(packed.reshape(self.P, self.D, self.F).permute(2, 1, 0))


def slice_rule(shape: tuple[int, ...], max_slice: int) -> tuple[int, int, int, int]:
    """``(F, D, P, K)`` for a weight of ``shape`` (≥ 2 dims) under the documented K rule."""
    F, D = int(shape[0]), int(shape[1])
    P = int(math.prod(shape[2:])) if len(shape) > 2 else 1
    n = F * D * P
    if F * D <= max_slice:
        K = F * D * _largest_divisor_at_most(P, max_slice // (F * D))
    elif F <= max_slice:
        K = F * _largest_divisor_at_most(D * P, max_slice // F)
    else:
        K = _largest_divisor_at_most(n, max_slice)
    return F, D, P, K


def layout(ctx: GroupContext, config: GradiVeQConfig) -> list[LayerSlicing]:
    """Slicing of every tensor of the group (shapes from ``ctx.shapes``; 1-D when absent)."""
    shapes = ctx.shapes if ctx.shapes else tuple((n,) for n in ctx.segments)
    names = ctx.names if ctx.names else tuple(f"t{i}" for i in range(len(ctx.segments)))
    out: list[LayerSlicing] = []
    offset = 0
    for i, (n, shape) in enumerate(zip(ctx.segments, shapes)):
        shape = tuple(int(s) for s in shape)
        exact = (len(shape) < 2 or n < config.min_numel or n < 2
                 or (len(shape) == 2 and not config.compress_linear))
        if not exact:
            F, D, P, K = slice_rule(shape, config.max_slice)
            exact = K < 2
        if exact:
            out.append(LayerSlicing(i, names[i], offset, n, shape, True))
        else:
            out.append(LayerSlicing(i, names[i], offset, n, shape, False, F, D, P, K))
        offset += n
    return out


# ----------------------------------------------------------------------------- basis
@dataclass
class Block:
    """One basis: slices ``[r0, r1)`` of tensor ``layer`` share ``U`` (K×d)."""

    layer: int
    r0: int
    r1: int
    U: Tensor
    eigvals: Tensor  # descending, float64 (for monitoring / tests)

    @property
    def d(self) -> int:
        return int(self.U.shape[1])


@dataclass
class GroupBasis:
    """The fitted compressor of one group: blocks per tensor and μ̄ per compressed tensor."""

    layers: list[LayerSlicing]
    blocks: list[Block]
    mu: dict[int, Tensor]  # layer index -> (rows, K) whitening vectors μ̄ (mean units)
    digest: str = ""
    _mu_terms: dict[int, tuple[Tensor, Tensor, Tensor]] = field(default_factory=dict, repr=False)

    def move_to(self, device: torch.device) -> GroupBasis:
        """Move U and μ̄ to ``device`` in place (and drop the cached μ̄ terms, which lived on the
        old device); returns ``self``."""
        for k in self.blocks:
            k.U = k.U.to(device)
        self.mu = {i: m.to(device) for i, m in self.mu.items()}
        self._mu_terms.clear()
        return self

    def mu_terms(self, i: int) -> tuple[Tensor, Tensor, Tensor]:
        """``(c = μ̄·U, ‖μ̄‖², ‖c‖²)`` per slice of block ``i`` (``(rows, d)``, ``(rows,)``, ``(rows,)``), cached.

        They give a contribution's norm without expanding it (U has orthonormal columns):
        ‖U z + μ̄‖² = ‖z‖² + 2 z·c + ‖μ̄‖² and ‖U (z + c)‖² = ‖z‖² + 2 z·c + ‖c‖².
        """
        terms = self._mu_terms.get(i)
        b = self.blocks[i]
        if terms is None or terms[0].device != b.U.device:
            mu = self.mu[b.layer][b.r0:b.r1]
            c = mu @ b.U
            terms = self._mu_terms[i] = (c, mu.square().sum(1), c.square().sum(1))
        return terms

    def expand_rows(self, i: int, r0: int, r1: int, z: Tensor, scale: float, project: bool, out: Tensor) -> None:
        """Decompress rows ``[r0, r1)`` of block ``i`` from coefficients ``z`` into ``out``:
        ``U (z·scale + Uᵀμ̄)`` (``project``: ``outside_span="zero"``) or ``U z·scale + μ̄`` (Eq. 5)."""
        b = self.blocks[i]
        if project:
            torch.mm(torch.add(self.mu_terms(i)[0][r0 - b.r0:r1 - b.r0], z, alpha=scale), b.U.T, out=out)
        else:
            torch.addmm(self.mu[b.layer][r0:r1], z, b.U.T, alpha=scale, out=out)

    @property
    def z_numel(self) -> int:
        return sum((b.r1 - b.r0) * b.d for b in self.blocks) + sum(L.numel for L in self.layers if L.exact)


@dataclass
class SampleStats:
    """Sufficient statistics of the sampled aggregated gradients of one group."""

    key: tuple = ()  # the group's (numels, shapes): a replaced plan starts the statistics afresh
    count: int = 0
    sums: dict[int, Tensor] = field(default_factory=dict)  # layer -> Σ_t X_t (rows, K) float64
    #: (layer, block) -> the sampled rows of every sample step, each (m, K) float64
    rows: dict[tuple[int, int], list[Tensor]] = field(default_factory=dict)


def group_key(ctx: GroupContext) -> tuple:
    return (tuple(ctx.segments), tuple(tuple(s) for s in ctx.shapes))


def block_ranges(rows: int, reuse: int) -> list[tuple[int, int]]:
    s = rows if reuse == 0 else reuse
    return [(r, min(r + s, rows)) for r in range(0, rows, s)]


def sampled_rows(r0: int, r1: int, pca_slices: int) -> Tensor:
    m = min(pca_slices, r1 - r0)
    return r0 + (torch.arange(m) * (r1 - r0)) // m


def choose_dim(eigvals_desc: Tensor, lam: float) -> int:
    """Eq. 6: smallest d with Σ_{k<d} s_k / Σ_k s_k ≥ 1 − λ (eigenvalues clamped at 0)."""
    s = eigvals_desc.clamp_min(0)
    total = float(s.sum())
    if not total > 0:
        return 1
    share = torch.cumsum(s, 0) / total
    hit = torch.nonzero(share >= 1.0 - lam)
    return int(hit[0]) + 1 if hit.numel() else int(s.numel())


def principal_axes(Y: Tensor, dim: int | None, lam: float) -> tuple[Tensor, Tensor]:
    """Eigenvalues (descending) of the covariance ``YᵀY`` of centred samples ``Y`` (n×K, float64)
    and its top-d eigenvectors as a K×d matrix, d by Eq. 6 (or ``dim``).

    With fewer samples than K (the usual case: n = L_t·``pca_slices``), ``YᵀY`` has rank ≤ n and
    its eigenvectors with non-zero eigenvalues are ``Yᵀv/√s`` for the eigenpairs (s, v) of the
    n×n Gram matrix ``YYᵀ`` (same non-zero eigenvalues): an O(n²K + n³) fit instead of the O(K³)
    eigen-decomposition of the K×K covariance, which stalls training for seconds per fit at large
    K. A ``dim`` above the sample rank needs a complete basis and takes the K×K path.
    """
    n, K = Y.shape
    if n >= K or (dim is not None and dim > n):
        evals, vecs = torch.linalg.eigh(Y.T @ Y)
        evals, vecs = evals.flip(0), vecs.flip(1)
        d = dim if dim is not None else choose_dim(evals, lam)
        return evals, vecs[:, :d]
    evals, v = torch.linalg.eigh(Y @ Y.T)
    evals, v = evals.flip(0), v.flip(1)
    d = dim if dim is not None else choose_dim(evals, lam)
    # eigenvalues that are zero up to rounding carry no direction; Eq. 6 never keeps them (their
    # share is ~0) unless dim asks, and then the K×K path above was taken
    U = (Y.T @ v[:, :d]) / evals[:d].clamp_min(torch.finfo(Y.dtype).tiny).sqrt()
    return evals, U
