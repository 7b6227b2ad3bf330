"""DiLoCo (lightning_gc/sync/diloco.py) where the suite had no oracle: a non-finite round discarded
under Streaming DiLoCo (F > 1 fragments, τ > 0 overlap steps, mixing α > 0), and the averaging of
floating-point buffers (BatchNorm running statistics) at the outer step.

Oracles, computed in the parent from what every rank reported (never from the library's own
results): a float64 replay of Streaming DiLoCo with a hand-written Nesterov outer step per
fragment, where a discarded round leaves θ_outer and the outer momentum as they were and puts every
rank back on θ_outer; and the mean over the ranks of each rank's own buffers just before the outer
step.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from dist_harness import run_distributed

from lightning_gc.sync.diloco import DiLoCoConfig, DiLoCoSync

SHAPES = [(40, 30), (30,), (7, 50)]


class _Engine:
    """The engine double: what DiLoCo reads (parameters, group, seed) and the bytes it reports."""

    def __init__(self, named_params, world_size):
        import torch.distributed as dist

        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.world_size = world_size
        self.device = torch.device("cpu")
        self.process_group = dist.group.WORLD
        self.config = SimpleNamespace(seed=0)

    def add_deferred_traffic(self, bytes_sent, bytes_payload, bytes_inter_node=0):
        pass


def _theta0():
    g = torch.Generator().manual_seed(7)
    return [torch.randn(s, generator=g) for s in SHAPES]


def _move(rank, t):
    """Rank- and step-dependent inner displacement (signs and scales differ per rank)."""
    g = torch.Generator().manual_seed(100 * t + rank)
    return [0.1 * torch.randn(s, generator=g) * (0.5 + rank) * (-1) ** (rank + t) for s in SHAPES]


# ------------------------------------------------------------------ the discard under Streaming DiLoCo

H, F, TAU, ALPHA, STEPS = 4, 2, 1, 0.25, 9
OUTER = {"lr": 0.7, "momentum": 0.9, "nesterov": True}
NAN_RANK, NAN_STEP = 1, 5  # rank 1's fragment 0 turns NaN at step 5: its round sent at 6 is non-finite
# fragment 0 (the 1200-element tensor) is sent at steps 2 and 6, applied at 3 and 7; fragment 1 (the
# other two) is sent at 4 and 8, applied at 5 and 9
FRAGS = [[0], [1, 2]]
SENDS = {2: 0, 4: 1, 6: 0, 8: 1}
DISCARDED_AT = 7


def _streaming_nan(rank, world_size):
    params = [t.clone() for t in _theta0()]
    sync = DiLoCoSync(_Engine([(f"p{i}", p) for i, p in enumerate(params)], world_size),
                      DiLoCoConfig(inner_steps=H, outer_args=OUTER, fragments=F, overlap_steps=TAU, mixing=ALPHA))
    rec = {"fragments": sync.fragments, "after": [], "outer": [], "stats": []}
    for t in range(1, STEPS + 1):
        with torch.no_grad():
            for p, d in zip(params, _move(rank, t)):
                p.add_(d)
            if rank == NAN_RANK and t == NAN_STEP:
                params[0].view(-1)[17] = math.nan
        sync.last_stats = None
        sync.after_optimizer_step()
        rec["after"].append([p.clone() for p in params])
        rec["outer"].append([o.clone() for o in sync.theta_outer])
        rec["stats"].append(vars(sync.last_stats).copy() if sync.last_stats is not None else None)
    sync.finish()
    rec["final"] = [p.clone() for p in params]
    sync.close()
    return rec


@pytest.fixture(scope="module")
def streaming_nan():
    return run_distributed(_streaming_nan, 3, timeout=300)


def _replay(world_size):
    """Float64 replay: per step, the expected θ_local of every rank and θ_outer; the discarded
    round's apply sets every rank's fragment to θ_outer and leaves θ_outer and the momentum alone."""
    theta = [t.double() for t in _theta0()]
    local = [[t.double().clone() for t in _theta0()] for _ in range(world_size)]
    buf: dict[int, torch.Tensor] = {}
    pending: dict[int, tuple[int, list]] = {}
    lr, mu = OUTER["lr"], OUTER["momentum"]
    trace = []

    def apply(p, a):
        _, deltas = pending.pop(p)
        bad = any(not torch.isfinite(d).all() for rank_d in deltas for d in rank_d)
        for j, i in enumerate(FRAGS[p]):
            if not bad:
                g = sum(d[j] for d in deltas) / world_size
                buf[i] = g.clone() if i not in buf else mu * buf[i] + g
                theta[i] = theta[i] - lr * (g + mu * buf[i])
            for r in range(world_size):
                local[r][i] = theta[i].clone() if bad else a * local[r][i] + (1 - a) * theta[i]
        return bad

    for t in range(1, STEPS + 1):
        for r in range(world_size):
            for i, d in enumerate(_move(r, t)):
                local[r][i] = local[r][i] + d.double()
            if r == NAN_RANK and t == NAN_STEP:
                local[r][0].view(-1)[17] = math.nan
        discarded = [apply(p, ALPHA) for p in sorted(pending) if pending[p][0] + TAU == t]
        if t in SENDS:
            p = SENDS[t]
            pending[p] = (t, [[theta[i] - local[r][i] for i in FRAGS[p]] for r in range(world_size)])
        trace.append(([[x.clone() for x in lr_] for lr_ in local], [x.clone() for x in theta], discarded))
    return trace


def test_a_non_finite_round_under_streaming_with_mixing_is_discarded_back_to_theta_outer(streaming_nan):
    """3 ranks, H = 4, F = 2, τ = 1, α = 0.25, published Nesterov outer step; rank 1's fragment 0
    holds a NaN from step 5, so fragment 0's round sent at step 6 is discarded at step 7. There:
    θ_outer of fragment 0 is what it was before the round (bit for bit), every rank's fragment 0
    equals it bit for bit (α does not apply: the bad rank holds no NaN, the others drop their
    local steps), and the other fragment goes on as the reference says."""
    out, ws = streaming_nan, 3
    assert out[0]["fragments"] == FRAGS
    trace = _replay(ws)
    for t in range(1, STEPS + 1):
        local, theta, discarded = trace[t - 1]
        assert discarded == ([True] if t == DISCARDED_AT else [False] if t in (3, 5, 9) else []), t
        for r in range(ws):
            for i in range(len(SHAPES)):
                torch.testing.assert_close(out[r]["after"][t - 1][i].double(), local[r][i], atol=1e-5, rtol=1e-5,
                                           equal_nan=True, msg=lambda m, t=t, r=r, i=i: f"step {t} rank {r} p{i}: {m}")
        for i in range(len(SHAPES)):
            torch.testing.assert_close(out[0]["outer"][t - 1][i].double(), theta[i], atol=1e-5, rtol=1e-5)
    k = DISCARDED_AT - 1  # index of step 7 in the per-step records
    before_round = out[0]["outer"][k - 1][0]  # θ_outer of fragment 0 after step 6 (the round was sent then)
    for r in range(ws):
        assert out[r]["stats"][k]["discarded"] and out[r]["stats"][k]["fragment"] == 0
        assert torch.equal(out[r]["outer"][k][0], before_round), r  # θ_outer untouched by the round
        assert torch.equal(out[r]["after"][k][0], before_round), r  # every rank back on θ_outer, bit for bit
        assert torch.isfinite(torch.cat([p.reshape(-1) for p in out[r]["after"][k]])).all(), r
        for i in range(len(SHAPES)):
            assert torch.equal(out[r]["final"][i], out[0]["final"][i]), (r, i)
            assert torch.isfinite(out[r]["final"][i]).all(), (r, i)
    # before the discard, the bad rank did hold the NaN (the scenario is not vacuous)
    assert not torch.isfinite(out[NAN_RANK]["after"][k - 1][0]).all()


# ------------------------------------------------------------------ buffers (BatchNorm)


def _bn_model():
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 4), torch.nn.BatchNorm1d(4))


def _bn_run(rank, world_size, h, f, tau, steps):
    model = _bn_model()
    sync = DiLoCoSync(_Engine(list(model.named_parameters()), world_size),
                      DiLoCoConfig(inner_steps=h, outer_args={"lr": 1.0}, fragments=f, overlap_steps=tau),
                      buffers=list(model.named_buffers()))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    rec = []
    for t in range(1, steps + 1):
        g = torch.Generator().manual_seed(10 * t + rank)
        x = torch.randn(32, 8, generator=g) * (1.0 + rank) + 0.5 * rank  # rank-dependent statistics
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        before = {n: b.clone() for n, b in model.named_buffers()}
        sync.after_optimizer_step()
        rec.append({"before": before, "after": {n: b.clone() for n, b in model.named_buffers()}})
    sync.close()
    return rec


def _bn_scenarios(rank, world_size):
    return {"plain": _bn_run(rank, world_size, 2, 1, 0, 6), "streaming": _bn_run(rank, world_size, 4, 2, 1, 9)}


@pytest.fixture(scope="module")
def bn_ranks():
    out = run_distributed(_bn_scenarios, 3, timeout=300)
    return {key: [o[key] for o in out] for key in out[0]}


# the steps after which the buffers are averaged: F = 1, H = 2: every outer step (2, 4, 6); F = 2,
# H = 4, τ = 1: when the last fragment's outer step is applied (sent at 4 and 8, applied at 5 and 9)
@pytest.mark.parametrize("scenario, averaged_at", [("plain", {2, 4, 6}), ("streaming", {5, 9})])
def test_buffers_are_the_mean_over_ranks_after_each_outer_step(bn_ranks, scenario, averaged_at):
    out = bn_ranks[scenario]
    ws = len(out)
    names = [n for n in out[0][0]["before"] if out[0][0]["before"][n].is_floating_point()]
    assert sorted(names) == ["1.running_mean", "1.running_var", "4.running_mean", "4.running_var"]
    for k in range(len(out[0])):
        t = k + 1
        for n in names:
            before = [out[r][k]["before"][n] for r in range(ws)]
            assert not torch.equal(before[0], before[1]), (t, n)  # the ranks' statistics differ
            if t in averaged_at:
                mean = sum(b.double() for b in before) / ws
                for r in range(ws):
                    torch.testing.assert_close(out[r][k]["after"][n].double(), mean, atol=1e-6, rtol=1e-6)
                    assert torch.equal(out[r][k]["after"][n], out[0][k]["after"][n]), (t, n, r)
            else:
                for r in range(ws):
                    assert torch.equal(out[r][k]["after"][n], before[r]), (t, n, r)  # left alone
        counts = {int(out[r][k]["after"]["1.num_batches_tracked"]) for r in range(ws)}
        assert counts == {t}  # integer buffers: untouched, equal on every rank anyway
