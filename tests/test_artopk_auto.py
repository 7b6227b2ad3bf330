"""``artopk_auto`` runs the collective the alpha-beta model says is fastest — checked by what ran.

Independent oracle: Table I / Eq. 4a-4b are written out below (``L = ceil(log2 N)``, the rounds
of the binomial trees that run), the decision boundaries in alpha are found by bisection on those
formulas, and pinned networks are placed 10 % on each side of every boundary. For each network
every rank runs the exchange on rank-dependent data and records which sub-exchange's ``run`` was
actually called (the allgather, the ART-Ring or the ART-Tree object), and the mean it returned is
compared with the mean that collective must produce, computed from all ranks' inputs: plain
Top-k (every rank its own top-k) or STAR AR-Topk (source = step mod N).

3 ranks exercise the allgather / ART-Ring boundary (ART-Tree cannot win below 6 ranks); 8 ranks
have all three regions (allgather, ART-Tree, ART-Ring as alpha/beta falls).
"""

from __future__ import annotations

import math

import pytest
import torch
from dist_harness import run_distributed

from lightning_gc.comm.cost_model import NetworkModel
from lightning_gc.comm.exchange import ExchangeTimes, Timer
from lightning_gc.compressors import GroupContext, build_compressor
from lightning_gc.exchanges.artopk import AutoSparseExchange, NetworkState

NUMEL = 3000
RATIO = 0.05
BETA = 1e-8  # s/B (800 Mbit/s); alpha is what moves across the boundaries


def _costs(alpha: float, beta: float, numel: int, n: int, c: float) -> dict[str, float]:
    """Table I / Eq. 4a-4b with M = 4*numel (fp32 values, int32 indices), L = ceil(log2 N)."""
    L = math.ceil(math.log2(n))
    mc = 4 * numel * c
    return {
        "allgather": alpha * L + 2 * mc * beta * (n - 1),
        "art_ring": alpha * (2 * (n - 1) + L) + mc * beta * (2 * (n - 1) / n + L),
        "art_tree": 3 * alpha * L + 3 * mc * beta * L,
    }


def _best(alpha: float, n: int) -> str:
    costs = _costs(alpha, BETA, NUMEL, n, RATIO)
    return min(costs, key=costs.get)


def _boundaries(n: int) -> list[float]:
    """Values of alpha where the cheapest collective changes (bisection on the formulas)."""
    grid = [10 ** (e / 8) for e in range(-80, -8)]  # 1e-10 .. ~1e-1 s
    out = []
    for lo, hi in zip(grid, grid[1:]):
        if _best(lo, n) != _best(hi, n):
            for _ in range(200):
                mid = (lo + hi) / 2
                lo, hi = (mid, hi) if _best(mid, n) == _best(lo, n) else (lo, mid)
            out.append((lo + hi) / 2)
    return out


def _alphas(n: int) -> list[float]:
    return [b * f for b in _boundaries(n) for f in (0.9, 1.1)]


def _p(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(77 + 31 * rank + 1000 * step)
    return torch.randn(NUMEL, generator=g) * (1.0, 2.5, 0.7, 1.6)[rank % 4]


def _worker(rank: int, ws: int, alphas: list[float]) -> list[dict]:
    comp = build_compressor("artopk_auto", ratio=RATIO)
    out = []
    for alpha in alphas:
        ex = AutoSparseExchange(comp, None, NetworkState(NetworkModel(alpha, BETA), pinned=True))
        ran: list[str] = []
        for label, sub in (("allgather", ex._ag), ("art_ring", ex._ring), ("art_tree", ex._tree)):
            def wrapped(*a, _run=sub.run, _label=label, _ran=ran, **kw):
                _ran.append(_label)
                return _run(*a, **kw)
            sub.run = wrapped
        worst = 0.0
        for step in range(2):
            ctx = GroupContext(step=step, rank=rank, world_size=ws, segments=(NUMEL,), group_id=0, seed=0)
            mean, _ = ex.run(_p(rank, step), ctx, Timer(torch.device("cpu"), ExchangeTimes()))
            ps = [_p(r, step) for r in range(ws)]
            k = math.ceil(RATIO * NUMEL)
            tops = [torch.topk(p.abs(), k).indices for p in ps]
            ref = torch.zeros(NUMEL)
            if ran[-1] == "allgather":
                for p, idx in zip(ps, tops):
                    ref[idx] += p[idx] / ws
            else:
                idx = tops[step % ws]
                ref[idx] = sum(p[idx] for p in ps) / ws
            worst = max(worst, float((mean - ref).abs().max()))
        out.append({"alpha": alpha, "ran": ran, "worst": worst})
    return out


@pytest.mark.parametrize("ws,regions", [(3, {"allgather", "art_ring"}), (8, {"allgather", "art_ring", "art_tree"})])
def test_auto_runs_the_collective_table_one_predicts_on_both_sides_of_each_boundary(ws, regions):
    alphas = _alphas(ws)
    expected = [_best(a, ws) for a in alphas]
    assert set(expected) == regions, (ws, expected)  # every region is visited
    assert len(_boundaries(ws)) == len(regions) - 1
    results = run_distributed(_worker, ws, alphas, timeout=300)
    for r, res in enumerate(results):
        for want, case in zip(expected, res):
            assert case["ran"] == [want, want], f"rank {r}, alpha={case['alpha']:.3g}: ran {case['ran']}, want {want}"
            assert case["worst"] < 1e-5, f"rank {r}, alpha={case['alpha']:.3g}: mean off by {case['worst']:.3g}"
