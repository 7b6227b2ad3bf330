"""OMGS on spawned gloo ranks: profile, MAX agreement, identical plans, re-planning; strategy surface.

Rank 1 sleeps inside backward (a custom autograd node between layers 2 and 3), rank 0 does not, so
the ranks' own profiles differ. Oracle: the agreed profile is the element-wise MAX of the ranks'
own medians (computed here from what every rank returns), both ranks see the delay, and the plan
each rank installed is the one the planner gives for those agreed facts — the same on both.

The engine configuration comes from ``GCConfig.from_flat`` as GCStrategy builds it, so the number
of dense steps is what a user gets: by default (``profile_on="compressed"``) the engine's own
warm-up (1 step) and the profile on the provisional plan's compressed steps; with
``profile_on="dense"`` the old dense profile (warm-up raised to ``dense_steps_needed``).
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch
from dist_harness import run_distributed
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_gc.compressors import build_compressor
from lightning_gc.config import GCConfig
from lightning_gc.engine import EngineConfig, GCEngine, gc_comm_hook
from lightning_gc.engine.omgs import OMGSConfig, OMGSController
from lightning_gc.engine.session import StepSession, session_comm_hook

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


def _configs(replan_drift: float, **omgs) -> tuple[OMGSConfig, EngineConfig]:
    """OMGSConfig and EngineConfig as GCStrategy builds them (GCConfig.from_flat, warm-up rule included)."""
    cfg = GCConfig.from_flat(compressor="topk", ratio=0.05, plan="omgs", min_compress_numel=1024,
                             omgs={"profile_skip_steps": 1, "profile_steps": 5, "calibration_sizes": 3,
                                   "calibration_repeats": 2, "replan_drift": replan_drift, "replan_window": 2,
                                   **omgs})
    return cfg.omgs, cfg.engine


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(16, 48, generator=g), torch.randn(16, 48, generator=g)


def _run(rank: int, ws: int, replan_drift: float, steps: int, profile_on: str = "compressed") -> dict:
    model = _Net(DELAY_S if rank == 1 else 0.0)
    ddp = DDP(model, bucket_cap_mb=0.001)
    cfg_o, cfg_e = _configs(replan_drift, profile_on=profile_on)
    engine = GCEngine(build_compressor("topk", ratio=0.05), cfg_e, list(model.named_parameters()))
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
    local = [statistics.median(col) for col in zip(*ctl.profile)]
    cal = ctl.state.calibration
    out = {
        "warmup_steps": cfg_e.warmup_steps, "profiled": len(ctl.profile),
        "local": local, "agreed": ctl.backward_s, "sig": engine.plan.signature(), "kinds": kinds,
        "dense": dense, "replans": ctl.state.replans, "predicted": ctl.state.predicted_s,
        "measured": list(ctl.state.measured_s), "predictions": dict(ctl.state.predictions),
        "groups": [g.names for g in engine.plan.groups],
        "gamma": None if cal is None else cal.sparsify.gamma_s, "alpha": None if cal is None else cal.comm.intercept,
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


def _rollback(rank: int, ws: int) -> dict:
    """Through the StepSession, as AdaptiveRatio's rollback exploration uses it: a snapshot taken
    while OMGS still profiles compressed steps, steps run past the end of the profile (the plan is
    installed), then the snapshot restored; training goes on and profiles again."""
    model = _Net(DELAY_S if rank == 1 else 0.0)
    ddp = DDP(model, bucket_cap_mb=0.001)
    cfg_o, cfg_e = _configs(1e6)
    named = list(model.named_parameters())
    engine = GCEngine(build_compressor("topk", ratio=0.05), cfg_e, named)
    ctl = OMGSController(engine, cfg_o, ddp, named, "omgs")
    session = StepSession(engine, [ctl])
    ddp.register_comm_hook(session, session_comm_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(i: int) -> None:
        x, y = _batch(rank, i)

        def closure():
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            loss.backward()
            return loss

        session.optimizer_step(opt, closure, lambda c: opt.step(c))

    for i in range(4):
        step(i)
    snap = session.snapshot()
    mid = {"profiled": len(ctl.profile), "hooks": ctl.hooks_installed, "kind": engine.plan.kind}
    for i in range(4, 9):  # exploration: the profile ends at step 6's boundary, the plan is installed
        step(i)
    explored = {"kind": engine.plan.kind, "hooks": ctl.hooks_installed, "version": ctl.state.plan_version}
    session.restore(snap)
    restored = {"kind": engine.plan.kind, "profiling": ctl.profiling, "hooks": ctl.hooks_installed,
                "profiled": len(ctl.profile), "step": engine.step, "version": ctl.state.plan_version}
    kinds = []
    for i in range(4, 10):
        step(i)
        kinds.append(engine.plan.kind)
    out = {"mid": mid, "explored": explored, "restored": restored, "kinds": kinds, "profiled": len(ctl.profile),
           "agreed": ctl.backward_s, "sig": engine.plan.signature(), "version": ctl.state.plan_version,
           "hooks": ctl.hooks_installed}
    session.close()
    ctl.detach()
    return out


def _scenarios(rank: int, ws: int) -> list[dict]:
    # one spawn for all (importing the package dominates a spawned test on a busy machine)
    return [_run(rank, ws, 1e6, 12), _run(rank, ws, 1e-9, 13), _run(rank, ws, 1e6, 12, "dense"),
            _rollback(rank, ws)]


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
    # the default profiles compressed steps: the warm-up stays the engine's own (1 dense step, not
    # 1 + skip + profile = 7), step 1 is skipped, steps 2-6 are profiled on the provisional plan,
    # and the OMGS plan is installed at step 6's boundary
    need = 1 + 1 + 5
    for r in (r0, r1):
        assert r["warmup_steps"] == EngineConfig().warmup_steps == 1
        assert r["dense"] == [True] + [False] * 11
        assert r["profiled"] == 5
        assert r["kinds"][: need - 1] == ["omgs:provisional"] * (need - 1)
        assert r["kinds"][need - 1:] == ["omgs"] * (12 - need + 1)
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


def test_dense_profile_keeps_the_old_behaviour(runs):
    """profile_on="dense": warm-up raised to 1 + skip + profile, the profile taken on those dense steps."""
    d0, d1 = runs[0][2], runs[1][2]
    need = 1 + 1 + 5
    for r in (d0, d1):
        assert r["warmup_steps"] == need
        assert r["dense"] == [True] * need + [False] * (12 - need)
        assert r["profiled"] == 5
        assert r["kinds"][: need - 1] == ["omgs:provisional"] * (need - 1)
        assert r["kinds"][need - 1:] == ["omgs"] * (12 - need + 1)
        assert len(r["measured"]) == 12 - need
    assert d0["agreed"] == d1["agreed"] == pytest.approx([max(a, b) for a, b in zip(d0["local"], d1["local"])],
                                                         rel=0, abs=0)
    assert all(d0["agreed"][i] >= DELAY_S for i in range(6))
    assert d0["sig"] == d1["sig"]


def test_rollback_across_the_end_of_the_profile(runs):
    """A snapshot taken mid-profile and restored after the plan was installed puts the profile back
    (hooks re-installed, provisional plan); the profile is then finished again, identically on all ranks."""
    b0, b1 = runs[0][3], runs[1][3]
    for b in (b0, b1):
        assert b["mid"] == {"profiled": 2, "hooks": 12, "kind": "omgs:provisional"}  # steps 2 and 3 profiled
        assert b["explored"] == {"kind": "omgs", "hooks": 0, "version": 1}
        assert b["restored"] == {"kind": "omgs:provisional", "profiling": True, "hooks": 12, "profiled": 2,
                                 "step": 4, "version": 0}
        # steps 4, 5, 6 complete the profile again; the plan is installed at step 6's boundary
        assert b["kinds"] == ["omgs:provisional"] * 2 + ["omgs"] * 4
        assert b["profiled"] == 5 and b["version"] == 1 and b["hooks"] == 0
    assert b0["agreed"] == b1["agreed"] and b0["sig"] == b1["sig"]
    assert all(b0["agreed"][i] >= DELAY_S for i in range(6))


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
    with pytest.raises(ValueError, match=r"profile_on='warmup' is invalid: use 'compressed'.*or 'dense'"):
        OMGSConfig(profile_on="warmup")
    assert OMGSConfig().profile_on == "compressed"
    # the default adds no dense step; the old dense profile needs step 0 + skipped + profiled steps
    assert OMGSConfig(profile_skip_steps=2, profile_steps=20).dense_steps_needed == 0
    assert OMGSConfig(profile_skip_steps=2, profile_steps=20, profile_on="dense").dense_steps_needed == 23


def test_controller_refuses_compressed_profile_without_overlap():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 48))
    named = list(model.named_parameters())
    engine = GCEngine(build_compressor("topk", ratio=0.05), EngineConfig(plan="omgs", overlap=False), named)
    try:
        with pytest.raises(ValueError, match=r"profile_on='compressed'\) with overlap=False.*profile_on': 'dense'"):
            OMGSController(engine, OMGSConfig(), model, named, "omgs")
        OMGSController(engine, OMGSConfig(profile_on="dense"), model, named, "omgs").detach()
    finally:
        engine.close()


def test_strategy_surface():
    from lightning_gc import GCStrategy

    # the default profiles compressed steps: warmup_steps is not raised
    s = GCStrategy(plan="omgs", warmup_steps=1, omgs={"profile_steps": 4, "profile_skip_steps": 1})
    assert s.engine_config.plan == "omgs" and s.engine_config.warmup_steps == 1
    assert GCStrategy(plan="omgs").engine_config.warmup_steps == EngineConfig().warmup_steps == 1
    # profile_on="dense": raised to 1 + skip + profile, as before
    sd = GCStrategy(plan="omgs", warmup_steps=1, omgs={"profile_steps": 4, "profile_skip_steps": 1,
                                                       "profile_on": "dense"})
    assert sd.engine_config.warmup_steps == 6
    # overlap=False cannot profile compressed steps (the exchanges run inside backward): dense profile
    so = GCStrategy(plan="omgs", overlap=False, omgs={"profile_steps": 4, "profile_skip_steps": 1})
    assert so.config.omgs.profile_on == "dense" and so.engine_config.warmup_steps == 6
    s2 = GCStrategy(plan="omgs_paper", warmup_steps=100)
    assert s2.engine_config.warmup_steps == 100
    s3 = GCStrategy(plan="layer")
    assert s3.config.omgs is None
