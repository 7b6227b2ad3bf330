"""OMGS on spawned gloo ranks: profile, MAX agreement, identical plans, re-planning; strategy surface.

Rank 1 sleeps inside backward (a custom autograd node between layers 2 and 3), rank 0 does not, so
the ranks' own profiles differ. Oracle: the agreed profile is the element-wise MAX of the ranks'
own medians (computed here from what every rank returns), both ranks see the delay, and the plan
each rank installed is the one the planner gives for those agreed facts — the same on both.
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch
from dist_harness import run_distributed
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_gc.compressors import build_compressor
from lightning_gc.engine import EngineConfig, GCEngine, gc_comm_hook
from lightning_gc.engine.omgs import OMGSConfig, OMGSController

DELAY_S = 0.03


class _SleepInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if ctx.seconds > 0:
            time.sleep(ctx.seconds)
        return g, None


class _Net(torch.nn.Module):
    def __init__(self, delay: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(48, 48) for _ in range(6))
        self.delay = delay

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if i == 2:
                x = _SleepInBackward.apply(x, self.delay)
        return x


def _run(rank: int, ws: int, replan_drift: float, steps: int) -> dict:
    model = _Net(DELAY_S if rank == 1 else 0.0)
    ddp = DDP(model, bucket_cap_mb=0.001)
    cfg_o = OMGSConfig(profile_skip_steps=1, profile_steps=5, calibration_sizes=3, calibration_repeats=2,
                       replan_drift=replan_drift, replan_window=2)
    engine = GCEngine(build_compressor("topk", ratio=0.05),
                      EngineConfig(plan="omgs", min_compress_numel=1024, warmup_steps=cfg_o.dense_steps_needed),
                      list(model.named_parameters()))
    ddp.register_comm_hook(engine, gc_comm_hook)
    ctl = OMGSController(engine, cfg_o, ddp, list(model.named_parameters()), "omgs")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    kinds, dense = [], []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * rank + step)
        x, y = torch.randn(16, 48, generator=g), torch.randn(16, 48, generator=g)

        def closure(x=x, y=y):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            loss.backward()
            return loss

        ctl.wrap_closure(closure)()
        engine.before_optimizer_step()
        opt.step()
        ctl.after_step()
        kinds.append(engine.plan.kind)
        dense.append(engine.last_step.dense)
    local = [statistics.median(col) for col in zip(*ctl._profile)]
    out = {
        "local": local, "agreed": ctl.backward_s, "sig": engine.plan.signature(), "kinds": kinds,
        "dense": dense, "replans": ctl.state.replans, "predicted": ctl.state.predicted_s,
        "measured": list(ctl.state.measured_s), "predictions": dict(ctl.state.predictions),
        "groups": [g.names for g in engine.plan.groups],
        "gamma": ctl.state.calibration.sparsify.gamma_s, "alpha": ctl.state.calibration.comm.intercept,
        "params": [p.detach().clone() for p in model.parameters()],
    }
    saved = ctl.state_dict()
    engine.close()
    ctl.detach()
    # resume: a fresh engine starts from the provisional plan; the restored profile is planned
    # from at the first step boundary, without profiling again
    engine2 = GCEngine(build_compressor("topk", ratio=0.05),
                       EngineConfig(plan="omgs", min_compress_numel=1024, warmup_steps=0),
                       list(model.named_parameters()))
    ddp2 = DDP(model, bucket_cap_mb=0.001)
    ddp2.register_comm_hook(engine2, gc_comm_hook)
    ctl2 = OMGSController(engine2, cfg_o, ddp2, list(model.named_parameters()), "omgs")
    ctl2.load_state_dict(saved)
    before = engine2.plan.kind
    x = torch.randn(16, 48)
    ctl2.wrap_closure(lambda: torch.nn.functional.mse_loss(ddp2(x), x).backward())()
    engine2.before_optimizer_step()
    ctl2.after_step()
    out["resume"] = {"before": before, "after": engine2.plan.kind, "profile": ctl2.backward_s,
                     "sig": engine2.plan.signature()}
    engine2.close()
    return out


def _scenarios(rank: int, ws: int) -> list[dict]:
    # one spawn for both (importing the package dominates a spawned test on a busy machine)
    return [_run(rank, ws, 1e6, 12), _run(rank, ws, 1e-9, 13)]


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_scenarios, 2)


def test_profile_agreed_by_max_and_plans_identical(runs):
    r0, r1 = runs[0][0], runs[1][0]
    assert r0["replans"] == r1["replans"] == 0  # drift threshold never reached
    n = len(r0["local"])
    assert n == 12 and r0["agreed"] == r1["agreed"]
    want = [max(a, b) for a, b in zip(r0["local"], r1["local"])]
    assert r0["agreed"] == pytest.approx(want, rel=0, abs=0)
    # the layers whose gradients come after the sleep (layers 0-2: params 0..5) carry rank 1's delay
    # on both ranks; rank 0's own profile does not
    names_after_sleep = range(0, 6)
    assert all(r0["agreed"][i] >= DELAY_S for i in names_after_sleep)
    assert all(r0["local"][i] < DELAY_S for i in names_after_sleep)
    assert r0["sig"] == r1["sig"] and r0["groups"] == r1["groups"]
    # provisional while profiling (dense), the OMGS plan once profiled, compressed from then on
    need = 1 + 1 + 5
    assert r0["kinds"][: need - 1] == ["omgs:provisional"] * (need - 1)
    assert r0["kinds"][need - 1:] == ["omgs"] * (12 - need + 1)
    assert r0["dense"] == [True] * need + [False] * (12 - need)
    # the installed plan is the planner's choice for the agreed facts: within the tie tolerance of
    # the best baseline (fewest groups among near-ties)
    p = r0["predictions"]
    assert p["omgs"] == pytest.approx(r0["predicted"])
    tol = OMGSConfig().tie_tolerance
    assert all(p["omgs"] <= p[k] * (1 + tol) * (1 + 1e-12) for k in ("model", "layer", "threshold", "omgs_paper"))
    assert r0["gamma"] == r1["gamma"] and r0["alpha"] == r1["alpha"]
    assert len(r0["measured"]) == 12 - need
    for r in (r0, r1):  # resume from the saved profile: planned at the first boundary, no re-profiling
        assert r["resume"]["before"] == "omgs:provisional" and r["resume"]["after"] == "omgs"
        assert r["resume"]["profile"] == r0["agreed"]
    assert r0["resume"]["sig"] == r1["resume"]["sig"]
    for a, b in zip(r0["params"], r1["params"]):  # replicas stay identical through the plan switch
        assert torch.equal(a, b)


def test_replanning_on_drift_is_identical_on_all_ranks(runs):
    a0, a1 = runs[0][1], runs[1][1]  # any drift triggers: one re-plan per 2-step window
    assert a0["replans"] == a1["replans"] == 3
    assert a0["sig"] == a1["sig"] and a0["groups"] == a1["groups"]
    for a, b in zip(a0["params"], a1["params"]):
        assert torch.equal(a, b)


def test_config_validation():
    with pytest.raises(ValueError, match="sparsify_on"):
        OMGSConfig(sparsify_on="gpu")
    with pytest.raises(ValueError, match="replan_drift"):
        OMGSConfig(replan_drift=-1)
    with pytest.raises(ValueError, match="Valid keys"):
        OMGSConfig.coerce({"profile_step": 3})
    assert OMGSConfig(profile_skip_steps=2, profile_steps=20).dense_steps_needed == 23


def test_strategy_surface():
    from lightning_gc import GCStrategy

    s = GCStrategy(plan="omgs", warmup_steps=1, omgs={"profile_steps": 4, "profile_skip_steps": 1})
    assert s.engine_config.plan == "omgs" and s.engine_config.warmup_steps == 6
    s2 = GCStrategy(plan="omgs_paper", warmup_steps=100)
    assert s2.engine_config.warmup_steps == 100
    s3 = GCStrategy(plan="layer")
    assert s3._omgs_config is None
