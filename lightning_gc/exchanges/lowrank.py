"""The ``lowrank`` exchange: PowerSGD's two allreduces with warm start (see :mod:`.codec`).

Per group, on the engine's worker thread (so it overlaps the rest of backward like every other
exchange): ``P = M·Q`` for every compressed matrix, one allreduce of the dense tensors (divided by
N first, DDP's numerics) and all ``P`` together; ``P̂ = orth(ΣP)``; ``Q = Mᵀ·P̂``; one allreduce of
all ``Q`` together; ``M̂ = P̂·Q̄ᵀ``. Every size follows from the group's shapes and the rank, so
every rank issues the same collectives. ``sent`` (what error feedback subtracts) is the dense
tensors exactly and, for a matrix, this rank's own projection ``P̂·(Mᵀ·P̂)ᵀ``.

The first allreduce also carries the plan's *exact group* (the tensors below
``min_compress_numel``) when the engine hands it over (:meth:`LowRankExchange.run_with_exact`):
those tensors travel dense either way, so sending them in the ``P`` message saves the separate
allreduce the exact group would cost: a small allreduce is pure latency, a visible share of a
small model's step (docs/compressors.md, lowrank).

The second allreduce carries the step's closing report when the engine hands it over
(:meth:`LowRankExchange.run_riding`, ``carries_report``): a few dozen elements appended to the ``Q``
message, summed and not divided by N, so the step needs no collective of its own for the report
(lightning_gc/engine/agreement.py, ``RiddenReport``). ``sent`` is computed before that message, since
the report holds ‖sent‖².

With ``wire_dtype="bfloat16"`` both messages are divided by N, cast to bfloat16, summed in bfloat16
and widened to fp32 on arrival; ``sent`` is this rank's *rounded* contribution (times N), so error
feedback keeps the rounding (the codec module's docstring says why bfloat16 and not float16).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
from torch import Tensor

from ..comm.collectives import allreduce
from ..comm.exchange import Exchange, LazySent, Timer, sq_norm
from ..comm.network import NetworkState
from ..compressors.base import GroupContext
from ..compressors.lowrank.codec import Block, orthonormal, project, project_t
from ..compressors.lowrank.compressor import LowRankCompressor


class LowRankExchange(Exchange):
    """PowerSGD-family exchange; the compressor must be a :class:`LowRankCompressor`."""

    name = "lowrank"
    formats = frozenset({"lowrank"})
    carries_exact = True
    carries_report = True

    def __init__(self, compressor: LowRankCompressor, group=None, network: NetworkState | None = None) -> None:
        self._require(compressor, LowRankCompressor, "the low-rank (PowerSGD) exchange")
        super().__init__(compressor, group, network)
        self.compressor: LowRankCompressor = compressor
        self._q: dict[str, Tensor] = {}  # warm start: Q̄ of the previous step per compressed tensor

    @staticmethod
    def _key(ctx: GroupContext, b: Block) -> str:
        where = ctx.names[b.index] if b.index < len(ctx.names) else f"group{ctx.group_id}/{b.index}"
        return f"{where}:{b.rows}x{b.cols}"

    def _start(self, ctx: GroupContext, b: Block) -> Tensor:
        if self.compressor.config.warm_start:
            q = self._q.get(self._key(ctx, b))
            if q is not None and q.shape == (b.cols, self.compressor.config.rank):
                return q.to(ctx.device)
        return self.compressor.start_q(ctx, b)

    def run(self, p: Tensor, ctx: GroupContext, timer: Timer) -> tuple[Tensor, Tensor]:
        mean, sent, _, _ = self._run(p, ctx, timer, None, None)
        return mean, sent

    def run_with_exact(self, p: Tensor, ctx: GroupContext, timer: Timer,
                       exact: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """:meth:`run` with ``exact`` (fp32, flat) appended to the first allreduce's dense part."""
        mean, sent, exact_mean, _ = self._run(p, ctx, timer, exact, None)
        return mean, sent, exact_mean

    def report_dtype(self) -> torch.dtype:
        return self.compressor.config.wire_torch_dtype

    def run_riding(self, p: Tensor, ctx: GroupContext, timer: Timer, exact: Tensor | None,
                   report: Callable[[Tensor], Tensor]) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
        """:meth:`run` / :meth:`run_with_exact` with ``report(sent)`` appended to the ``Q`` message."""
        mean, sent, exact_mean, summed = self._run(p, ctx, timer, exact, report)
        assert summed is not None
        return mean, sent, exact_mean, summed

    def _run(self, p: Tensor, ctx: GroupContext, timer: Timer, exact: Tensor | None,
             report: Callable[[Tensor], Tensor] | None) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
        n = ctx.world_size
        if n == 1:
            summed = None if report is None else report(p).float()
            return p.clone(), p, (None if exact is None else exact.clone()), summed
        ne = 0 if exact is None else exact.numel()
        blocks = self.compressor.blocks(ctx)
        mats = [b for b in blocks if b.compressed]
        dense = [b for b in blocks if not b.compressed]
        r = self.compressor.config.rank
        wire = self.compressor.config.wire_torch_dtype

        def first() -> tuple[Tensor, Tensor, list[Tensor], list[Tensor]]:
            ms = [p[b.offset:b.offset + b.numel].view(b.rows, b.cols).float() for b in mats]
            ps = [project(m, self._start(ctx, b)) for m, b in zip(ms, mats)]
            parts = [p[b.offset:b.offset + b.numel].float() for b in dense] + [x.reshape(-1) for x in ps]
            if exact is not None:
                parts.insert(0, exact.float().reshape(-1))
            buf = torch.cat(parts) if parts else torch.zeros(0, device=p.device)
            nd = ne + sum(b.numel for b in dense)
            if wire is torch.float32:
                buf[:nd].div_(n)  # DDP's numerics for the dense tensors: the sum of g / N
                return buf, buf[:0], ms, ps
            # a 16-bit message: all of it divided by N before the cast (the orthogonalisation does
            # not see a common scale), and this rank's rounded dense part kept for `sent`
            out = buf.div_(n).to(wire)
            return out, out[ne:nd].float().mul_(n), ms, ps

        msg1, own_dense, ms, ps = timer.run("compress", first)
        timer.times.bytes_payload += msg1.numel() * msg1.element_size()
        timer.times.bytes_sent += timer.run("comm", lambda: allreduce([msg1], self.group, self.network.model))
        buf1 = msg1 if wire is torch.float32 else timer.run("compress", msg1.float)

        def second() -> tuple[Tensor, list[Tensor], list[Tensor]]:
            off = ne + sum(b.numel for b in dense)
            p_hats, q_locals = [], []
            for m, b in zip(ms, mats):
                p_sum = buf1[off:off + b.rows * r].view(b.rows, r)
                off += b.rows * r
                p_hat = orthonormal(p_sum)
                p_hats.append(p_hat)
                q_locals.append(project_t(m, p_hat))
            buf = torch.cat([q.reshape(-1) for q in q_locals]) if q_locals else torch.zeros(0, device=p.device)
            return buf, p_hats, q_locals

        buf2, p_hats, q_locals = timer.run("compress", second)
        nq = buf2.numel()
        if wire is torch.float32:
            sent_q = buf2.clone()  # this rank's own Q = Mᵀ·P̂ (error feedback, after the allreduce summed buf2)
            msg2 = buf2
        else:  # divided by N before the cast, as the first message; `sent` is what was rounded
            msg2 = timer.run("compress", lambda: buf2.div_(n).to(wire))
            sent_q = msg2.float().mul_(n)

        # this rank's contribution (error feedback; the report's ‖sent‖²): the dense tensors as sent
        # (fp32: p itself; bf16: the rounded share), each matrix's projection P̂·Q_ownᵀ. Kept lazy:
        # ‖P̂·Q_ownᵀ‖ = ‖Q_own‖ (P̂ has orthonormal columns, or a zero column where Q_own has one),
        # and error feedback subtracts it with one fused addmm per matrix, without building it
        dense_src = p if wire is torch.float32 else own_dense  # own_dense: the dense blocks back to back
        dense_at = ([b.offset for b in dense] if wire is torch.float32
                    else list(itertools.accumulate((b.numel for b in dense[:-1]), initial=0)) if dense else [])
        q_owns, off = [], 0
        for b in mats:
            q_owns.append(sent_q[off:off + b.cols * r].view(b.cols, r))
            off += b.cols * r

        def own(target: Tensor, sign: float) -> Tensor:
            """``target − sign·sent`` in place (sign −1 on zeros builds ``sent`` itself)."""
            for b, at in zip(dense, dense_at):
                target[b.offset:b.offset + b.numel].sub_(dense_src[at:at + b.numel], alpha=sign)
            for b, p_hat, q_own in zip(mats, p_hats, q_owns):
                target[b.offset:b.offset + b.numel].view(b.rows, b.cols).addmm_(p_hat, q_own.t(), alpha=-sign)
            return target

        sent2 = timer.run("compress", lambda: sum(sq_norm(q) for q in q_owns) + sum(
            sq_norm(dense_src[at:at + b.numel]) for b, at in zip(dense, dense_at)))
        sent = LazySent(sent2, lambda: own(torch.zeros_like(p), -1.0), lambda t: own(t, 1.0))
        timer.times.bytes_payload += msg2.numel() * msg2.element_size()
        if report is not None:  # the closing report rides: appended as it is (summed, not divided by N)
            share = report(sent)
            msg2 = timer.run("compress", lambda: torch.cat([msg2, share.to(device=msg2.device, dtype=msg2.dtype)]))
        timer.times.bytes_sent += timer.run("comm", lambda: allreduce([msg2], self.group, self.network.model))
        summed = None if report is None else msg2[nq:].float()

        def finish() -> Tensor:
            # the mean Q̄ (bf16: each share was divided by N before the cast)
            q_sum = msg2[:nq].div_(n) if wire is torch.float32 else msg2[:nq].float()
            mean = torch.empty_like(p)
            off = ne
            for b in dense:
                mean[b.offset:b.offset + b.numel] = buf1[off:off + b.numel]
                off += b.numel
            keep = bool(torch.isfinite(q_sum).all())  # replicated: the same sum on every rank
            off = 0
            for b, p_hat in zip(mats, p_hats):
                q_mean = q_sum[off:off + b.cols * r].view(b.cols, r)
                off += b.cols * r
                mean[b.offset:b.offset + b.numel] = (p_hat @ q_mean.t()).reshape(-1)
                if keep and self.compressor.config.warm_start:
                    self._q[self._key(ctx, b)] = q_mean.clone()
            return mean

        mean = timer.run("compress", finish)
        return mean, sent, (None if exact is None else buf1[:ne].to(exact.dtype).view_as(exact)), summed

    def describe(self) -> str:
        return f"{self.name}:{self.compressor.describe()}"

    def state_dict(self) -> dict:
        """The warm-start ``Q̄`` per compressed tensor (CPU), replicated on every rank. Present (if
        empty) from the start with warm start on: the exchange remembers earlier steps, which is
        what OMGS's refusal of stateful exchanges reads."""
        if not self.compressor.config.warm_start:
            return {}
        return {"lowrank_q": {k: q.detach().cpu().clone() for k, q in self._q.items()}}

    def load_state_dict(self, state: dict, world_size: int | None = None) -> None:
        """Restore :meth:`state_dict` (``Q̄`` does not depend on the number of ranks)."""
        self._q = {k: torch.as_tensor(q, dtype=torch.float32).clone() for k, q in (state.get("lowrank_q") or {}).items()}
