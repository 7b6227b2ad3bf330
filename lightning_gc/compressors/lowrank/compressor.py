"""The low-rank compressor: which tensors are compressed, and a single-rank compress/decompress.

The distributed method (two allreduces, warm start, error feedback) is the ``lowrank`` exchange
in :mod:`.exchange`; the math and the decisions are in :mod:`.codec`. ``compress`` here is the
one-rank version of the same projection — ``P̂ = orth(M·Q₀)``, ``Q = Mᵀ·P̂`` with a fresh shared
``Q₀`` — used by the codec micro-benchmark and to state what a payload stands for.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..base import Compressed, Compressor, GroupContext
from .codec import Block, LowRankConfig, initial_q, orthonormal, plan_blocks, project, project_t


class LowRankCompressor(Compressor):
    """PowerSGD-family rank-r compression of every large enough gradient matrix (see :mod:`.codec`).

    Payload of :meth:`compress`: ``(dense, P̂, Q)`` — the dense tensors' values, then every
    compressed matrix's ``P̂`` (n·r) and ``Q`` (m·r), flattened in tensor order, all three in the
    configured ``wire_dtype`` (so that ``nbytes`` and the decompressed error are the message's). Only the
    ``lowrank`` exchange carries it (two allreduces with an orthogonalisation between them).
    """

    name = "lowrank"
    wire_format = "lowrank"
    default_error_feedback = True
    wire_description = ("rank-r factors P (n×r) and Q (m×r) of every large gradient matrix, in two allreduces; "
                        "small tensors dense")

    def __init__(self, config: LowRankConfig | None = None) -> None:
        self.config = config or LowRankConfig()

    @property
    def wire_element_size(self) -> int:
        """Bytes per element of both messages (4 for ``"float32"``, 2 for ``"bfloat16"``): the plan's
        exact group rides in the ``P`` message at this size."""
        return torch.empty(0, dtype=self.config.wire_torch_dtype).element_size()

    @property
    def payload_fraction(self) -> float:
        """Not known without the shapes; the exchange counts the exact bytes. An estimate for a
        square 512×512 matrix: (n + m)·r / (n·m), halved for a 16-bit ``wire_dtype``."""
        return min(1.0, 2 * 512 * self.config.rank / 512 ** 2) * self.wire_element_size / 4

    def blocks(self, ctx: GroupContext) -> list[Block]:
        return plan_blocks(ctx.segments, ctx.shapes, self.config, ctx.names)

    def start_q(self, ctx: GroupContext, block: Block) -> Tensor:
        """A fresh ``Q`` for ``block``: shared by every rank (seed, step, group, tensor)."""
        return initial_q(block.cols, self.config.rank, ctx.shared_generator(salt=block.index + 1), ctx.device)

    def compress(self, x: Tensor, ctx: GroupContext) -> Compressed:
        return self._compress(x, ctx, {})[0]

    def warm_compress(self, x: Tensor, ctx: GroupContext, steps: int) -> Compressed:
        """``x`` compressed as by the ``steps``-th of as many warm-started steps on this same gradient:
        each step's ``Q = Mᵀ·P̂`` starts the next (``steps`` power iterations from the shared random
        start; ``steps=1`` is :meth:`compress`).

        Why: the method runs warm-started, and one iteration from a random ``Q`` is not what it sends
        after a few steps: one warm step already leaves out much less of the gradient's energy,
        close to the SVD optimum. ``compressor="auto"`` measures the method's error this
        way (``steps=2``), so that its progress proxy rates the method that will run."""
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"warm_compress(steps={steps!r}): steps must be an integer >= 1 (1 = a cold start)")
        starts: dict[int, Tensor] = {}
        for _ in range(steps):
            out, starts = self._compress(x, ctx, starts)
        return out

    def _compress(self, x: Tensor, ctx: GroupContext, starts: dict[int, Tensor]) -> tuple[Compressed, dict[int, Tensor]]:
        blocks = self.blocks(ctx)
        wire = self.config.wire_torch_dtype
        dense = [x[b.offset:b.offset + b.numel] for b in blocks if not b.compressed]
        ps, qs, nxt = [], [], {}
        for b in blocks:
            if not b.compressed:
                continue
            m = x[b.offset:b.offset + b.numel].view(b.rows, b.cols).float()
            q0 = starts.get(b.index)
            # P travels in the wire type before it is orthogonalised, as in the exchange
            p_hat = orthonormal(project(m, self.start_q(ctx, b) if q0 is None else q0).to(wire).float())
            q = project_t(m, p_hat)
            nxt[b.index] = q
            ps.append(p_hat.reshape(-1))
            qs.append(q.reshape(-1))
        dense_dtype = x.dtype if wire is torch.float32 else wire
        return Compressed((_cat(dense, x.dtype, x.device).to(dense_dtype), _cat(ps, torch.float32, x.device).to(wire),
                           _cat(qs, torch.float32, x.device).to(wire)), meta=(x.dtype, blocks)), nxt

    def decompress(self, payload: tuple[Tensor, ...], meta: Any, ctx: GroupContext) -> Tensor:
        dtype, blocks = meta
        dense, ps, qs = payload
        out = torch.empty(ctx.numel, dtype=dtype, device=dense.device)
        d = pq = q_off = 0
        r = self.config.rank
        for b in blocks:
            if not b.compressed:
                out[b.offset:b.offset + b.numel] = dense[d:d + b.numel]
                d += b.numel
                continue
            p_hat = ps[pq:pq + b.rows * r].view(b.rows, r).float()
            q = qs[q_off:q_off + b.cols * r].view(b.cols, r).float()
            out[b.offset:b.offset + b.numel] = (p_hat @ q.t()).reshape(-1).to(dtype)
            pq += b.rows * r
            q_off += b.cols * r
        return out

    def describe(self) -> str:
        c = self.config
        dense = f",dense={list(c.dense_names)}" if c.dense_names else ""
        wire = f",wire={c.wire_dtype}" if c.wire_dtype != "float32" else ""
        return f"{self.name}(rank={c.rank},min_rate={c.min_compression_rate},warm={c.warm_start}{dense}{wire})"


def _cat(tensors: list[Tensor], dtype: torch.dtype, device: torch.device) -> Tensor:
    return torch.cat(tensors) if tensors else torch.zeros(0, dtype=dtype, device=device)
