"""The link observer (lightning_gc/comm/link.py): one schedule for every client of "what is the link now".

Oracles:
* the schedule is pure: hand-computed probe steps for the start, periodic and drift/patience rules,
  for two clients with different intervals, and the rules as they were before the observer
  (:func:`_old_policy`, written out here) over random inputs;
* the clients keep their steps: the engine's tracker against :func:`_old_policy`, ``AdaptiveRatio``
  against its old rule (:func:`_old_adaptive`), OSP's single probe;
* on 3 gloo ranks with rank-dependent measurements agreed by MAX, every rank probes at the
  hand-computed steps and reads the same model; a real engine (``artopk_auto``) on 2 ranks probes at
  the steps the old rules give.
"""

from __future__ import annotations

import math
import random
import types

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_distributed

from lightning_gc.comm.cost_model import NetworkModel
from lightning_gc.comm.link import (
    PROBE_MAX_BYTES,
    PROBE_TARGET_S,
    LinkObserver,
    LinkSchedule,
    check_link,
    next_probe_bytes,
    probe_sized,
    probe_start_bytes,
    sized_measure,
    solve_beta,
)
from lightning_gc.comm.probe import ProbeConfig
from lightning_gc.engine.config import EngineConfig
from lightning_gc.engine.network import NetworkTracker


# --------------------------------------------------------------------------------------------
# oracles: the rules before the observer, written out
# --------------------------------------------------------------------------------------------
def _old_policy(every: int, drift: float, patience: int, calls, at_start: bool = True) -> list[int]:
    """The engine's re-probe rule before the observer (``ProbePolicy.update`` as it read), over
    ``calls`` = [(step, (measured, predicted) or None)]: the steps it probed at."""
    last, count, out = None, 0, []
    for step, meas in calls:
        if meas is not None:
            m, p = meas
            rel = (0.0 if m == 0 else math.inf) if p == 0 else abs(m - p) / p
            count = count + 1 if rel > drift else 0
        probe = False
        if last is None and at_start:
            probe = True
        elif every:
            probe = step - (last if last is not None else 0) >= every
        if count >= patience:
            probe = True
        if probe:
            last, count = step, 0
            out.append(step)
    return out


def _old_adaptive(every: int, calls) -> list[int]:
    """AdaptiveRatio's own probe before the observer: at a call (step, refresh) it probed when
    ``refresh``, when it had no model, or ``every`` steps after its last probe."""
    last, out = None, []
    for step, refresh in calls:
        if refresh or last is None or (every > 0 and step - last >= every):
            last = step
            out.append(step)
    return out


def _drive(schedule: LinkSchedule, steps, meas=None) -> list[int]:
    out = []
    for s in steps:
        if meas is not None and meas.get(s) is not None:
            schedule.observe(*meas[s])
        if schedule.due(s):
            schedule.probed(s)
            out.append(s)
    return out


class _Counting:
    """A measurement that records when it ran and returns a model that names the step."""

    def __init__(self) -> None:
        self.calls: list[int] = []
        self.step = 0

    def __call__(self, group, config, device) -> NetworkModel:
        self.calls.append(self.step)
        return NetworkModel(1e-4 * (1 + len(self.calls)), 1e-9)


# --------------------------------------------------------------------------------------------
# the schedule, pure
# --------------------------------------------------------------------------------------------
def test_schedule_start_and_every_at_hand_computed_steps():
    s = LinkSchedule()
    s.subscribe("a", 4)
    assert _drive(s, range(13)) == [0, 4, 8, 12]
    late = LinkSchedule()
    late.subscribe("a", 4, at_start=False)  # counts from step 0
    assert _drive(late, range(13)) == [4, 8, 12]
    once = LinkSchedule()
    once.subscribe("a", 0)
    assert _drive(once, range(13)) == [0]
    assert _drive(LinkSchedule(), range(13)) == []  # no client: never due


def test_schedule_drift_needs_patience_consecutive_steps():
    s = LinkSchedule(drift_threshold=0.5, drift_patience=2)
    s.subscribe("a", 0)
    off, on = (1.0, 1.0), (1.6, 1.0)  # 0 and 0.6 relative error
    meas = {1: on, 2: on, 3: on, 4: off, 5: on, 6: on, 7: (1.5, 1.0)}  # 0.5 is not above the threshold
    # start at 0; drift at 1, 2 -> probe at 2 (counter restarts); 3 drifts, 4 resets; 5, 6 -> 6
    assert _drive(s, range(9), meas) == [0, 2, 6]


def test_two_clients_probe_once_when_the_earlier_is_due():
    s = LinkSchedule()
    s.subscribe("engine", 25)
    s.subscribe("adaptive", 10)
    assert s.every == 10
    got = _drive(s, range(36))
    assert got == [0, 10, 20, 30]  # one clock: the 25-step client reads the 10-step probes
    s.unsubscribe("adaptive")
    assert _drive(s, range(36, 60)) == [55]  # 25 after the last probe (30), whoever asked for it


@pytest.mark.parametrize("seed", range(6))
def test_one_client_schedule_equals_the_old_rule(seed):
    rng = random.Random(seed)
    every, patience, drift = rng.choice([0, 1, 3, 7]), rng.choice([1, 2, 3]), rng.choice([0.25, 0.5])
    at_start = rng.random() < 0.7
    calls = []
    for step in sorted(rng.sample(range(200), 80)):
        meas = None if rng.random() < 0.3 else (rng.choice([0.0, 1.0, 1.2, 1.6, 3.0]), rng.choice([0.0, 1.0]))
        calls.append((step, meas))
    s = LinkSchedule(drift, patience)
    s.subscribe("engine", every, at_start=at_start)
    assert _drive(s, [c[0] for c in calls], dict(calls)) == _old_policy(every, drift, patience, calls, at_start)


def test_schedule_refuses_bad_intervals_with_the_fix():
    with pytest.raises(ValueError, match=r"refresh_every=-1 must be an integer >= 0"):
        LinkSchedule().subscribe("a", -1)
    with pytest.raises(ValueError, match=r"drift_patience=0"):
        LinkSchedule(drift_patience=0)
    with pytest.raises(ValueError, match=r"pinned=True\) needs the pinned model"):
        LinkObserver(pinned=True)


def test_schedule_state_round_trips():
    s = LinkSchedule(0.5, 3)
    s.subscribe("a", 5)
    _drive(s, range(7), {6: (2.0, 1.0)})
    t = LinkSchedule(0.5, 3)
    t.subscribe("a", 5)
    t.load_state_dict(s.state_dict())
    assert (t.last_probe_step, t.consecutive_drift) == (5, 1)
    assert _drive(t, range(7, 12)) == _drive(s, range(7, 12)) == [10]


# --------------------------------------------------------------------------------------------
# the observer
# --------------------------------------------------------------------------------------------
def test_observer_serves_two_clients_with_one_probe():
    measure = _Counting()
    link = LinkObserver(world_size=2, publish=False, measure=measure)
    link.subscribe("a", 3)
    link.subscribe("b", 7)
    reads = {"a": [], "b": []}
    for step in range(10):
        measure.step = step
        for client in ("a", "b"):  # both ask at every step; the second finds nothing due
            link.maybe_refresh(step, None, None)
            reads[client].append(link.model)
    assert measure.calls == [0, 3, 6, 9]
    assert reads["a"] == reads["b"]  # both read the same agreed result
    assert link.probes == 4 and link.state.model is None and link.state.probes == 0  # not published


def test_observer_pinned_or_alone_never_probes():
    measure = _Counting()
    pinned = LinkObserver(NetworkModel(1e-4, 8e-9), pinned=True, measure=measure)
    alone = LinkObserver(world_size=1, measure=measure)
    for link in (pinned, alone):
        link.subscribe("a", 1)
        for step in range(5):
            assert link.maybe_refresh(step, None, None) == 0.0
    assert measure.calls == [] and pinned.model == NetworkModel(1e-4, 8e-9) and alone.model is None


def test_engine_tracker_probes_at_the_old_rules_steps():
    cfg = EngineConfig(probe_every=5, probe_drift=0.5, probe_patience=2)
    tracker = NetworkTracker(cfg, needs_network=True, world_size=2)
    measure = _Counting()
    tracker.observer.measure = measure
    rng = random.Random(3)
    calls = []
    for step in range(1, 40):  # compressed steps after a 1-step warm-up
        meas = None if step % 7 == 0 else (rng.choice([1.0, 1.7]), 1.0)
        calls.append((step, meas))
    for step, meas in calls:
        tracker.last_measurement = meas  # the closing report of the step before, read at this step's open
        measure.step = step
        tracker.maybe_probe(step, None, torch.device("cpu"))
    want = _old_policy(5, 0.5, 2, calls)
    assert measure.calls == want and len(want) > 39 // 5  # the drift rule added probes
    assert tracker.state.probes == len(want) and tracker.state.model is not None  # published
    tracker.policy = None  # a caller took re-probing over (GCEngine.adopt_network)
    assert tracker.maybe_probe(1000, None, torch.device("cpu")) == 0.0 and tracker.policy is None


def test_engine_tracker_without_a_model_choosing_exchange_does_not_probe():
    tracker = NetworkTracker(EngineConfig(probe_every=1), needs_network=False, world_size=2)
    tracker.observer.measure = _Counting()
    assert tracker.policy is None and all(tracker.maybe_probe(s, None, torch.device("cpu")) == 0 for s in range(5))


def _adaptive_engine(measure, keeps: bool = False):
    link = LinkObserver(world_size=2, publish=False, measure=measure)
    return types.SimpleNamespace(link=link, network=link.state, keeps_network_model=keeps,
                                 process_group=None, device=torch.device("cpu"), synchronize=lambda: None,
                                 topology=types.SimpleNamespace(kind="flat"))


def test_adaptive_ratio_probes_at_its_old_steps():
    from lightning_gc import AdaptiveRatio
    from lightning_gc.adaptive.callback import LINK_CLIENT

    ctl = AdaptiveRatio(probe_every=5)
    measure = _Counting()
    engine = _adaptive_engine(measure)
    engine.link.subscribe(LINK_CLIENT, ctl.config.probe_every)  # what on_fit_start does without an engine model
    calls = [(23, True), (30, False), (32, False), (35, False), (36, True), (40, False), (41, False), (47, False)]
    for step, refresh in calls:
        measure.step = step
        net = ctl._network_model(engine, step, refresh)
        assert net is not None and net == engine.link.model
    assert measure.calls == _old_adaptive(5, calls) == [23, 30, 35, 36, 41, 47]


@pytest.mark.parametrize("keeps", [False, True])
def test_adaptive_ratio_subscribes_its_interval_only_when_the_engine_keeps_no_model(monkeypatch, keeps):
    from lightning_gc import AdaptiveRatio
    from lightning_gc.adaptive.callback import LINK_CLIENT

    engine = _adaptive_engine(_Counting(), keeps=keeps)
    engine.exchange = types.SimpleNamespace(name="allgather")
    engine.raise_warmup_steps = lambda steps: None
    monkeypatch.setattr(AdaptiveRatio, "_engine", staticmethod(lambda trainer: engine))
    AdaptiveRatio(probe_every=7).on_fit_start(None, None)
    assert engine.link.schedule.clients == ({} if keeps else {LINK_CLIENT: (7, True)})


def test_adaptive_ratio_reads_the_engines_model_and_shares_probes_with_osp():
    from lightning_gc import AdaptiveRatio
    from lightning_gc.adaptive.callback import LINK_CLIENT
    from lightning_gc.sync.osp import OSPSync

    measure = _Counting()
    kept = _adaptive_engine(measure, keeps=True)
    kept.link.state.model = NetworkModel(1e-4, 8e-9)  # the engine's own (probed or pinned)
    assert AdaptiveRatio()._network_model(kept, 100, True) == NetworkModel(1e-4, 8e-9) and measure.calls == []

    engine = _adaptive_engine(measure)
    engine.link.subscribe(LINK_CLIENT, 5)
    engine.step = 10
    osp = types.SimpleNamespace(engine=engine, world_size=2, group=None, control=None, _comm_device=lambda: "cpu")
    measure.step = 10
    first = OSPSync._network_model(osp)  # OSP finds no model: one probe, for every client
    assert OSPSync._network_model(osp) is first and measure.calls == [10]  # OSP probes once
    ctl = AdaptiveRatio(probe_every=5)
    for step in (12, 14):
        assert ctl._network_model(engine, step, False) is first  # within 5 steps of OSP's probe: read it
    measure.step = 15
    assert ctl._network_model(engine, 15, False) is not first and measure.calls == [10, 15]
    assert OSPSync._network_model(osp) is engine.link.model  # OSP reads the newer one


# --------------------------------------------------------------------------------------------
# β from an exposed step time
# --------------------------------------------------------------------------------------------
def test_solve_beta_inverts_a_linear_step():
    # step = 0.05 + 3*alpha + 1e6*beta, alpha = 1e-4 - 64*beta: measured 0.09 s -> analytic beta
    def step(net: NetworkModel) -> float:
        return 0.05 + 3 * net.alpha_s + 1e6 * net.beta_s_per_byte

    want = (0.09 - 0.05 - 3e-4) / (1e6 - 3 * 64)
    got = solve_beta(step, 0.09, 1e-4, 64)
    assert got == pytest.approx(want, rel=1e-9)
    assert solve_beta(step, 0.04, 1e-4, 64) is None  # shorter than compute: no β
    assert solve_beta(step, 1e9, 1e-4, 0) == pytest.approx(1e-3)  # slower than the range: its top


def test_solve_beta_is_the_inversion_auto_uses():
    from lightning_gc.auto.model import MethodCost, Workload, beta_from_dense_step, predict

    ddp = MethodCost("ddp", "bucket", 0.0)
    wl = Workload(0.01, (0.01, 0.01), (100_000, 50_000), 0.003, 0.0)
    for measured in (0.05, 0.2, 1.5):
        beta = beta_from_dense_step(measured, wl, ddp, 2e-4, 4, 64)
        # the oracle: the model's own DDP step at the solved link is the measured step
        net = NetworkModel(max(2e-4 - 64 * beta, 0.0), beta)
        assert predict(ddp, wl, net, 4).step_s == pytest.approx(measured, rel=1e-6)


# --------------------------------------------------------------------------------------------
# distributed: every rank probes at the same steps, on agreed measurements
# --------------------------------------------------------------------------------------------
def _agreed_schedule(rank: int, ws: int) -> dict:
    cfg = ProbeConfig(sizes_bytes=(64, 4096), warmup=0, repeats=1)
    link = LinkObserver(probe=cfg, drift_threshold=0.5, drift_patience=2, world_size=ws)
    link.subscribe("engine", 4)
    probed, models = [], []
    for step in range(12):
        local = 1.0 + 0.1 * rank  # a rank-dependent measurement: within 50 % of 1.0 on every rank...
        if step in (5, 6) and rank == ws - 1:
            local = 2.0  # ... except the last rank's at steps 5 and 6
        t = torch.tensor([local], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # agreed before the schedule sees it
        link.observe(float(t[0]), 1.0)
        if link.maybe_refresh(step, None, "cpu") > 0:
            probed.append(step)
            models.append((link.model.alpha_s, link.model.beta_s_per_byte))
    return {"probed": probed, "models": models}


@pytest.mark.parametrize("ws", [3])
def test_ranks_probe_at_the_same_steps_on_agreed_measurements(ws):
    out = run_distributed(_agreed_schedule, ws)
    # start 0, every 4 -> 4; drift seen (agreed) at 5 and 6 -> 6; 4 after it -> 10
    assert all(o["probed"] == [0, 4, 6, 10] for o in out), [o["probed"] for o in out]
    assert all(o["models"] == out[0]["models"] for o in out)


def _engine_probe_steps(rank: int, ws: int, cfg: dict) -> list[int]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightning_gc.compressors import build_compressor
    from lightning_gc.engine import GCEngine, gc_comm_hook

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.ReLU(), torch.nn.Linear(48, 4))
    ddp = DDP(model, bucket_cap_mb=0.004)
    config = EngineConfig(warmup_steps=1, min_compress_numel=100, **cfg)
    engine = GCEngine(build_compressor("artopk_auto", ratio=0.1), config, list(model.named_parameters()))
    ddp.register_comm_hook(engine, gc_comm_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    steps = []
    gen = torch.Generator().manual_seed(rank)
    for step in range(9):
        opt.zero_grad()
        x = torch.randn(8, 16, generator=gen)
        ddp(x).pow(2).mean().backward()
        engine.before_optimizer_step()
        opt.step()
        engine.after_optimizer_step()
        if engine.last_step.probe_s > 0:
            steps.append(step)
    engine.close()
    return steps


@pytest.mark.parametrize("cfg, want", [
    # every 3 steps, drift never: start at the first compressed step (1), then 4, 7
    (dict(probe_every=3, probe_drift=1e9, probe_patience=1), [1, 4, 7]),
    # no period, every step drifts (threshold ~0), patience 2: 1 (start), then every second step
    (dict(probe_every=0, probe_drift=1e-12, probe_patience=2), [1, 3, 5, 7]),
])
def test_engine_probes_at_the_old_rules_steps(cfg, want):
    calls = [(s, None if s == 1 else (2.0, 1.0)) for s in range(1, 9)]  # every closing report drifts
    every_drifts = cfg["probe_drift"] < 1
    oracle = _old_policy(cfg["probe_every"], cfg["probe_drift"], cfg["probe_patience"],
                         calls if every_drifts else [(s, None) for s, _ in calls])
    assert oracle == want
    out = run_distributed(_engine_probe_steps, 2, cfg)
    assert out[0] == out[1] == want, out


def _sized(rank: int, ws: int, model_bytes: int) -> dict:
    got = probe_sized(None, "cpu", model_bytes)
    check = check_link(None, "cpu", got.probe_bytes)
    link = LinkObserver(world_size=ws, measure=sized_measure(model_bytes))
    link.subscribe("auto", 0)
    link.maybe_refresh(0, None, "cpu")
    return {"probe": got, "check": check, "link": link.model, "start": probe_start_bytes(model_bytes)}


def test_sized_probe_and_check_agree_across_ranks():
    out = run_distributed(_sized, 2, 400_000)
    p = out[0]["probe"]
    assert all(o["probe"] == p and o["check"] == out[0]["check"] and o["link"] == out[0]["link"] for o in out)
    assert out[0]["start"] == 200_000  # half the gradient, above the 128 KiB floor, below 256 KiB
    # the last size is where next_probe_bytes stopped: at the cap or bandwidth-bound
    assert next_probe_bytes(p.probe_bytes, p.probe_time_s, PROBE_MAX_BYTES) is None
    assert p.probe_bytes == PROBE_MAX_BYTES or p.probe_time_s >= PROBE_TARGET_S / 4
    assert 200_000 <= p.probe_bytes <= PROBE_MAX_BYTES
    assert p.network.alpha_s >= 0 and p.network.beta_s_per_byte >= 0 and out[0]["check"][0] > 0
