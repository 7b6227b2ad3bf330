"""GradiVeQ's compressor: the schedule, the sampled statistics, the basis fits and their checkpoint.

The math it uses (slicing, blocks, the PCA fit of Eq. 6) is in :mod:`.codec`, whose docstring
describes the whole method and how to tune it; the exchanges that carry the coefficients are in
:mod:`.exchange`.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch import Tensor

from ..._finite import all_finite
from ..base import Compressed, Compressor, GroupContext
from .codec import (
    Block,
    GradiVeQConfig,
    GroupBasis,
    LayerSlicing,
    SampleStats,
    block_ranges,
    group_key,
    layout,
    principal_axes,
    sampled_rows,
)


class GradiVeQCompressor(Compressor):
    """Local half of GradiVeQ: slicing, sample statistics, the basis fit, projection and schedule.

    The exchanges (the ring of Algorithm 1 and the simple allreduce path) are in
    :mod:`.exchange`; all schedule and basis methods are called from the engine's
    ordered worker thread only. ``compress``/``decompress`` are the whole-group transforms of a
    compressed step (``payload = (z,)`` with the exact tensors' values appended); before a basis
    is fitted for ``ctx.group_id`` they are the identity.
    """

    name = "gradiveq"
    wire_format = "gradiveq"
    wire_description = ("PCA coefficients z = Uᵀ(x − μ̄) per slice (bf16 or fp32, d per K elements) that sum "
                        "across ranks, QSGD-quantised gradients on the PCA sample steps")
    default_error_feedback = False

    def __init__(self, config: GradiVeQConfig | None = None) -> None:
        self.config = config or GradiVeQConfig()
        self._phase: str | None = None
        self._phase_start = 0
        self._sched_step = -1
        self._stop_votes = False
        self.epoch = 0  # number of sample phases begun: a basis is fitted once per epoch
        self.samples: dict[int, SampleStats] = {}
        self.bases: dict[int, GroupBasis] = {}
        self._basis_epoch: dict[int, int] = {}
        self._ratio = 1.0

    # ------------------------------------------------------------------ schedule
    def phase(self, step: int) -> str:
        """Phase of optimizer step ``step`` (replicated inputs only; advance once per step)."""
        c = self.config
        if step < c.warmup:
            return "warmup"
        if step != self._sched_step:
            self._sched_step = step
            if self._phase is None:
                self._start("sample", step)
            elif self._phase == "sample" and step - self._phase_start >= c.sample_steps:
                self._start("compress", step)
            elif self._phase == "compress" and (step - self._phase_start >= c.compress_steps or self._stop_votes):
                self._start("sample", step)
        return self._phase  # type: ignore[return-value]

    def _start(self, phase: str, step: int) -> None:
        self._phase, self._phase_start, self._stop_votes = phase, step, False
        if phase == "sample":
            self.epoch += 1
            self.samples.clear()

    def vote(self, voters: float, world_size: int) -> bool:
        """Record the summed stop votes of a compressed step; True if the phase ends after it."""
        if voters * 2 > world_size:
            self._stop_votes = True
        return self._stop_votes

    @property
    def payload_fraction(self) -> float:
        """Fraction of dense fp32 bytes of the latest fitted basis (1.0 before the first fit)."""
        return self._ratio

    # ------------------------------------------------------------------ samples and fit
    def add_sample(self, mean: Tensor, ctx: GroupContext) -> bool:
        """Record the aggregated mean of a sample step (identical on all ranks). False if non-finite."""
        if not all_finite(mean):
            return False
        key = group_key(ctx)
        st = self.samples.get(ctx.group_id)
        if st is None or st.key != key:
            st = self.samples[ctx.group_id] = SampleStats(key)
        for L in layout(ctx, self.config):
            if L.exact:
                continue
            X = L.pack(mean).to(torch.float64)
            st.sums[L.index] = st.sums[L.index] + X if L.index in st.sums else X.clone()
            for b, (r0, r1) in enumerate(block_ranges(L.rows, self.config.reuse)):
                st.rows.setdefault((L.index, b), []).append(X[sampled_rows(r0, r1, self.config.pca_slices)].clone())
        st.count += 1
        return True

    def needs_fit(self, gid: int) -> bool:
        return self._basis_epoch.get(gid) != self.epoch

    def basis_for(self, ctx: GroupContext) -> GroupBasis | None:
        """The fitted basis of ``ctx``'s group, or None (also when the plan changed the group since)."""
        basis = self.bases.get(ctx.group_id)
        if basis is None:
            return None
        if tuple((L.numel, L.shape) for L in basis.layers) != tuple((L.numel, L.shape) for L in layout(ctx, self.config)):
            del self.bases[ctx.group_id]
            return None
        return basis

    def fit(self, ctx: GroupContext, dtype: torch.dtype) -> GroupBasis | None:
        """Fit U, μ̄, d of group ``ctx.group_id`` from this epoch's samples (None: too few samples)."""
        gid = ctx.group_id
        self._basis_epoch[gid] = self.epoch
        st = self.samples.get(gid)
        layers = layout(ctx, self.config)
        if st is None or st.count < 2 or st.key != group_key(ctx):
            self.bases.pop(gid, None)
            return None
        n = st.count
        blocks: list[Block] = []
        mu: dict[int, Tensor] = {}
        for L in layers:
            if L.exact:
                continue
            mu[L.index] = (st.sums[L.index] / n).to(dtype).contiguous()
            for b, (r0, r1) in enumerate(block_ranges(L.rows, self.config.reuse)):
                Y = torch.stack(st.rows[(L.index, b)])  # (n steps, m sampled slices, K)
                Y = (Y - Y.mean(0)).reshape(-1, L.K)  # each slice centred on its own mean
                want = None if self.config.dim is None else min(self.config.dim, L.K)
                evals, U = principal_axes(Y, want, self.config.lam)
                blocks.append(Block(L.index, r0, r1, U.to(dtype).contiguous(), evals))
        basis = GroupBasis(layers, blocks, mu)
        basis.digest = self.digest(basis)
        self.bases[gid] = basis
        self.samples.pop(gid, None)
        dense = sum(L.numel for L in layers)
        self._ratio = basis.z_numel / dense if dense else 1.0
        return basis

    @staticmethod
    def digest(basis: GroupBasis) -> str:
        """Hash of every U, μ̄ and d (bit-level): equal on all ranks or the basis diverged."""
        h = hashlib.sha256()
        for b in basis.blocks:
            h.update(repr((b.layer, b.r0, b.r1, b.d)).encode())
            h.update(b.U.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        for k in sorted(basis.mu):
            h.update(basis.mu[k].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()[:16]

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict:
        """Schedule and fitted bases (replicated on every rank; plain types and CPU tensors).

        Samples of an unfinished sample phase are not saved: a run resumed in a sample phase
        starts a fresh one at the resume step.
        """
        bases = {}
        for gid, b in self.bases.items():
            bases[gid] = {
                "layers": [(L.index, L.name, L.offset, L.numel, L.shape, L.exact, L.F, L.D, L.P, L.K) for L in b.layers],
                "blocks": [(k.layer, k.r0, k.r1, k.U.detach().cpu(), k.eigvals.detach().cpu()) for k in b.blocks],
                "mu": {i: m.detach().cpu() for i, m in b.mu.items()},
                "digest": b.digest,
                "epoch": self._basis_epoch.get(gid),
            }
        return {"phase": self._phase, "phase_start": self._phase_start, "sched_step": self._sched_step,
                "stop_votes": self._stop_votes, "epoch": self.epoch, "ratio": self._ratio, "bases": bases}

    def load_state_dict(self, state: dict, device: torch.device | None = None) -> None:
        if not state:
            return
        self.samples.clear()
        self.bases.clear()
        self._basis_epoch.clear()
        self.epoch = int(state["epoch"])
        self._phase, self._phase_start = state["phase"], int(state["phase_start"])
        self._sched_step, self._stop_votes = int(state["sched_step"]), bool(state["stop_votes"])
        self._ratio = float(state.get("ratio", 1.0))
        if self._phase == "sample":  # its samples were not saved: sample afresh from the next step
            self._phase, self._sched_step = None, -1
        for gid, b in state.get("bases", {}).items():
            layers = [LayerSlicing(*t) for t in b["layers"]]
            blocks = [Block(layer, r0, r1, U.to(device) if device else U, ev) for layer, r0, r1, U, ev in b["blocks"]]
            mu = {int(i): (m.to(device) if device else m) for i, m in b["mu"].items()}
            self.bases[int(gid)] = GroupBasis(layers, blocks, mu, b["digest"])
            if b.get("epoch") is not None:
                self._basis_epoch[int(gid)] = int(b["epoch"])

    def move_basis(self, gid: int, device: torch.device) -> GroupBasis:
        return self.bases[gid].move_to(device)

    # ------------------------------------------------------------------ whole-group transforms
    def compress(self, x: Tensor, ctx: GroupContext) -> Compressed:
        """``(z,)``: every block's coefficients, then the exact tensors' values. Without a fitted
        basis for the group (before the first compressed phase) the payload is ``x`` itself — the
        exchanges never send that; it keeps the transform total and linear."""
        basis = self.bases.get(ctx.group_id)
        if basis is None:
            return Compressed((x.clone(),), meta=None)
        parts = []
        packed: dict[int, Tensor] = {}
        for b in basis.blocks:
            L = basis.layers[b.layer]
            X = packed.setdefault(b.layer, L.pack(x))
            parts.append(((X[b.r0:b.r1] - basis.mu[b.layer][b.r0:b.r1]) @ b.U).reshape(-1))
        for L in basis.layers:
            if L.exact:
                parts.append(x.narrow(0, L.offset, L.numel))
        z = torch.cat(parts) if parts else x.new_zeros(0)
        return Compressed((z,), meta=None)

    def expand(self, z: Tensor, ctx: GroupContext, scale: float) -> Tensor:
        """``U·z·scale + μ̄`` per slice (``outside_span="zero"``: ``U (z·scale + Uᵀμ̄)``), exact values
        ``·scale``, in the group's layout."""
        basis = self.bases.get(ctx.group_id)
        if basis is None:  # identity payload (see compress)
            return z.mul(scale)
        out = torch.empty(ctx.numel, dtype=z.dtype, device=z.device)
        off = 0
        packed: dict[int, Tensor] = {}
        for i, b in enumerate(basis.blocks):
            L = basis.layers[b.layer]
            buf = packed.setdefault(b.layer, torch.empty(L.rows, L.K, dtype=z.dtype, device=z.device))
            k = (b.r1 - b.r0) * b.d
            zb = z[off:off + k].view(b.r1 - b.r0, b.d)
            basis.expand_rows(i, b.r0, b.r1, zb, scale, self.config.outside_span == "zero", buf[b.r0:b.r1])
            off += k
        for idx, buf in packed.items():
            basis.layers[idx].unpack_into(buf, out)
        for L in basis.layers:
            if L.exact:
                out.narrow(0, L.offset, L.numel).copy_(z[off:off + L.numel]).mul_(scale)
                off += L.numel
        return out

    def decompress(self, payload: tuple[Tensor, ...], meta: Any, ctx: GroupContext) -> Tensor:
        """One rank's contribution ``U z + μ̄`` (``outside_span="zero"``: ``P x``; exact tensors: their values)."""
        return self.expand(payload[0], ctx, 1.0)

    def aggregate_summed(self, summed: tuple[Tensor, ...], meta: Any, ctx: GroupContext) -> Tensor:
        """Mean from the sum of payloads: ``U (Σz)/N + μ̄`` (Eq. 5 divided by N; ``"zero"``: ``P x̄``)."""
        return self.expand(summed[0], ctx, 1.0 / ctx.world_size)

    def payload_specs(self, ctx: GroupContext, dtype: torch.dtype):
        basis = self.bases.get(ctx.group_id)
        return [((basis.z_numel if basis is not None else ctx.numel,), dtype)]

    def describe(self) -> str:
        c = self.config
        return (f"{self.name}(lam={c.lam},max_slice={c.max_slice},reuse={c.reuse},pca_slices={c.pca_slices},"
                f"warmup={c.warmup},Lt={c.sample_steps},Lc={c.compress_steps},loss_threshold={c.loss_threshold},"
                f"sample_levels={c.sample_levels},sample_bucket={c.sample_bucket},min_numel={c.min_numel},"
                f"compress_linear={c.compress_linear},dim={c.dim},coef_dtype={c.coef_dtype},"
                f"outside_span={c.outside_span})")

    def advice(self, optimizers, error_feedback: bool) -> list[str]:
        """GradiVeQ's compressed steps never send the part of the gradient outside span(U), so its
        error memory grows until a sample step releases it at once, which can stop training
        altogether (docs/compressors.md)."""
        if not error_feedback:
            return []
        return [
            "lightning_gc: compressor='gradiveq' with error_feedback=True: the compressed steps cannot send "
            "the part of the gradient outside the PCA basis, so the error memory grows until a sample step "
            "releases it in one update. On the cnn example this training fell to chance accuracy. Prefer "
            "error_feedback=False (the default, as in the paper); see docs/compressors.md."
        ]
