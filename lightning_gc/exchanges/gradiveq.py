"""GradiVeQ exchanges: the ring of Algorithm 1 and the simple compress–allreduce–decompress path.

Both run one plan group per call on the engine's ordered worker and follow the compressor's
schedule (:meth:`~lightning_gc.compressors.gradiveq.GradiVeQCompressor.phase`, a function of the
replicated step and of votes summed across ranks):

warm-up step
    exact allreduce of ``p / N`` (DDP's numerics); ``sent = p``.
sample step (and a compressed step of a group that has no basis yet)
    ``p`` is QSGD-quantised (``sample_levels``; 0 = exact) and exchanged by one allgather, as the
    ``qsgd`` compressor does; the aggregated mean — identical on every rank — is recorded as a PCA
    sample. ``sent`` is this rank's dequantised payload.
compressed step
    at the first compressed step of a phase the basis is fitted from the samples (same code, same
    inputs on every rank) and its digest is compared across ranks by an 8-byte allgather. Then:

    * ``gradiveq_ring`` (Algorithm 1, the default): the compressed vector z (slices' coefficients,
      then the exact tensors' raw values) is cut into N chunks whose boundaries fall on slice
      boundaries. Compression round: a rank compresses its own chunk r and sends it; at each of
      the N − 1 hops it posts the send of the partial sum and the receive of chunk (r − s − 1),
      compresses *its own* slices of that chunk while the bytes travel, then adds and forwards.
      Decompression round: N − 1 hops pass the fully summed chunks on; while each transfer is in
      flight the rank decompresses the chunk it just completed (``U Σz / N + μ̄``). Only the first
      chunk's compression and the last chunk's decompression are exposed. The coefficients travel
      as ``coef_dtype`` (bfloat16 by default): each hop adds the received partial sum to the
      rank's own z in the gradient's dtype and rounds the result once.
    * ``gradiveq_allreduce`` (the simple path and the ring's oracle): compress everything, one
      backend allreduce of z, decompress everything.

    Then one float64 allreduce of ``[relative loss, stop vote]`` (16 bytes): the mean relative
    Eq. 7 loss goes to the monitor and a majority of votes ends the compressed phase after this
    step. ``sent = U z + μ̄`` (exact tensors: ``p``) is returned as a
    :class:`~lightning_gc.comm.exchange.LazySent`: the loss and ‖sent‖² come from norms taken
    while compressing, and the expansion is computed only when error feedback needs it.

Monitoring: ``timer.times.metrics`` carries ``gradiveq/phase`` (0 warm-up, 1 sample,
2 compressed), ``gradiveq/loss`` (mean over ranks of the relative Eq. 7 loss), ``gradiveq/ratio``
(z elements / elements over all the step's compressed groups) and ``gradiveq/d/<tensor>`` (the largest d of each compressed
tensor) and, for the ring, ``gradiveq/hidden_compress_ms`` (compression and decompression done
while transfers were in flight); the engine logs them as ``gc/<key>``. ``timer.times.overlapped_compress_s`` is the
compression/decompression time spent while ring transfers were in flight (CPU wall clock); the
timer's compress time is only the exposed part.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from ..comm import p2p
from ..comm.collectives import allgather_payload, ring_allreduce_bytes
from ..comm.exchange import Exchange, LazySent, Timer
from ..comm.network import NetworkState
from ..compressors.base import GroupContext
from ..compressors.gradiveq.codec import GroupBasis
from ..compressors.gradiveq.compressor import GradiVeQCompressor
from ..compressors.qsgd import QSGDCompressor, QSGDConfig

__all__ = ["GradiVeQExchange", "GradiVeQRingExchange", "Piece", "chunk_plan", "pieces_of"]

_PHASE_CODE = {"warmup": 0.0, "sample": 1.0, "compress": 2.0}


@dataclass(frozen=True)
class Piece:
    """A run of z: rows ``[a, b)`` of one basis block (``width = d``) or elements ``[a, b)`` of an
    exact tensor (``width = 1``); ``block`` indexes ``GroupBasis.blocks`` (−1 for exact tensors)."""

    block: int
    layer: int
    a: int
    b: int
    width: int

    @property
    def numel(self) -> int:
        return (self.b - self.a) * self.width


def pieces_of(basis: GroupBasis) -> list[Piece]:
    """z's layout: every block's rows (in block order), then every exact tensor's values."""
    out = [Piece(i, b.layer, b.r0, b.r1, b.d) for i, b in enumerate(basis.blocks)]
    out += [Piece(-1, L.index, 0, L.numel, 1) for L in basis.layers if L.exact]
    return out


def chunk_plan(pieces: list[Piece], n: int) -> list[list[Piece]]:
    """Split z into ``n`` chunks of about equal size whose boundaries fall on slice boundaries.

    Boundary i targets ``round(i·Z/n)`` and is moved to the nearest row boundary of the piece it
    falls in (any element of an exact tensor is a boundary). Chunks may be empty.
    """
    total = sum(p.numel for p in pieces)
    starts = []
    off = 0
    for p in pieces:
        starts.append(off)
        off += p.numel
    cuts = [0]
    for i in range(1, n):
        t = round(i * total / n)
        c = total
        for p, s in zip(pieces, starts):
            if s <= t < s + p.numel:
                c = s + round((t - s) / p.width) * p.width
                break
        cuts.append(max(cuts[-1], c))
    cuts.append(total)
    chunks: list[list[Piece]] = []
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        part = []
        for p, s in zip(pieces, starts):
            a, b = max(lo, s), min(hi, s + p.numel)
            if a < b:
                part.append(Piece(p.block, p.layer, p.a + (a - s) // p.width, p.a + (b - s) // p.width, p.width))
        chunks.append(part)
    return chunks


def _sq(t: Tensor) -> Tensor:
    return torch.linalg.vector_norm(t, dtype=torch.float64).square()


class _Step:
    """Per-call working state of a compressed step: packed inputs, z buffers, the mean, norms.

    ``z_own`` (this rank's coefficients) is in the gradient's dtype, ``z_sum`` (what travels and is
    summed) in the wire dtype. This rank's own contribution ``U z + μ̄`` is *not* expanded: the
    Eq. 7 loss and ‖sent‖² follow from norms gathered while compressing (U has orthonormal
    columns and z = Uᵀ(x − μ̄)):

        ‖x − (U z + μ̄)‖² = ‖x − μ̄‖² − ‖z‖²        ‖U z + μ̄‖² = ‖z‖² + 2 z·(Uᵀμ̄) + ‖μ̄‖²

    (with ``outside_span="zero"`` the contribution is ``P x``: ‖P x‖² = ‖z + Uᵀμ̄‖² and
    ‖x − P x‖² = ‖x‖² − ‖P x‖²), and :meth:`sent` returns a :class:`LazySent` that expands only
    if error feedback asks.
    """

    def __init__(self, comp: GradiVeQCompressor, basis: GroupBasis, p: Tensor, ctx: GroupContext) -> None:
        self.comp, self.basis, self.p, self.ctx = comp, basis, p, ctx
        self.pieces = pieces_of(basis)
        self.z_numel = sum(pc.numel for pc in self.pieces)
        self.z_own = torch.empty(self.z_numel, dtype=p.dtype, device=p.device)
        self.z_sum = torch.empty(self.z_numel, dtype=comp.config.wire_dtype, device=p.device)
        self.mean = torch.empty_like(p)
        self._packed: dict[int, Tensor] = {}
        self._mean_packed: dict[int, Tensor] = {}
        self._terms: list[Tensor] = []  # per compressed piece: [‖x − μ̄‖², ‖z‖², z·Uᵀμ̄, ‖μ̄‖², ‖x‖², ‖Uᵀμ̄‖²]
        self.project_only = comp.config.outside_span == "zero"
        self.exact_start = sum(pc.numel for pc in self.pieces if pc.block >= 0)  # exact values: z's tail
        # rows of each compressed layer still to expand: a layer is unpacked into ``mean`` by the
        # expand() that completes it (inside the ring's hidden time), not all at once at the end
        self._rows_left = {L.index: L.rows for L in basis.layers if not L.exact}
        self.offsets: dict[tuple[int, int], tuple[int, int]] = {}
        off = 0
        for pc in self.pieces:
            self.offsets[(pc.block, pc.layer)] = (off, pc.a)
            off += pc.numel

    def _zoff(self, pc: Piece) -> int:
        """Offset of sub-piece ``pc`` in z (its parent piece's offset plus the rows before it)."""
        off, a = self.offsets[(pc.block, pc.layer)]
        return off + (pc.a - a) * pc.width

    def _packed_in(self, layer: int) -> Tensor:
        X = self._packed.get(layer)
        if X is None:
            X = self._packed[layer] = self.basis.layers[layer].pack(self.p)
        return X

    def _mean_out(self, layer: int) -> Tensor:
        buf = self._mean_packed.get(layer)
        if buf is None:
            L = self.basis.layers[layer]
            buf = self._mean_packed[layer] = torch.empty(L.rows, L.K, dtype=self.p.dtype, device=self.p.device)
        return buf

    def compress(self, chunk: list[Piece], norms: bool = True) -> None:
        """Own z of the chunk's slices (Eq. 3) into ``z_own``, and (``norms``) the norms
        :meth:`finish` needs; ``norms=False`` leaves them to :meth:`norms`, so the ring can send
        its first chunk sooner and take them while it travels."""
        for pc in chunk:
            o = self._zoff(pc)
            dst = self.z_own[o:o + pc.numel]
            if pc.block < 0:
                L = self.basis.layers[pc.layer]
                src = self.p[L.offset + pc.a:L.offset + pc.b]
                dst.copy_(src)
                continue
            blk = self.basis.blocks[pc.block]
            X = self._packed_in(pc.layer)[pc.a:pc.b]
            diff = X - self.basis.mu[pc.layer][pc.a:pc.b]
            z = dst.view(pc.b - pc.a, pc.width)
            torch.mm(diff, blk.U, out=z)
            if norms:
                self._piece_norms(pc, X, diff, z)

    def norms(self, chunk: list[Piece]) -> None:
        """The norms of a chunk compressed with ``norms=False``."""
        for pc in chunk:
            if pc.block >= 0:
                X = self._packed_in(pc.layer)[pc.a:pc.b]
                z = self.z_own[self._zoff(pc):self._zoff(pc) + pc.numel].view(pc.b - pc.a, pc.width)
                self._piece_norms(pc, X, X - self.basis.mu[pc.layer][pc.a:pc.b], z)

    def _piece_norms(self, pc: Piece, X: Tensor, diff: Tensor, z: Tensor) -> None:
        blk = self.basis.blocks[pc.block]
        mu_coef, mu_sq, coef_sq = self.basis.mu_terms(pc.block)
        i0, i1 = pc.a - blk.r0, pc.b - blk.r0
        self._terms.append(torch.stack([
            _sq(diff), _sq(z), (z * mu_coef[i0:i1]).sum(dtype=torch.float64),
            mu_sq[i0:i1].sum(dtype=torch.float64), _sq(X), coef_sq[i0:i1].sum(dtype=torch.float64)]))

    def expand(self, chunk: list[Piece]) -> None:
        """The mean ``U Σz / N + μ̄`` of the chunk's slices (exact tensors: ``Σ / N``)."""
        inv_n = 1.0 / self.ctx.world_size
        for pc in chunk:
            o = self._zoff(pc)
            zs = self.z_sum[o:o + pc.numel]
            if pc.block < 0:
                L = self.basis.layers[pc.layer]
                torch.mul(zs, inv_n, out=self.mean[L.offset + pc.a:L.offset + pc.b])
                continue
            blk = self.basis.blocks[pc.block]
            rows = pc.b - pc.a
            # P x̄ = U (Σz/N + Uᵀμ̄), or U Σz/N + μ̄ (Eq. 5)
            self.basis.expand_rows(pc.block, pc.a, pc.b, zs.view(rows, pc.width).to(blk.U.dtype), inv_n,
                                   self.project_only, self._mean_out(pc.layer)[pc.a:pc.b])
            self._rows_left[pc.layer] -= rows
            if self._rows_left[pc.layer] == 0:  # the layer is complete: back to the parameter layout
                self.basis.layers[pc.layer].unpack_into(self._mean_packed.pop(pc.layer), self.mean)

    def finish(self) -> tuple[float, float, float]:
        """Unpack the mean; return (‖x − (U z + μ̄)‖², ‖x‖²) over the compressed tensors (Eq. 7)
        and ‖sent‖² over the whole group."""
        assert not self._mean_packed, "every compressed layer is unpacked by the expand() that completes it"
        exact2 = float(_sq(self.z_own[self.exact_start:])) if self.exact_start < self.z_numel else 0.0
        if not self._terms:
            return 0.0, 0.0, exact2
        xm2, z2, zc, mu2, x2, c2 = (float(v) for v in torch.stack(self._terms).sum(0).tolist())
        if self.project_only:  # sent = P x: ‖x − P x‖² = ‖x‖² − ‖Uᵀx‖², Uᵀx = z + Uᵀμ̄
            px2 = z2 + 2.0 * zc + c2
            return max(x2 - px2, 0.0), x2, px2 + exact2
        return max(xm2 - z2, 0.0), x2, z2 + 2.0 * zc + mu2 + exact2

    def sent(self, sq_norm: float) -> LazySent:
        """This rank's contribution ``U z + μ̄`` (``outside_span="zero"``: ``P x``; exact tensors:
        ``p``), expanded on demand."""
        z_own, ctx, comp = self.z_own, self.ctx, self.comp
        return LazySent(sq_norm, lambda: comp.expand(z_own, ctx, 1.0))


class GradiVeQExchange(Exchange):
    """GradiVeQ with the simple compressed path: compress all, backend allreduce of z, decompress."""

    name = "gradiveq_allreduce"
    formats = frozenset({"gradiveq"})
    summable = True

    def __init__(self, compressor: GradiVeQCompressor, group=None, network: NetworkState | None = None) -> None:
        self._require(compressor, GradiVeQCompressor, "GradiVeQ's schedule")
        super().__init__(compressor, group, network)
        self.compressor: GradiVeQCompressor = compressor
        c = compressor.config
        self.qsgd = QSGDCompressor(QSGDConfig(c.sample_levels, c.sample_bucket)) if c.sample_levels > 0 else None
        #: per group id: the latest per-tensor d and loss, for tests and monitoring
        self.last_loss: dict[int, float] = {}
        # (the step's metrics dict, Σ z elements, Σ elements) over the step's compressed groups, so
        # gradiveq/ratio describes the whole step and not only the group exchanged last
        self._step_sizes: tuple[dict, int, int] | None = None

    # ------------------------------------------------------------------ dispatch
    def run(self, p: Tensor, ctx: GroupContext, timer: Timer) -> tuple[Tensor, Tensor]:
        if ctx.world_size == 1:
            return p.clone(), p
        comp = self.compressor
        phase = comp.phase(ctx.step)
        metrics = timer.times.metrics
        metrics["gradiveq/phase"] = _PHASE_CODE[phase]
        if phase == "warmup":
            return self._exact(p, ctx, timer)
        basis = None
        if phase == "compress":
            if comp.needs_fit(ctx.group_id):
                basis = timer.run("compress", lambda: comp.fit(ctx, p.dtype))
                if basis is not None:
                    self._check_digest(basis, ctx, timer)
            else:
                basis = comp.basis_for(ctx)
                if basis is not None and basis.blocks and basis.blocks[0].U.device != p.device:
                    basis = comp.move_basis(ctx.group_id, p.device)  # restored from a checkpoint on CPU
        if basis is None:  # sample phase, or no basis could be fitted: uncompressed, collect a sample
            metrics["gradiveq/phase"] = 1.0
            return self._sample(p, ctx, timer)
        mean, sent, loss, norm = self._compressed(p, ctx, basis, timer)
        self._vote(loss, norm, ctx, timer, metrics)
        acc = self._step_sizes
        z, n = (acc[1], acc[2]) if acc is not None and acc[0] is metrics else (0, 0)
        z, n = z + basis.z_numel, n + p.numel()
        self._step_sizes = (metrics, z, n)
        metrics["gradiveq/ratio"] = z / max(1, n)
        for b in basis.blocks:
            key = f"gradiveq/d/{basis.layers[b.layer].name}"
            metrics[key] = max(metrics.get(key, 0.0), float(b.d))
        return mean, sent

    def _exact(self, p: Tensor, ctx: GroupContext, timer: Timer) -> tuple[Tensor, Tensor]:
        buf = p.div(ctx.world_size)
        timer.run("comm", lambda: dist.all_reduce(buf, group=self.group))
        nbytes = buf.numel() * buf.element_size()
        timer.times.bytes_sent += ring_allreduce_bytes(nbytes, ctx.world_size)
        timer.times.bytes_payload += nbytes
        return buf, p

    def _sample(self, p: Tensor, ctx: GroupContext, timer: Timer) -> tuple[Tensor, Tensor]:
        if self.qsgd is None:
            mean, sent = self._exact(p, ctx, timer)
        else:
            q = self.qsgd
            comp = timer.run("compress", lambda: q.compress(p, ctx))
            specs = q.payload_specs(ctx, p.dtype)
            payloads, nbytes, payload_bytes = timer.run("comm", lambda: allgather_payload(comp.payload, specs, self.group,
                                                                                        timer.times.on_malformed_payload()))
            timer.times.bytes_sent += nbytes
            timer.times.bytes_payload += payload_bytes
            mean = timer.run("compress", lambda: q.aggregate_gathered(payloads, comp.meta, ctx))
            sent = timer.run("compress", lambda: q.decompress(comp.payload, comp.meta, ctx))
        timer.run("compress", lambda: self.compressor.add_sample(mean, ctx))
        return mean, sent

    def _check_digest(self, basis: GroupBasis, ctx: GroupContext, timer: Timer) -> None:
        from ..comm.collectives import check_descriptor

        text = f"gradiveq basis group={ctx.group_id} epoch={self.compressor.epoch} digest={basis.digest}"
        try:
            timer.times.bytes_sent += timer.run(
                "comm", lambda: check_descriptor(text, ctx.step, self.group, ctx.world_size, ctx.device))
        except RuntimeError as e:
            raise RuntimeError(
                f"lightning_gc: GradiVeQ's PCA basis of plan group {ctx.group_id} (sample phase "
                f"{self.compressor.epoch}) differs across ranks at step {ctx.step}. Every rank fits it from the "
                "same aggregated sample gradients with the same deterministic code, so the ranks' samples or "
                "arithmetic differ (different torch or BLAS builds or devices across ranks, or ranks resumed "
                "from different checkpoints); compressing with it would silently give each rank another "
                f"gradient. {e}"
            ) from e

    def _vote(self, loss: float, norm: float, ctx: GroupContext, timer: Timer, metrics: dict) -> None:
        rel = loss / norm if norm > 0 else 0.0
        thr = self.compressor.config.loss_threshold
        t = torch.tensor([rel, float(thr is not None and rel > thr)], dtype=torch.float64, device=ctx.device)
        timer.run("comm", lambda: dist.all_reduce(t, group=self.group))
        timer.times.bytes_sent += ring_allreduce_bytes(16, ctx.world_size)
        mean_rel, votes = (float(v) for v in t.cpu().tolist())
        self.last_loss[ctx.group_id] = mean_rel / ctx.world_size
        metrics["gradiveq/loss"] = max(metrics.get("gradiveq/loss", 0.0), mean_rel / ctx.world_size)
        metrics["gradiveq/stop_votes"] = max(metrics.get("gradiveq/stop_votes", 0.0), votes)
        self.compressor.vote(votes, ctx.world_size)

    # ------------------------------------------------------------------ compressed paths
    def _compressed(self, p: Tensor, ctx: GroupContext, basis: GroupBasis, timer: Timer):
        st = _Step(self.compressor, basis, p, ctx)
        timer.run("compress", lambda: (st.compress(st.pieces), st.z_sum.copy_(st.z_own)))
        nbytes = st.z_numel * st.z_sum.element_size()
        timer.times.bytes_payload += nbytes
        timer.run("comm", lambda: dist.all_reduce(st.z_sum, group=self.group))
        timer.times.bytes_sent += ring_allreduce_bytes(nbytes, ctx.world_size)
        timer.run("compress", lambda: st.expand(st.pieces))
        loss, norm, sent2 = timer.run("compress", st.finish)
        return st.mean, st.sent(sent2), loss, norm

    def describe(self) -> str:
        return self.name

    def state_dict(self) -> dict:
        """The compressor's schedule and bases (identical on every rank), for checkpoints."""
        return {"gradiveq": self.compressor.state_dict()}

    def load_state_dict(self, state: dict, world_size: int | None = None) -> None:
        self.compressor.load_state_dict(state.get("gradiveq") or {})


class GradiVeQRingExchange(GradiVeQExchange):
    """GradiVeQ with Algorithm 1: compression and decompression hidden behind a P2P ring."""

    name = "gradiveq_ring"
    ring_combinable = True

    def _compressed(self, p: Tensor, ctx: GroupContext, basis: GroupBasis, timer: Timer):
        n, rank = ctx.world_size, ctx.rank
        st = _Step(self.compressor, basis, p, ctx)
        chunks = chunk_plan(st.pieces, n)
        spans = []
        off = 0
        for ch in chunks:
            size = sum(pc.numel for pc in ch)
            spans.append((off, size))
            off += size
        group = self.group
        right = dist.get_global_rank(group, (rank + 1) % n) if group is not None else (rank + 1) % n
        left = dist.get_global_rank(group, (rank - 1) % n) if group is not None else (rank - 1) % n
        esize = st.z_sum.element_size()
        recv_buf = torch.empty(max(s for _, s in spans) if spans else 0, dtype=st.z_sum.dtype, device=p.device)
        overlapped = 0.0
        sent_bytes = 0

        def zs(i: int) -> Tensor:
            o, s = spans[i]
            return st.z_sum[o:o + s]

        def post(send: Tensor, recv: Tensor) -> list:
            nonlocal sent_bytes
            if send.numel():
                sent_bytes += send.numel() * esize
            return p2p.batch_send_recv(send if send.numel() else None, right, recv if recv.numel() else None,
                                       left, group)

        def wait(works: list) -> None:
            for w in works:
                w.wait()

        def hidden(fn, *args) -> None:
            nonlocal overlapped
            t0 = time.perf_counter()
            fn(*args)
            overlapped += time.perf_counter() - t0

        # compression round (Algorithm 1, lines 3-8)
        timer.run("compress", lambda: st.compress(chunks[rank], norms=False))
        o, s = spans[rank]
        st.z_sum[o:o + s].copy_(st.z_own[o:o + s])
        for step in range(n - 1):
            send_idx, recv_idx = (rank - step) % n, (rank - step - 1) % n
            o, s = spans[recv_idx]
            works = post(zs(send_idx), recv_buf[:s])
            if step == 0:
                hidden(st.norms, chunks[rank])  # the first chunk's norms, while it travels
            hidden(st.compress, chunks[recv_idx])  # own slices of the segment on the wire
            timer.run("comm", lambda w=works: wait(w))
            torch.add(st.z_own[o:o + s], recv_buf[:s], out=st.z_sum[o:o + s])
        # decompression round (lines 9-14): forward the summed chunks, expand the one just completed
        for step in range(n - 1):
            send_idx, recv_idx = (rank + 1 - step) % n, (rank - step) % n
            works = post(zs(send_idx), zs(recv_idx))
            hidden(st.expand, chunks[send_idx])
            timer.run("comm", lambda w=works: wait(w))
        timer.run("compress", lambda: st.expand(chunks[(rank + 2) % n]))
        loss, norm, sent2 = timer.run("compress", st.finish)
        timer.times.bytes_payload += st.z_numel * esize
        timer.times.bytes_sent += sent_bytes
        timer.times.overlapped_compress_s += overlapped
        metrics = timer.times.metrics
        metrics["gradiveq/hidden_compress_ms"] = metrics.get("gradiveq/hidden_compress_ms", 0.0) + 1e3 * overlapped
        return st.mean, st.sent(sent2), loss, norm
