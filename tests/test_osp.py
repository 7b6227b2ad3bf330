"""OSP two-stage synchronisation: oracles on spawned gloo ranks, plus the pure parts.

The distributed oracle: every rank trains the same MLP on *rank-dependent* data under real DDP
with the OSP hook. Every rank also all-gathers the rank-local batches, so the test can compute —
in plain tensor code, without the engine, the OSP module or the optimizer — the trajectory the
delayed-correction rule defines:

* the replicated parameters ``P`` are always updated with the *global* mean gradient (by a
  hand-written SGD with momentum / Nesterov / weight decay);
* rank ``r`` evaluates its gradient at step ``t`` on ``P_t``, except for the layers deferred at
  step ``t−1``, where it uses its own *locally* updated value (update of ``P_{t−1}`` with its
  local gradient) — LGP's correction arrives only before step ``t``'s optimizer step;
* the split is recomputed independently: importance ``Σ|g_global·P|`` per tensor (routine layers
  known at once, deferred ones one step later), greedy least-important-first under the budget.

Checked: the parameters after every correction equal the reference, are bit-identical on all
ranks, and the split matches; with nothing deferred, the run is bit-identical to DDP without hook.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_distributed
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_gc.compressors import build_compressor
from lightning_gc.engine import EngineConfig, GCEngine
from lightning_gc.sync import (
    DeferredSchedule,
    OSPConfig,
    OSPSync,
    check_optimizer,
    osp_comm_hook,
    rank_split,
    ring_umax,
)

STEPS = 5


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 3))


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(100 * rank + step)
    x = torch.randn(8, 6, generator=g) * (1.0, 2.5, 0.6, 1.7)[(rank + step) % 4]
    y = torch.randint(0, 3, (8,), generator=g)
    return x, y


def _loss(m, x, y):
    return torch.nn.functional.cross_entropy(m(x), y)


def _sgd_ref(p, buf, g, h):
    """Hand-written torch.optim.SGD update for one tensor: returns (new p, new buf)."""
    d = g + h["weight_decay"] * p
    if h["momentum"]:
        buf = d.clone() if buf is None else h["momentum"] * buf + (1 - h["dampening"]) * d
        d = d + h["momentum"] * buf if h["nesterov"] else buf
    return p - h["lr"] * d, buf


def _run_osp(rank: int, ws: int, hyper: dict, fraction: float, max_fraction: float, compressor: str,
             bucket_cap_mb: float, nan_at: int = -1):
    model = _model()
    ddp = DDP(model, bucket_cap_mb=bucket_cap_mb)
    named = [(n, p) for n, p in model.named_parameters()]
    engine = GCEngine(build_compressor(compressor), EngineConfig(min_compress_numel=0, warmup_steps=1), named)
    osp = OSPSync(engine, OSPConfig(deferred_fraction=fraction, max_fraction=max_fraction))
    ddp.register_comm_hook(osp, osp_comm_hook)
    opt = torch.optim.SGD(model.parameters(), **hyper)
    check_optimizer(opt)
    out = {"after_correction": [], "deferred": [], "batches": [], "bad": []}
    for t in range(STEPS):
        x, y = _batch(rank, t)
        xs = [torch.empty_like(x) for _ in range(ws)]
        ys = [torch.empty_like(y) for _ in range(ws)]
        dist.all_gather(xs, x)
        dist.all_gather(ys, y)
        out["batches"].append((xs, ys))
        out["deferred"].append(sorted(named[i][0] for i in osp.deferred))
        opt.zero_grad()
        loss = _loss(ddp, x, y)
        if t == nan_at and rank == 1:
            loss = loss * float("nan")
        loss.backward()
        bad = osp.before_optimizer_step(loss)
        bad = engine.before_optimizer_step() or bad
        out["bad"].append(bad)
        out["after_correction"].append({n: p.detach().clone() for n, p in named})
        if bad:
            osp.skip_step()
            for p in model.parameters():
                p.grad = None
        else:
            osp.prepare_step(opt)
        opt.step()
        engine.after_optimizer_step()
        osp.after_optimizer_step()
    osp.drain()
    out["final"] = {n: p.detach().clone() for n, p in named}
    out["stats"] = osp.last_stats
    osp.close()
    engine.close()
    return out


def _reference(batches, hyper, budget_of_step):
    """The delayed-correction trajectory from all ranks' data (see the module docstring)."""
    model = _model()
    names = [n for n, _ in model.named_parameters()]
    P = {n: p.detach().clone() for n, p in model.named_parameters()}
    B = {n: None for n in names}
    numel = {n: P[n].numel() for n in names}
    importance = {n: math.inf for n in names}
    deferred_prev: set[str] = set()
    prev = None  # (P_{t-1}, B_{t-1}, local grads per rank at t-1)
    deferred = set()
    after_correction, splits = [], []
    ws = len(batches[0][0])
    for t, (xs, ys) in enumerate(batches):
        splits.append(sorted(deferred))
        after_correction.append({n: P[n].clone() for n in names})
        local = []
        for r in range(ws):
            m = _model()
            with torch.no_grad():
                for n, p in m.named_parameters():
                    if n in deferred_prev:  # this rank still holds its locally updated value
                        p.copy_(_sgd_ref(prev[0][n], prev[1][n], prev[2][r][n], hyper)[0])
                    else:
                        p.copy_(P[n])
            m.zero_grad()
            _loss(m, xs[r], ys[r]).backward()
            local.append({n: p.grad.detach().clone() for n, p in m.named_parameters()})
        glob = {n: sum(loc[n] for loc in local) / ws for n in names}
        prev = ({n: P[n].clone() for n in names}, {n: None if B[n] is None else B[n].clone() for n in names}, local)
        for n in names:  # routine layers: importance now
            if n not in deferred:
                importance[n] = float((glob[n].double() * P[n].double()).abs().sum())
        for n in names:
            P[n], B[n] = _sgd_ref(P[n], B[n], glob[n], hyper)
        # next split: least important first, greedy under the budget (independent of rank_split)
        budget = budget_of_step(t + 1)
        order = sorted(range(len(names)), key=lambda i: (importance[names[i]], i))
        nxt, used = set(), 0
        for i in order:
            if used + numel[names[i]] <= budget:
                nxt.add(names[i])
                used += numel[names[i]]
        for n in deferred:  # deferred layers: importance once their global gradient is in
            importance[n] = float((glob[n].double() * prev[0][n].double()).abs().sum())
        deferred_prev, deferred = deferred, nxt
    return after_correction, splits, P


def _recording_hook(state, bucket):
    osp, rec = state
    for p, g in zip(bucket.parameters(), bucket.gradients()):  # the local gradient, before any exchange
        rec["step"][p.data_ptr()] = rec["step"].get(p.data_ptr(), 0) + g.detach().double()
        if p.data_ptr() in rec["poison"]:  # one rank's deferred layer turns non-finite
            g.fill_(float("nan"))
    return osp_comm_hook(osp, bucket)


def _run_conservation(rank: int, ws: int, ics_compressor: str = "dense", nan_at: int = -1, nan_in: str = "loss"):
    """Top-k routine stage with error feedback, pinned split, plain SGD: what was applied must be
    exactly the mean of all local gradients minus the mean of what is still held back (with a
    compressed deferred stage, its residuals are held back too). ``nan_at``: at that step rank 1
    turns non-finite — its loss (``nan_in="loss"``: every gradient, the engine sees it too) or only
    one deferred layer's gradient (``nan_in="deferred"``: only OSP's agreement sees it); the step is
    skipped on every rank and its gradients are fed in nowhere."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 40), torch.nn.Tanh(), torch.nn.Linear(40, 30), torch.nn.Tanh(),
                                torch.nn.Linear(30, 3))
    p0 = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    ddp = DDP(model, bucket_cap_mb=0.0001)
    named = list(model.named_parameters())
    engine = GCEngine(build_compressor("topk", 0.05), EngineConfig(min_compress_numel=0, warmup_steps=0), named)
    osp = OSPSync(engine, OSPConfig(deferred_fraction=0.5, deferred_compressor=ics_compressor,
                                    deferred_ratio=0.1 if ics_compressor == "topk" else None))
    rec: dict = {"step": {}, "poison": set()}
    sums: dict = {}  # Σ over the steps taken of this rank's local gradient, per parameter
    ddp.register_comm_hook((osp, rec), _recording_hook)
    lr = 0.1
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    bad_steps = []
    for t in range(8):
        x, y = _batch(rank, t)
        opt.zero_grad()
        rec["step"] = {}
        nan_here = t == nan_at and rank == 1
        rec["poison"] = {named[min(osp.deferred)][1].data_ptr()} if nan_here and nan_in == "deferred" else set()
        loss = _loss(ddp, x, y)
        if nan_here and nan_in == "loss":
            loss = loss * float("nan")
        loss.backward()
        bad = osp.before_optimizer_step(loss)
        bad = engine.before_optimizer_step() or bad
        if bad:
            bad_steps.append(t)
            osp.skip_step()
            for p in model.parameters():
                p.grad = None
        else:
            osp.prepare_step(opt)
            for k, g in rec["step"].items():
                sums[k] = sums.get(k, 0) + g
        opt.step()
        engine.after_optimizer_step()
        osp.after_optimizer_step()
        if t == 3:  # force the split to move: the least important layers change places
            osp.importance = [-v for v in osp.importance]
    osp.drain()
    held = dict(engine.state_dict()["memory"])
    for n, c in osp.state_dict()["carry"].items():
        held[n] = held.get(n, 0) + c
    out = {}
    for n, p in named:
        g = sums[p.data_ptr()].clone()
        e = held.get(n, torch.zeros_like(p)).double().reshape(p.shape)
        dist.all_reduce(g)
        dist.all_reduce(e)
        out[n] = (p0[n] - p.detach().double(), lr * (g - e) / ws)
    stats = (osp.carried_layers, [sorted(osp.deferred)], engine.totals()["bytes_sent"],
             sum(float(c.norm()) for c in osp.state_dict()["carry"].values()),
             torch.cat([p.detach().reshape(-1) for _, p in named]), bad_steps)
    osp.close()
    engine.close()
    return out, stats


def _run_schedule(rank: int, ws: int, pinned: bool = True):
    """S(Gu) schedule with 3-step rounds: losses, the agreed budget and the splits per step
    (``pinned=False``: no network model in the engine, so OSP probes its own group once)."""
    model = _model()
    ddp = DDP(model, bucket_cap_mb=0.0001)
    named = list(model.named_parameters())
    net = dict(network_alpha_s=1e-4, network_beta_s_per_byte=1e-9) if pinned else {}
    engine = GCEngine(build_compressor("dense"), EngineConfig(**net), named)
    osp = OSPSync(engine, OSPConfig(round_steps=3))
    ddp.register_comm_hook(osp, osp_comm_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, budgets, splits = [], [], []
    for t in range(9):
        x, y = _batch(rank, t % 2)  # two batches again and again: the loss falls
        opt.zero_grad()
        loss = _loss(ddp, x, y)
        loss.backward()
        losses.append(float(loss))
        splits.append(sorted(osp.deferred))
        assert not osp.before_optimizer_step(loss)
        engine.before_optimizer_step()
        osp.prepare_step(opt)
        opt.step()
        engine.after_optimizer_step()
        osp.after_optimizer_step()
        budgets.append((osp.schedule.budget, osp.schedule.umax))
    osp.drain()
    probed = osp.probed_network
    osp.close()
    engine.close()
    return (losses, budgets, splits) if pinned else (probed, budgets, splits)


def _all_scenarios(rank: int, ws: int):
    """Every distributed scenario in one spawn (spawned ranks spend most of their time importing)."""
    out = {case: _run_osp(rank, ws, h, f, mf, "dense", 0.0001) for case, (h, f, mf) in CASES.items()}
    out["ddp"] = _run_ddp(rank, ws, ALL_RS_HYPER)
    out["all_rs"] = _run_all_rs(rank, ws, ALL_RS_HYPER)
    out["nan"] = _run_nan(rank, ws)
    out["topk"] = _run_topk(rank, ws)
    out["conservation"] = _run_conservation(rank, ws)
    out["conservation_ics_topk"] = _run_conservation(rank, ws, "topk")
    for at, where in NAN_CASES:
        out[f"conservation_ics_topk_nan{at}_{where}"] = _run_conservation(rank, ws, "topk", at, where)
    out["schedule"] = _run_schedule(rank, ws)
    out["schedule_probed"] = _run_schedule(rank, ws, False)
    return out


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_all_scenarios, 2)


NAN_CASES = [(2, "loss"), (5, "loss")]  # (step, where) rank 1 turns non-finite

ALL_RS_HYPER = dict(lr=0.1, momentum=0.9, dampening=0.0, nesterov=False, weight_decay=0.0)

CASES = {
    "all_ics_sgd": (dict(lr=0.1, momentum=0.0, dampening=0.0, nesterov=False, weight_decay=0.0), 1.0, 1.0),
    "all_ics_momentum": (dict(lr=0.1, momentum=0.9, dampening=0.0, nesterov=False, weight_decay=0.0), 1.0, 1.0),
    "mixed_nesterov_wd": (dict(lr=0.05, momentum=0.9, dampening=0.0, nesterov=True, weight_decay=0.01), 0.5, 0.8),
    "mixed_dampening": (dict(lr=0.1, momentum=0.8, dampening=0.3, nesterov=False, weight_decay=0.0), 0.3, 0.8),
}


@pytest.mark.parametrize("case", list(CASES))
def test_osp_matches_delayed_correction_reference_and_ranks_agree(runs, case):
    hyper, fraction, max_fraction = CASES[case]
    res = [r[case] for r in runs]
    total = sum(p.numel() for p in _model().parameters())

    def budget(t):
        return 0 if t == 0 else math.floor(fraction * total)

    ref_after, ref_splits, ref_final = _reference(res[0]["batches"], hyper, budget)
    for r in (0, 1):
        assert res[r]["deferred"] == ref_splits, (res[r]["deferred"], ref_splits)
        for t in range(STEPS):
            for n, v in ref_after[t].items():
                torch.testing.assert_close(res[r]["after_correction"][t][n], v, rtol=1e-5, atol=1e-6,
                                           msg=lambda m, r=r, t=t, n=n: f"rank {r} step {t} {n}: {m}")
        for n, v in ref_final.items():
            torch.testing.assert_close(res[r]["final"][n], v, rtol=1e-5, atol=1e-6)
    for t in range(STEPS):  # replicas bit-identical after every correction
        for n, v in res[0]["after_correction"][t].items():
            assert torch.equal(v, res[1]["after_correction"][t][n]), f"ranks differ at step {t} in {n}"
    deferred_steps = [d for d in ref_splits if d]
    assert deferred_steps, "the case never deferred anything"
    if max_fraction < 1.0:  # a real split: some layers routine, some deferred
        names = [n for n, _ in _model().named_parameters()]
        assert any(0 < len(d) < len(names) for d in deferred_steps)
    else:
        assert all(len(d) == 6 for d in deferred_steps)
    # the local-gradient update really differs from the corrected one (the oracle is not vacuous)
    assert res[0]["stats"].correction_norm > 1e-6


def _run_ddp(rank: int, ws: int, hyper: dict):
    model = _model()
    ddp = DDP(copy.deepcopy(model), bucket_cap_mb=0.0001)
    opt = torch.optim.SGD(ddp.parameters(), **hyper)
    params = []
    for t in range(STEPS):
        x, y = _batch(rank, t)
        opt.zero_grad()
        _loss(ddp, x, y).backward()
        opt.step()
        params.append({n: p.detach().clone() for n, p in ddp.module.named_parameters()})
    return params


def _run_all_rs(rank: int, ws: int, hyper: dict):
    out = _run_osp(rank, ws, hyper, 0.0, 0.8, "dense", 0.0001)
    return out["after_correction"][1:] + [out["final"]], out["deferred"]


def test_all_routine_is_bit_identical_to_ddp(runs):
    ddp = [r["ddp"] for r in runs]
    osp = [r["all_rs"] for r in runs]
    for r in (0, 1):
        assert all(d == [] for d in osp[r][1])
        for t in range(STEPS):
            for n, v in ddp[r][t].items():
                assert torch.equal(osp[r][0][t][n], v), f"rank {r} step {t} {n}"


def _run_nan(rank: int, ws: int):
    hyper = dict(lr=0.1, momentum=0.9, dampening=0.0, nesterov=False, weight_decay=0.0)
    return _run_osp(rank, ws, hyper, 1.0, 1.0, "dense", 0.0001, nan_at=2)


def test_nonfinite_ics_data_on_one_rank_is_agreed_and_the_step_skipped(runs):
    res = [r["nan"] for r in runs]
    assert res[0]["bad"] == res[1]["bad"] == [False, False, True, False, False]
    for r in (0, 1):  # the skipped step left every parameter as it was
        for n, v in res[r]["after_correction"][2].items():
            assert torch.equal(res[r]["after_correction"][3][n], v)
        assert all(torch.isfinite(v).all() for v in res[r]["final"].values())
    for n, v in res[0]["final"].items():
        assert torch.equal(v, res[1]["final"][n])


def _run_topk(rank: int, ws: int):
    hyper = dict(lr=0.1, momentum=0.0, dampening=0.0, nesterov=False, weight_decay=0.0)
    out = _run_osp(rank, ws, hyper, 0.5, 0.8, "topk", 25.0)
    return out["final"], out["deferred"]


def test_routine_layers_compose_with_topk_and_ranks_agree(runs):
    res = [r["topk"] for r in runs]
    assert any(d for d in res[0][1]) and res[0][1] == res[1][1]
    for n, v in res[0][0].items():
        assert torch.isfinite(v).all() and torch.equal(v, res[1][0][n])


# ---------------------------------------------------------------------- pure parts
def test_rank_split_least_important_first_within_budget():
    imp = [5.0, 1.0, 3.0, math.nan, 2.0]
    numels = [10, 40, 10, 1, 30]
    assert rank_split(imp, numels, 0) == (frozenset(), -1.0)
    # ascending: 1(40) 4(30) 2(10) 0(10) 3(nan: last)
    assert rank_split(imp, numels, 50) == (frozenset({1, 2}), 3.0)  # 1 fits, 4 does not, 2 fits
    assert rank_split(imp, numels, 80) == (frozenset({1, 4, 2}), 3.0)
    assert rank_split(imp, numels, 91) == (frozenset({0, 1, 2, 3, 4}), math.inf)


def test_ring_umax_is_the_ring_allreduce_time_inverted():
    alpha, beta, n, s, tc = 1e-3, 8e-8, 4, 4, 0.5
    u = ring_umax(tc, alpha, beta, n, s)
    t_ring = 2 * (n - 1) * alpha + 2 * (n - 1) / n * u * s * beta
    assert t_ring == pytest.approx(tc, rel=1e-12)
    assert ring_umax(2 * (n - 1) * alpha, alpha, beta, n, s) == 0.0
    assert ring_umax(tc, alpha, beta, 1, s) == math.inf


def test_schedule_round_one_synchronous_then_grows_with_falling_loss_and_caps():
    s = DeferredSchedule(total_numel=1000, round_steps=4)
    assert [s.budget_for_step(t) for t in range(4)] == [0, 0, 0, 0]
    assert [s.round_ends_after(t) for t in range(8)] == [False, False, False, True] * 2
    assert s.end_round(mean_loss=2.0, recent_loss=1.5, umax_elements=600.0) == math.floor(0.25 * 600)
    assert s.end_round(mean_loss=1.0, recent_loss=0.5, umax_elements=5000.0) == math.floor(0.75 * 800)  # cap
    assert s.end_round(mean_loss=3.0, recent_loss=4.0, umax_elements=600.0) == 0  # loss rose: clipped
    pinned = DeferredSchedule(total_numel=1000, round_steps=4, pinned_fraction=0.5)
    assert [pinned.budget_for_step(t) for t in range(3)] == [0, 500, 500]
    assert not any(pinned.round_ends_after(t) for t in range(10))


@pytest.mark.parametrize("kwargs, match", [
    (dict(deferred_fraction=0.9), "osp_deferred_fraction=0.9 is invalid"),
    (dict(deferred_fraction=-0.1), "osp_deferred_fraction=-0.1 is invalid"),
    (dict(round_steps=1), "osp_round_steps=1"),
    (dict(max_fraction=0.0), "max_fraction=0.0"),
])
def test_osp_config_refuses_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OSPConfig(**kwargs)


def test_optimizers_without_exact_correction_are_refused():
    w = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="cannot train with optimizer Adam.*sync='bsp'"):
        check_optimizer(torch.optim.Adam(w))
    with pytest.raises(ValueError, match="AdamW"):
        check_optimizer(torch.optim.AdamW(w))
    check_optimizer(torch.optim.SGD(w, lr=0.1, momentum=0.9, nesterov=True))


def test_error_memory_moving_into_the_deferred_stage_is_not_lost(runs):
    """Σ applied updates = lr·(Σ_t mean_r g_r,t − mean_r e_r,T): the error memory of layers that
    left the Top-k routine stage reached the optimizer through their deferred allreduce."""
    for r in (0, 1):
        out, (carried, *_) = runs[r]["conservation"]
        assert carried > 0, "the scenario never moved a layer with error memory into the deferred stage"
        for n, (applied, expected) in out.items():
            torch.testing.assert_close(applied, expected, rtol=1e-5, atol=1e-7, msg=lambda m, n=n: f"{n}: {m}")


def test_compressed_deferred_stage_keeps_its_residual_and_sends_fewer_bytes(runs):
    """Deferred stage through Top-k 10 % with error feedback: the same conservation identity holds
    (what Top-k did not send is held back, per rank, and reaches a later deferred send), the bytes
    drop, and the replicas stay identical."""
    for r in (0, 1):
        out, (carried, _, nbytes, held, final, _) = runs[r]["conservation_ics_topk"]
        _, (_, _, dense_bytes, _, _, _) = runs[r]["conservation"]
        assert carried > 0 and held > 0, "nothing was held back: the deferred stage did not compress"
        assert nbytes < 0.8 * dense_bytes, (nbytes, dense_bytes)
        for n, (applied, expected) in out.items():
            torch.testing.assert_close(applied, expected, rtol=1e-5, atol=1e-7, msg=lambda m, n=n: f"{n}: {m}")
    assert torch.equal(runs[0]["conservation_ics_topk"][1][4], runs[1]["conservation_ics_topk"][1][4])


def test_schedule_budget_follows_the_rank_averaged_loss(runs):
    """Round 1 (steps 0-2) defers nothing; after each round the budget is
    floor(clip(1 − loss_i/L, 0, 1)·Umax) with L the first round's mean loss and loss_i the mean of
    the round's second half, both averaged over ranks (computed here from both ranks' losses)."""
    (l0, b0, s0), (l1, b1, s1) = runs[0]["schedule"], runs[1]["schedule"]
    assert b0 == b1 and s0 == s1
    assert s0[:3] == [[], [], []]
    mean = [(a + b) / 2 for a, b in zip(l0, l1)]
    first = sum(mean[0:3]) / 3
    total = sum(p.numel() for p in _model().parameters())
    for end in (2, 5, 8):  # last step of each round
        budget, umax = b0[end]
        assert 0 < umax <= 0.8 * total
        recent = sum(mean[end - 1:end + 1]) / 2  # second half of a 3-step round: its last 2 steps
        assert budget == math.floor(min(max(1 - recent / first, 0.0), 1.0) * umax)
    assert b0[5][0] > 0 and any(s0[6:])  # the falling loss made the schedule defer something


def test_schedule_without_a_network_model_probes_once_and_ranks_agree(runs):
    (net0, b0, s0), (net1, b1, s1) = runs[0]["schedule_probed"], runs[1]["schedule_probed"]
    assert net0 is not None and net0 == net1  # the probe's model is agreed across ranks
    assert b0 == b1 and s0 == s1 and all(u is not None for _, u in b0[2:])


def test_osp_with_an_omgs_plan_is_refused_with_the_fix():
    from lightning_gc import GCStrategy

    with pytest.raises(ValueError, match=r"sync='osp' with plan='omgs'.*Use one of them"):
        GCStrategy(compressor="topk", plan="omgs", sync="osp")


@pytest.mark.parametrize("at, where", NAN_CASES)
def test_compressed_deferred_stage_keeps_every_residual_across_a_skipped_step(runs, at, where):
    """A non-finite gradient on rank 1 at step ``at`` with the Top-k deferred stage and error
    feedback: the step is skipped on every rank, and conservation still holds over the steps taken
    — Σ applied = lr·(Σ_{t taken} mean_r g_r,t − mean_r held_r), held = routine error memory +
    deferred residuals waiting. Before the fix, the skip replaced a deferred layer's newest residual
    (arrived with the previous step's send) by the older one it had put back, and lost it."""
    key = f"conservation_ics_topk_nan{at}_{where}"
    finals = []
    for r in range(len(runs)):
        out, (carried, _, _, held, final, bad_steps) = runs[r][key]
        assert bad_steps == [at], bad_steps  # agreed: skipped on every rank, at that step only
        assert held > 0
        finals.append(final)
        for n, (applied, expected) in out.items():
            torch.testing.assert_close(applied, expected, rtol=1e-5, atol=1e-7,
                                       msg=lambda m, n=n, r=r: f"rank {r} {n}: {m}")
    assert all(torch.isfinite(f).all() for f in finals)
    for f in finals[1:]:
        assert torch.equal(f, finals[0])
