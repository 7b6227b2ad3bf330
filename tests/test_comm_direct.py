"""The direct exchange (lightning_gc/comm/direct.py): small allreduces and allgathers in one round.

Oracles: each rank's input is regenerated from its seed on every rank (no collective of the library
involved), the sum is written out by hand in rank order, and the choice rule is checked against
numbers worked out by hand from its documented inequality. One 4-rank spawn runs every case and
returns its findings; the parent asserts, so a failing case leaves no rank waiting.
"""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_distributed

from lightning_gc.comm import cost_model
from lightning_gc.comm.cost_model import NetworkModel
from lightning_gc.comm.direct import DIRECT_MAX_RANKS, DIRECT_SMALL_BYTES, allreduce_seconds, use_direct


def _input(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(500 + 13 * rank + numel)
    # rank-dependent scale: a rank left out, or counted twice, changes the sum by a visible amount
    return (torch.randn(numel, generator=g, dtype=torch.float32) * (1 + rank)).to(dtype)


def _cases(rank: int, ws: int) -> dict:
    import torch.distributed as dist

    from lightning_gc.comm.direct import allreduce_chosen, direct_allgather, direct_allreduce

    out: dict = {"sum": {}, "max": {}, "gather": {}, "bytes": {}}
    for numel, dtype in ((1, torch.float32), (37, torch.float32), (1000, torch.bfloat16), (257, torch.float64)):
        t = _input(rank, numel, dtype)
        sent = direct_allreduce(t, None)
        by_hand = _input(0, numel, dtype)
        for r in range(1, ws):  # the documented order: rank 0's message first, each added in turn
            by_hand = by_hand + _input(r, numel, dtype)
        exact = sum(_input(r, numel, dtype).double() for r in range(ws))
        out["sum"][(numel, str(dtype))] = (bool(torch.equal(t, by_hand)), float((t.double() - exact).abs().max()),
                                          t.clone())
        out["bytes"][(numel, str(dtype))] = sent
        m = _input(rank, numel, dtype)
        direct_allreduce(m, None, op="max")
        want = torch.stack([_input(r, numel, dtype) for r in range(ws)]).max(dim=0).values
        out["max"][(numel, str(dtype))] = bool(torch.equal(m, want))
    g = _input(rank, 11, torch.float32)
    bufs = [torch.empty(11) for _ in range(ws)]
    direct_allgather(bufs, g, None)
    out["gather"]["world"] = all(torch.equal(b, _input(r, 11, torch.float32)) for r, b in enumerate(bufs))
    # a subgroup of the odd ranks: group ranks 0, 1 are global ranks 1, 3
    sub = dist.new_group([1, 3])
    if rank in (1, 3):
        s = _input(rank, 5, torch.float32)
        direct_allreduce(s, sub)
        out["sub"] = bool(torch.equal(s, _input(1, 5, torch.float32) + _input(3, 5, torch.float32)))
    # allreduce_chosen: a small message by the direct exchange, a big one by the ring; both give the sum
    for numel in (16, 8192):
        t = _input(rank, numel, torch.float32)
        sent = allreduce_chosen(t, None)
        exact = sum(_input(r, numel, torch.float32).double() for r in range(ws))
        out[f"auto{numel}"] = (float((t.double() - exact).abs().max()), sent, t.clone())
    return out


def test_direct_allreduce_and_allgather_against_hand_written_oracles():
    ws = 4
    results = run_distributed(_cases, ws, timeout=180)
    for r, res in enumerate(results):
        for key, (in_order, err, _) in res["sum"].items():
            assert in_order, f"rank {r} {key}: not the rank-order sum"
            tol = 0.5 if "bfloat16" in key[1] else 1e-5
            assert err <= tol, f"rank {r} {key}: off the exact sum by {err}"
            numel, dtype = key
            esize = torch.empty((), dtype=getattr(torch, dtype.split(".")[1])).element_size()
            assert res["bytes"][key] == (ws - 1) * numel * esize  # every other rank gets one copy
        assert all(res["max"].values()), (r, res["max"])
        assert res["gather"]["world"], r
        if r in (1, 3):
            assert res["sub"], f"rank {r}: subgroup sum wrong"
        assert res["auto16"][0] <= 1e-5 and res["auto16"][1] == (ws - 1) * 16 * 4  # direct: 3 copies
        assert res["auto8192"][0] <= 1e-3 and res["auto8192"][1] == 2 * (ws - 1) * 8192 * 4 // ws  # the ring
    # every rank holds the same bits (the replicas stay identical)
    for key in results[0]["sum"]:
        assert all(torch.equal(results[0]["sum"][key][2], res["sum"][key][2]) for res in results[1:]), key
    for key in ("auto16", "auto8192"):
        assert all(torch.equal(results[0][key][2], res[key][2]) for res in results[1:]), key


def test_the_choice_rule_by_hand():
    assert (DIRECT_MAX_RANKS, DIRECT_SMALL_BYTES) == (8, 12 * 1024)  # the documented values
    # without a network model: the n - 1 copies at most 12 KiB
    assert use_direct(4096, 4) and not use_direct(4097, 4)  # 3 * 4096 = 12288
    assert use_direct(1755, 8) and not use_direct(1756, 8)  # 7 * 1755 = 12285, 7 * 1756 = 12292
    assert use_direct(12288, 2) and not use_direct(12289, 2)
    assert not use_direct(8, 1) and not use_direct(8, 9)  # one rank; more than 8 ranks
    # with a model: direct where alpha + 3 M beta < 6 alpha + 1.5 M beta, i.e. M < 5 alpha / (1.5 beta)
    fast = NetworkModel(1e-4, 8e-9)  # 1 Gbit/s: M < 41 666 bytes
    assert use_direct(41_000, 4, fast) and not use_direct(42_000, 4, fast)
    slow = NetworkModel(1e-4, 8e-7)  # 10 Mbit/s: M < 416 bytes, below the size rule: the size rule decides
    assert use_direct(4096, 4, slow) and not use_direct(4100, 4, slow)
    assert not use_direct(41_000, 9, fast)
    # the model's charge follows the same choice
    assert allreduce_seconds(fast, 41_000, 4) == pytest.approx(1e-4 + 3 * 41_000 * 8e-9)
    assert allreduce_seconds(fast, 42_000, 4) == pytest.approx(6e-4 + 1.5 * 42_000 * 8e-9)
    assert cost_model.direct_cost(1e-4, 8e-9, 1000, 1) == 0.0
