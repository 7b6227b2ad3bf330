"""Value oracles for the adaptive-ratio controller (AdaptiveRatio): calibration, triggers, agreement.

* **Calibration factor** against a hand computation: the model seconds come from the paper's
  formulas written out in tests/adaptive_oracle.py (no lightning_gc code), the collective the
  engine would run at each ``c`` is picked here by the tie order, then measured/predicted, the
  median (odd and even counts), and the clip to [0.1, 10] at both ends.
* **Triggers**, each in both directions and at its boundary: gain drift up and down, network drift
  up and down (α and β), the minimum spacing between explorations, the warm-up, the settle step
  at which the gain reference is taken.
* **Agreement at 2, 3 and 4 ranks** with rank-dependent inputs (no rank largest in every
  measure): every number of the decision (gains as a ratio of sums over ranks, compression time,
  live exchange time → calibration, step time) is the hand value computed from all ranks' inputs,
  and the decision and the engine's ratio are identical on every rank.

Single-process tests drive the controller with a stand-in engine that has exactly the attributes
the controller reads (world size 4, a pinned network): without a process group ``agree`` is the
identity, and at world size 1 every model cost is 0, which would make the calibration void.
"""

from __future__ import annotations

import math
import types
from collections import deque

import pytest
import torch
from adaptive_oracle import paper_sync_s
from dist_harness import run_distributed

from lightning_gc import AdaptiveRatio
from lightning_gc.adaptive import CandidateResult
from lightning_gc.adaptive.objectives import calibration
from lightning_gc.comm.cost_model import NetworkModel
from lightning_gc.comm.link import LinkObserver
from lightning_gc.compressors import GroupContext

ALPHA, BETA = 1e-4, 8e-9  # pinned network: 100 µs, 1 Gbit/s
NUMELS = (1_000_000,)  # one compressed group of 1 M elements (M = 4 MB)
N = 4
TIE_ORDER = ("allgather", "art_tree", "art_ring")  # the engine's order for equal model costs


def _used(c: float, colls: tuple[str, ...], alpha=ALPHA, beta=BETA, numels=NUMELS, n=N) -> str:
    """The collective the engine runs at ``c``: the cheapest by the paper's formulas, ties by order."""
    order = [k for k in TIE_ORDER if k in colls] or list(colls)
    return min(order, key=lambda k: paper_sync_s(k, alpha, beta, numels, n, c))


class _Group:
    def __init__(self, numel: int, exact: bool) -> None:
        self.numel, self.exact = numel, exact


class _Engine:
    """What AdaptiveRatio reads from a GCEngine, and nothing else (world size N, pinned network)."""

    def __init__(self, exchange: str = "allgather", ratio: float = 0.01, warmup: int = 1) -> None:
        self.link = LinkObserver(NetworkModel(ALPHA, BETA), pinned=True)  # the engine's link observer
        self.network = self.link.state
        self.tracker = types.SimpleNamespace(policy=None)
        self.exchange = types.SimpleNamespace(name=exchange)
        self.plan = types.SimpleNamespace(groups=[_Group(n, False) for n in NUMELS] + [_Group(64, True)])
        self.params = [torch.zeros(3)]
        self.world_size, self.process_group, self.device = N, None, torch.device("cpu")
        self.compressor = types.SimpleNamespace(ratio=ratio)
        self.config = types.SimpleNamespace(warmup_steps=warmup)
        self.gain_ewma: float | None = None
        self.group_observer = None
        self.ratios: list[float] = []

    keeps_network_model = True  # pinned

    def synchronize(self) -> None:
        pass

    def set_group_observer(self, observer) -> None:
        self.group_observer = observer

    def set_ratio(self, c: float) -> None:
        self.ratios.append(c)
        self.compressor.ratio = c


def _trainer(engine, global_zero: bool = False) -> types.SimpleNamespace:
    """A trainer with a GCStrategy whose step session holds ``engine`` (decisions are applied
    through the session: the engine and its participants learn the new ratio)."""
    from lightning_gc import GCStrategy
    from lightning_gc.engine.session import StepSession

    strategy = GCStrategy(compressor="topk")
    strategy._session = StepSession(engine)
    return types.SimpleNamespace(strategy=strategy, is_global_zero=global_zero, loggers=[])


def _ctl(**kw) -> AdaptiveRatio:
    return AdaptiveRatio(**{"pop_size": 12, "n_gen": 6, "log_figures": False, **kw})


def _clip(x: float) -> float:
    return min(max(x, 0.1), 10.0)


# ---------------------------------------------------------------------------------------------- calibration
def _rollback_results(ctl: AdaptiveRatio, colls, factors) -> tuple[list[CandidateResult], list[float]]:
    """Candidates whose measured exchange time is ``factor × the hand-predicted time of the
    collective the engine runs at that c`` (factor None: not sent)."""
    res, ratios = [], []
    for c, f in zip(ctl.config.candidates, factors):
        pred = paper_sync_s(_used(c, colls), ALPHA, BETA, NUMELS, N, c)
        res.append(CandidateResult(c=c, t_comp_s=1e-3 * (1 + c), gain=min(1.0, 0.1 + 5 * c),
                                   t_sync_measured_s=None if f is None else f * pred, steps=2))
        if f is not None:
            ratios.append(f)
    return res, ratios


def _hand_median(xs: list[float]) -> float:
    xs = sorted(xs)
    m = len(xs) // 2
    return xs[m] if len(xs) % 2 else (xs[m - 1] + xs[m]) / 2


@pytest.mark.parametrize("exchange, c_min, factor, factors, want", [
    # 5 candidates (0.1 .. 0.001); auto_sparse runs art_ring at the three largest c, allgather at
    # the two smallest (checked below), so a calibration against one collective's model is off
    ("auto_sparse", 0.001, 3.0, (1.7, 2.3, 0.9, 3.1, 2.0), 2.0),
    ("allgather", 0.001, 3.0, (1.7, 2.3, 0.9, 3.1, 2.0), 2.0),
    # one candidate not sent: left out (4 remain, even count: mean of the two middle values)
    ("auto_sparse", 0.001, 3.0, (1.7, None, 0.9, 3.1, 2.0), (1.7 + 2.0) / 2),
    # 4 candidates (0.1, 0.05, 0.025, 0.01): even count
    ("auto_sparse", 0.01, 2.0, (4.0, 1.5, 2.5, 6.0), (2.5 + 4.0) / 2),
    # clipped at both ends
    ("auto_sparse", 0.001, 3.0, (40.0, 55.0, 12.0, 80.0, 30.0), 10.0),
    ("auto_sparse", 0.001, 3.0, (0.02, 0.05, 0.01, 0.2, 0.03), 0.1),
    # nothing measured: 1.0
    ("auto_sparse", 0.001, 3.0, (None,) * 5, 1.0),
])
def test_rollback_calibration_is_the_clipped_median_of_measured_over_hand_predicted(exchange, c_min, factor,
                                                                                    factors, want):
    ctl = _ctl(mode="rollback", c_min=c_min, factor=factor)
    engine = _Engine(exchange)
    colls = ("allgather", "art_ring", "art_tree") if exchange == "auto_sparse" else (exchange,)
    if exchange == "auto_sparse" and c_min == 0.001:  # the scenario really switches collective with c
        assert [_used(c, colls) for c in ctl.config.candidates] == ["art_ring"] * 3 + ["allgather"] * 2
    results, ratios = _rollback_results(ctl, colls, factors)
    assert want == pytest.approx(_clip(_hand_median(ratios)) if ratios else 1.0)  # the table agrees with its rule
    ctl._decide(_trainer(engine), engine, 7, "warmup", results, measured_live=None, overhead_s=0.0)
    data = ctl.history[-1]["data"]
    assert data["calibration"] == pytest.approx(want, rel=1e-12)
    # every candidate's uncalibrated prediction per collective is the paper's formula
    for cand in data["candidates"]:
        for k in colls:
            assert cand["t_sync_predicted_s"][k] == pytest.approx(
                paper_sync_s(k, ALPHA, BETA, NUMELS, N, cand["c"]), rel=1e-12)
    # the calibrated model the decision uses is the prediction times the factor
    c = ctl.history[-1]["c"]
    coll = ctl.history[-1]["collective"]
    from lightning_gc.adaptive import ObjectiveData

    od = ObjectiveData.from_dict(data)
    assert od.t_sync_s(c, coll) == pytest.approx(want * paper_sync_s(coll, ALPHA, BETA, NUMELS, N, c), rel=1e-12)
    assert engine.ratios == [c]
    # the function itself, on the same candidates
    assert calibration([CandidateResult(**x) for x in data["candidates"]],
                       lambda cc: _used(cc, colls)) == pytest.approx(want, rel=1e-12)


def test_calibration_off_is_one():
    ctl = _ctl(mode="rollback", calibrate=False)
    results, _ = _rollback_results(ctl, ("allgather",), (3.0,) * 5)
    engine = _Engine()
    ctl._decide(_trainer(engine), engine, 7, "warmup", results, measured_live=None, overhead_s=0.0)
    assert ctl.history[-1]["data"]["calibration"] == 1.0
    ctl = _ctl(mode="shadow", calibrate=False)
    results, _ = _rollback_results(ctl, ("allgather",), (None,) * 5)
    engine = _Engine()
    ctl._decide(_trainer(engine), engine, 7, "warmup", results, measured_live=(0.01, 1.0), overhead_s=0.0)
    assert ctl.history[-1]["data"]["calibration"] == 1.0


@pytest.mark.parametrize("exchange, c0, factor, want", [
    ("allgather", 0.01, 2.7, 2.7),
    ("auto_sparse", 0.05, 2.7, 2.7),  # art_ring at c0 = 0.05: its model, not allgather's
    ("auto_sparse", 0.002, 0.45, 0.45),  # allgather at c0 = 0.002
    ("auto_sparse", 0.05, 25.0, 10.0),  # clipped above
    ("auto_sparse", 0.05, 0.04, 0.1),  # clipped below
])
def test_shadow_calibration_is_live_time_over_hand_prediction_at_the_live_ratio(exchange, c0, factor, want):
    colls = ("allgather", "art_ring", "art_tree") if exchange == "auto_sparse" else (exchange,)
    pred = paper_sync_s(_used(c0, colls), ALPHA, BETA, NUMELS, N, c0)
    if exchange == "auto_sparse":
        other = paper_sync_s("allgather" if _used(c0, colls) != "allgather" else "art_ring", ALPHA, BETA, NUMELS, N, c0)
        assert abs(other / pred - 1) > 0.2  # the wrong collective's model would give another factor
    ctl = _ctl(mode="shadow")
    results, _ = _rollback_results(ctl, colls, (None,) * 5)
    engine = _Engine(exchange, ratio=c0)
    ctl._decide(_trainer(engine), engine, 7, "warmup", results, measured_live=(c0, factor * pred), overhead_s=0.0)
    assert ctl.history[-1]["data"]["calibration"] == pytest.approx(want, rel=1e-12)


# ---------------------------------------------------------------------------------------------- triggers
def _decided(ctl: AdaptiveRatio, step: int, gain_ref: float | None = None,
             net_ref: tuple[float, float] = (ALPHA, BETA)) -> None:
    """Put the controller in the state right after a decision at ``step``."""
    ctl.c, ctl.collective = 0.01, "allgather"
    ctl.last_explore_step = ctl.decision_step = step
    ctl.gain_ref, ctl.net_ref = gain_ref, net_ref


def test_warmup_trigger_waits_for_the_longer_warmup():
    ctl = _ctl(warmup_steps=5)
    assert ctl.trigger(_Engine(warmup=1), 4) is None
    assert ctl.trigger(_Engine(warmup=1), 5) == "warmup"
    assert ctl.trigger(_Engine(warmup=8), 7) is None  # the engine's own warm-up is longer
    assert ctl.trigger(_Engine(warmup=8), 8) == "warmup"


# values exact in binary, so "at the threshold" is exactly at it: ref 0.5, threshold 0.25
@pytest.mark.parametrize("g, want", [
    (0.625, "gain"),  # +25 %: at the threshold, up
    (0.375, "gain"),  # -25 %: at the threshold, down
    (0.9, "gain"), (0.1, "gain"),  # well beyond, both ways
    (0.6240234375, None), (0.3759765625, None),  # just inside, both ways
    (0.5, None),
])
def test_gain_trigger_both_directions_at_the_threshold(g, want):
    ctl = _ctl(gain_threshold=0.25, min_interval=10, network_threshold=0.5)
    _decided(ctl, 100, gain_ref=0.5)
    engine = _Engine()
    engine.gain_ewma = g
    assert ctl.trigger(engine, 110) == want


def test_gain_trigger_needs_a_reference():
    ctl = _ctl(gain_threshold=0.25, min_interval=10)
    _decided(ctl, 100, gain_ref=None)
    engine = _Engine()
    engine.gain_ewma = 0.01
    assert ctl.trigger(engine, 200) is None


def _net_engine(alpha: float, beta: float) -> _Engine:
    e = _Engine()
    e.network.model = NetworkModel(alpha, beta)
    return e


# reference (α, β) = (1e-4, 8e-9) scaled by powers of two, threshold 0.5: exactly at it is a move
@pytest.mark.parametrize("scale_a, scale_b, want", [
    (1.5, 1.0, "network"), (0.5, 1.0, "network"),  # α up / down by 50 %
    (1.0, 1.5, "network"), (1.0, 0.5, "network"),  # β up / down by 50 %
    (4.0, 1.0, "network"), (1.0, 0.125, "network"),
    (1.4990234375, 1.0, None), (0.5009765625, 1.0, None),  # just inside, both ways
    (1.0, 1.4990234375, None), (1.0, 0.5009765625, None),
    (1.0, 1.0, None),
])
def test_network_trigger_both_directions_for_alpha_and_beta(scale_a, scale_b, want):
    ctl = _ctl(network_threshold=0.5, gain_threshold=0.25, min_interval=10)
    ref = (0.0001220703125, 7.450580596923828e-09)  # 2**-13 s, 2**-27 s/byte: exact relative changes
    _decided(ctl, 100, gain_ref=0.5, net_ref=ref)
    engine = _net_engine(ref[0] * scale_a, ref[1] * scale_b)
    engine.gain_ewma = 0.5
    assert ctl.trigger(engine, 110) == want


def test_network_trigger_from_zero_reference():
    ctl = _ctl(network_threshold=0.5, min_interval=10)
    _decided(ctl, 100, net_ref=(0.0, BETA))
    assert ctl.trigger(_net_engine(0.0, BETA), 110) is None
    assert ctl.trigger(_net_engine(1e-9, BETA), 110) == "network"


@pytest.mark.parametrize("gain, scale, want", [(0.9, 1.0, "gain"), (0.5, 3.0, "network"), (0.9, 3.0, "gain")])
def test_minimum_spacing_holds_back_both_triggers_until_exactly_min_interval(gain, scale, want):
    ctl = _ctl(gain_threshold=0.25, network_threshold=0.5, min_interval=10)
    _decided(ctl, 100, gain_ref=0.5)
    engine = _net_engine(ALPHA * scale, BETA)
    engine.gain_ewma = gain
    assert [ctl.trigger(engine, s) for s in (101, 105, 109)] == [None] * 3
    assert ctl.trigger(engine, 110) == want  # gain is checked first
    assert ctl.trigger(engine, 111) == want


def test_gain_reference_is_taken_settle_steps_after_the_decision():
    """Driven through the per-step hook: the reference is the engine's EWMA at decision + settle."""
    ctl = _ctl(settle_steps=3, min_interval=1000, gain_threshold=0.25)
    _decided(ctl, 100, gain_ref=None)
    engine = _Engine()
    engine.step_is_dense = lambda: False
    module = types.SimpleNamespace(log=lambda *a, **k: None)
    for step, g in ((101, 0.3), (102, 0.31), (103, 0.32), (104, 0.9)):
        engine.step, engine.gain_ewma = step, g
        ctl._on_step(_trainer(engine), module, engine, None)
        assert ctl.gain_ref == (None if step < 103 else 0.32), step
    assert ctl.trigger(engine, 1100) == "gain"  # 0.9 vs 0.32


# ---------------------------------------------------------------------------------------------- agreement
SHADOW_STEPS = 2
C0 = 0.02


def _p(rank: int, step: int, gid: int, numel: int) -> torch.Tensor:
    """Rank-dependent error-fed gradient: which rank has the largest norm changes with the step."""
    g = torch.Generator().manual_seed(7919 * rank + 31 * step + gid)
    scale = (1.0, 3.0, 0.5, 2.0)[(rank + step) % 4]
    return torch.randn(numel, generator=g) * scale * (1 + torch.arange(numel) % 5)


def _comm(rank: int) -> list[float]:
    """This rank's live exchange seconds on the shadow steps (mean: 300, 100, 500, 200 µs by rank)."""
    return [(3e-4, 1e-4, 5e-4, 2e-4)[rank] + d for d in (-4e-5, 4e-5)]


def _step_times(rank: int) -> list[float]:
    """This rank's recent step times; the median taken is the upper one for an even count."""
    return [[0.2, 0.05, 0.11, 0.3], [0.09, 0.4, 0.07], [0.15, 0.5, 0.01, 0.02, 0.6], [0.25, 0.03]][rank]


def _agreement_rank(rank: int, ws: int) -> dict:
    from lightning_gc.compressors import build_compressor
    from lightning_gc.engine import EngineConfig, GCEngine

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(60, 50), torch.nn.Linear(50, 40))
    engine = GCEngine(build_compressor("topk", ratio=C0),
                      EngineConfig(min_compress_numel=100, warmup_steps=0, network_alpha_s=ALPHA,
                                   network_beta_s_per_byte=BETA), list(model.named_parameters()))
    ctl = _ctl(mode="shadow", shadow_steps=SHADOW_STEPS, c_min=0.01, c_max=0.2, factor=4.0)
    trainer = _trainer(engine, global_zero=rank == 0)
    ctl._explore(trainer, None, engine, 10, "warmup")
    scorer = engine.group_observer
    lossy = [g for g in engine.plan.groups if not g.exact]
    for step in range(SHADOW_STEPS):
        for g in lossy:
            ctx = GroupContext(step=10 + step, rank=rank, world_size=ws, segments=g.numels, group_id=g.gid)
            scorer(g.gid, _p(rank, step, g.gid, g.numel), ctx)
    ctl._shadow_comm = _comm(rank)
    ctl._step_times = deque(_step_times(rank))
    local_t = [t / SHADOW_STEPS for t in scorer.time_s]
    ctl._finish_shadow(trainer, engine, 10 + SHADOW_STEPS)
    out = {"entry": ctl.history[-1], "c": ctl.c, "engine_ratio": float(engine.compressor.ratio),
           "local_t": local_t, "observer": engine.group_observer,
           "groups": [(g.gid, g.numel) for g in lossy]}
    engine.close()
    return out


@pytest.mark.parametrize("ws", [2, 3, pytest.param(4, marks=pytest.mark.extended)])  # 4: 11 s, -m extended
def test_shadow_decision_agreed_across_ranks_equals_hand_values(ws):
    res = run_distributed(_agreement_rank, ws, timeout=240)
    entries = [r["entry"] for r in res]
    for r in res[1:]:  # every number the decision used, and the decision, bit-identical on every rank
        assert r["entry"]["data"] == entries[0]["data"]
        assert r["entry"]["decision"] == entries[0]["decision"]
        assert r["c"] == res[0]["c"] == r["engine_ratio"]
    assert all(r["observer"] is None for r in res)  # the scorer is detached after the shadow steps
    data = entries[0]["data"]
    groups = res[0]["groups"]
    numels = tuple(n for _, n in groups)
    cands = [x["c"] for x in data["candidates"]]
    assert cands == pytest.approx([0.2, 0.05, 0.01])
    # gain: Σ over ranks and steps of the top-k energy over Σ of the energy (a ratio of sums)
    p2 = sum(float(_p(r, s, gid, n).double().pow(2).sum()) for r in range(ws) for s in range(SHADOW_STEPS)
             for gid, n in groups)
    for cand in data["candidates"]:
        sent2 = 0.0
        for r in range(ws):
            for s in range(SHADOW_STEPS):
                for gid, n in groups:
                    p = _p(r, s, gid, n).double()
                    sent2 += float(torch.topk(p.abs(), math.ceil(cand["c"] * n)).values.pow(2).sum())
        assert cand["gain"] == pytest.approx(sent2 / p2, rel=1e-5)
        assert cand["steps"] == SHADOW_STEPS
    # compression time: the mean over ranks of each rank's seconds per step
    i_of = {c: i for i, c in enumerate(cands)}
    for cand in data["candidates"]:
        want = sum(r["local_t"][i_of[cand["c"]]] for r in res) / ws
        assert cand["t_comp_s"] == pytest.approx(want, rel=1e-12)
    # calibration: the live exchange time (mean over steps, then over ranks) over the paper's
    # allgather time at the live ratio C0, for this world size and the plan's compressed groups
    live = sum(sum(_comm(r)) / len(_comm(r)) for r in range(ws)) / ws
    pred = paper_sync_s("allgather", ALPHA, BETA, numels, ws, C0)
    assert data["calibration"] == pytest.approx(_clip(live / pred), rel=1e-12)
    assert 0.1 < data["calibration"] < 10  # not at a clip: the value itself is checked
    # step time: each rank's median (upper for even counts), mean over ranks
    med = [sorted(_step_times(r))[len(_step_times(r)) // 2] for r in range(ws)]
    assert data["step_s"] == pytest.approx(sum(med) / ws, rel=1e-12)
    assert data["world_size"] == ws and tuple(data["numels"]) == numels
    assert (data["alpha_s"], data["beta_s_per_byte"]) == (ALPHA, BETA)
