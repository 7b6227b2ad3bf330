"""Each method through Lightning Fabric on 2 gloo ranks with rank-dependent data: it trains with
the ranks identical and does what it says, or it is refused at construction.

Oracles: DiLoCo against a reference that simulates both ranks' inner SGD steps and the outer
Nesterov SGD step in one process from both ranks' data (no lightning_gc code); its bytes against
the byte counter of a per-step dense step (the Top-k run's dense warm-up step): H times more per
outer step, and the ring-allreduce formula 2(N−1)/N·4n; Top-k's payload against the formula
k = ⌈ratio·n⌉ values + int32 indices; ranks compared with each other.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from dist_harness import run_distributed

from lightning_gc import GCFabricStrategy

STEPS, H, BATCH, RATIO, LR = 10, 4, 8, 0.1, 0.1


def _model() -> torch.nn.Module:
    torch.manual_seed(7)  # every tensor ≥ 1024 elements: one compressed group
    return torch.nn.Sequential(torch.nn.Linear(32, 64, bias=False), torch.nn.Tanh(), torch.nn.Linear(64, 32, bias=False))


def _data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(50 + rank)
    return torch.randn(STEPS * BATCH, 32, generator=g) * (1 + rank), torch.randn(STEPS * BATCH, 32, generator=g)


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, i: int) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(x[i * BATCH:(i + 1) * BATCH]), y[i * BATCH:(i + 1) * BATCH])


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def _fabric_run(rank: int, strategy: GCFabricStrategy) -> dict:
    from lightning.fabric import Fabric

    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=2)
    fabric.launch()
    model = _model()
    fmodel, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=LR))
    x, y = _data(rank)
    outer, bytes_at = [], {}
    for i in range(STEPS):
        opt.zero_grad()
        fabric.backward(_loss(fmodel, x, y, i))
        opt.step()
        diloco = fabric.strategy.diloco
        outer.append(diloco.outer_steps if diloco is not None else None)
        bytes_at[i + 1] = fabric.strategy.engine.totals()["bytes_sent"]
    out = {"outer": outer, "bytes_at": bytes_at, "before_finish": _flat(model), "totals": strategy.engine.totals(),
           "hook_calls": strategy.engine.hook_calls}
    strategy.finish()
    out["after_finish"] = _flat(model)
    strategy.finish()  # a second call changes nothing
    out["after_second_finish"] = _flat(model)
    strategy.close()
    return out


def _ranks(rank: int, world_size: int, tmp: str) -> dict:
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world_size))
    return {
        "topk": _fabric_run(rank, GCFabricStrategy(compressor="topk", ratio=RATIO, warmup_steps=1)),
        "diloco": _fabric_run(rank, GCFabricStrategy(compressor="dense", sync="diloco", diloco_inner_steps=H)),
    }


def _diloco_reference() -> torch.Tensor:
    """Both ranks simulated in one process: H inner SGD steps from θ_outer on each rank's data, Δ the
    mean of θ_outer − θ_local, outer SGD lr 0.7, momentum 0.9, Nesterov (the published defaults);
    the closing round at the end is an outer step on the inner steps since the last one."""
    outer_model = _model()
    outer_opt = torch.optim.SGD(outer_model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    locals_ = [_model() for _ in range(2)]
    opts = [torch.optim.SGD(m.parameters(), lr=LR) for m in locals_]
    data = [_data(r) for r in range(2)]

    def outer_step() -> None:
        for params in zip(outer_model.parameters(), *(m.parameters() for m in locals_)):
            o, *loc = params
            o.grad = sum(o.detach() - p.detach() for p in loc) / len(loc)
        outer_opt.step()
        with torch.no_grad():
            for m in locals_:
                for o, p in zip(outer_model.parameters(), m.parameters()):
                    p.copy_(o)

    for i in range(STEPS):
        for m, opt, (x, y) in zip(locals_, opts, data):
            opt.zero_grad()
            _loss(m, x, y, i).backward()
            opt.step()
        if (i + 1) % H == 0:
            outer_step()
    outer_step()  # STEPS % H inner steps left open: the closing round
    return _flat(outer_model)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_distributed(_ranks, 2, str(tmp_path_factory.mktemp("fabric_methods")), timeout=300)


def test_diloco_under_fabric_takes_outer_steps_and_finish_closes_the_round(runs):
    want_outer = [(i + 1) // H for i in range(STEPS)]
    for res in runs:
        d = res["diloco"]
        assert d["outer"] == want_outer and d["hook_calls"] == 0  # inner steps handed DDP's hook nothing
    a, b = runs[0]["diloco"], runs[1]["diloco"]
    assert not torch.equal(a["before_finish"], b["before_finish"])  # mid-round: each rank its own θ_local
    assert torch.equal(a["after_finish"], b["after_finish"])
    assert torch.equal(a["after_finish"], a["after_second_finish"])  # the closing step applied once
    torch.testing.assert_close(a["after_finish"], _diloco_reference(), rtol=1e-5, atol=1e-6)


def test_diloco_under_fabric_sends_h_times_fewer_bytes_than_per_step_dense(runs):
    n = sum(p.numel() for p in _model().parameters())
    last_outer = (STEPS // H) * H
    for res in runs:
        dense_step = res["topk"]["bytes_at"][1]  # a per-step dense DDP step, as the engine counts it
        diloco = res["diloco"]["bytes_at"][last_outer]
        assert diloco == (last_outer // H) * 2 * (2 - 1) * 4 * n // 2  # one fp32 ring allreduce per outer step
        assert last_outer * dense_step / diloco == pytest.approx(H, rel=1e-3)


def test_topk_under_fabric_sends_ratio_times_dense_by_the_payload_formula(runs):
    n = sum(p.numel() for p in _model().parameters())
    k = math.ceil(RATIO * n)
    for res in runs:
        t = res["topk"]["totals"]
        assert t["compressed_steps"] == STEPS - 1  # one dense warm-up step
        per_step = (t["bytes_payload"] - 4 * n) / (STEPS - 1)  # less the warm-up step's fp32 payload
        assert per_step == 8 * k  # k fp32 values + k int32 indices: ≈ 2·ratio of the dense 4·n bytes
    assert torch.equal(runs[0]["topk"]["after_finish"], runs[1]["topk"]["after_finish"])


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"compressor": "auto"}, r"GCFabricStrategy\(compressor='auto'\) is not supported: auto profiles forward and "
                             r"backward inside the optimizer closure.*lightning-gc advise.*GCStrategy\(compressor='auto'\)"),
    ({"sync": "osp"}, r"GCFabricStrategy\(sync='osp'\) is not supported.*GCStrategy\(sync='osp'\) with a Lightning"),
    ({"plan": "omgs"}, r"GCFabricStrategy\(plan='omgs'\) is not supported.*Use plan='model'"),
    ({"omgs": {}}, r"GCFabricStrategy\(omgs=\) is not supported"),
])
def test_what_fabric_cannot_serve_is_refused_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GCFabricStrategy(**kwargs)


def test_the_diloco_aliases_reach_fabric():
    from lightning.fabric import Fabric

    import lightning_gc  # noqa: F401 - registers the aliases

    strategy = Fabric(strategy="gc_topk_diloco", accelerator="cpu", devices=2).strategy
    assert isinstance(strategy, GCFabricStrategy)
    assert (strategy.config.sync, strategy.compressor_name) == ("diloco", "topk")
    assert Fabric(strategy="gc_diloco", accelerator="cpu", devices=2).strategy.config.compression.compressor == "dense"
