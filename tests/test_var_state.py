"""VAR AR-Topk's smoothed energies are per plan group and survive a checkpoint.

Every rank can generate every rank's input (the data is a function of (rank, group, step)), so the
oracle needs no collective: for each group it computes each rank's local top-k energy with
``torch.topk``, recomputes the EWMA ``s ← β·s + (1−β)·e`` per group, takes the argmax (lowest
rank on ties) and builds the expected mean ``Σ_r p_r[idx_src] / N``. The exchange's *output* is
compared with it, not its ``last_source`` label: the ranks' top-k sets differ, so a wrong source
gives a different mean.

The data is built so that each way of getting it wrong picks another source on some step, and the
test asserts that about its own data before it trusts a pass: state shared by all groups (the
large-magnitude group 0 would choose group 1's source), no smoothing, and a restore that drops the
state (the next step then acts as a fresh run).
"""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_distributed

from lightning_gc.comm.exchange import ExchangeTimes, Timer
from lightning_gc.compressors import GroupContext, ratio_to_k
from lightning_gc.compressors.artopk import ARTopKConfig, VARTopKCompressor
from lightning_gc.exchanges.artopk import ARTopkExchange

BETA = 0.8
RATIO = 0.05
NUMEL = 400
STEPS = 4
RESTORE_AT = 2  # a fresh exchange takes over here, loaded from the first one's state_dict
# per (group, step): scale of each rank's data (the first ws entries are used). Group 0 is large and
# led by rank 0; group 1 is small, led strongly by rank 1 at step 0 and slightly by rank 0 afterwards
# (smoothing keeps rank 1); group 2 is medium and led by rank 1 (not the last rank at 3 or 4 ranks).
# The fourth rank (4-rank runs) never leads.
SCALES = {
    0: [[30, 20, 25, 22]] * STEPS,
    1: [[1, 3, 1, 1], [1.2, 1, 1, 1], [1.2, 1, 1, 0.9], [1.25, 1, 0.9, 1]],
    2: [[3, 5, 1, 2], [3, 5, 1, 2], [5, 3, 1, 2], [5, 3, 1, 2]],
}


def _p(rank: int, gid: int, step: int, ws: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_000 * gid + 100 * step + rank)
    return torch.randn(NUMEL, generator=g) * SCALES[gid][step][:ws][rank]


def _energy(p: torch.Tensor, k: int) -> float:
    return float(torch.topk(p.abs(), k).values.double().pow(2).sum())


def _argmax_low(e: list[float]) -> int:
    best = max(e)
    return min(i for i, v in enumerate(e) if v == best)


def _sources(ws: int, mode: str) -> dict[tuple[int, int], int]:
    """Expected source per (group, step). ``mode``: ``per_group`` (the specification), ``shared``
    (one state for all groups), ``none`` (no smoothing), ``dropped`` (state lost at RESTORE_AT)."""
    k = ratio_to_k(RATIO, NUMEL)
    state: dict = {}
    out = {}
    for step in range(STEPS):
        if mode == "dropped" and step == RESTORE_AT:
            state = {}
        for gid in SCALES:
            e = torch.tensor([_energy(_p(r, gid, step, ws), k) for r in range(ws)], dtype=torch.float64)
            key = "all" if mode == "shared" else gid
            if mode != "none":
                if key in state:
                    e = BETA * state[key] + (1 - BETA) * e
                state[key] = e
            out[(gid, step)] = _argmax_low(e.tolist())
    return out


def _worker(rank: int, ws: int) -> dict:
    comp = VARTopKCompressor(ARTopKConfig(ratio=RATIO, selection="var", var_smoothing=BETA))
    ex = ARTopkExchange(comp, None, "allreduce")
    expected = _sources(ws, "per_group")
    worst = 0.0
    saved = None
    for step in range(STEPS):
        if step == RESTORE_AT:
            saved = ex.state_dict()
            ex = ARTopkExchange(comp, None, "allreduce")
            ex.load_state_dict(saved, world_size=ws)
        for gid in SCALES:
            ctx = GroupContext(step=step, rank=rank, world_size=ws, segments=(NUMEL,), group_id=gid, seed=0)
            mean, _ = ex.run(_p(rank, gid, step, ws), ctx, Timer(torch.device("cpu"), ExchangeTimes()))
            src = expected[(gid, step)]
            ps = [_p(r, gid, step, ws) for r in range(ws)]
            idx = torch.topk(ps[src].abs(), comp.num_kept(ctx)).indices
            ref = torch.zeros(NUMEL)
            ref[idx] = sum(p[idx] for p in ps) / ws
            worst = max(worst, float((mean - ref).abs().max()))
    return {"worst": worst, "saved": saved}


@pytest.mark.parametrize("ws", [2, 3, pytest.param(4, marks=pytest.mark.extended)])  # 4: 11 s, -m extended
def test_var_smoothing_is_per_group_and_restored(ws):
    right = _sources(ws, "per_group")
    # the data must make every mistake visible
    for wrong in ("shared", "none", "dropped"):
        assert _sources(ws, wrong) != right, f"data does not distinguish {wrong!r} from per-group state"
    assert any(right[(gid, s)] != ws - 1 for gid in SCALES for s in range(STEPS))
    results = run_distributed(_worker, ws, timeout=300)
    for r, res in enumerate(results):
        assert res["worst"] < 1e-5, f"rank {r}: mean differs from the hand-chosen source's by {res['worst']:.3g}"
        assert sorted(res["saved"]["var_energy"]) == sorted(SCALES)
        for gid, vec in res["saved"]["var_energy"].items():
            assert vec.shape == (ws,) and torch.equal(vec, results[0]["saved"]["var_energy"][gid])


def test_load_state_dict_drops_vectors_of_another_world_size():
    comp = VARTopKCompressor(ARTopKConfig(ratio=RATIO, selection="var", var_smoothing=BETA))
    ex = ARTopkExchange(comp, None, "allreduce")
    ex.load_state_dict({"var_energy": {0: torch.ones(3), 1: torch.ones(2)}}, world_size=2)
    assert list(ex.state_dict()["var_energy"]) == [1]
