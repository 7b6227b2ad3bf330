"""The engine's per-step overhead (StepStats.overhead_s) and its way into the bench's report.

Oracle: known durations. Every clock the engine reads (its OwnClock regions, the exchange Timer, the
agreements' timers) is replaced by a fake clock per thread that moves only when a test says so, so
each injected duration must land in exactly one bucket: codec (compress), gradient collectives
(comm), or the engine's own work (overhead). No wall-clock thresholds.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from dist_harness import run_distributed
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_gc.bench import report
from lightning_gc.bench.methods import MethodSpec
from lightning_gc.bench.runner import aggregate
from lightning_gc.engine.stats import OwnClock, StepStats, Totals, step_overhead


class ThreadClock:
    """A fake clock per thread: ``clock()`` reads the calling thread's time, ``advance`` moves it."""

    def __init__(self) -> None:
        self._local = threading.local()

    def __call__(self) -> float:
        return getattr(self._local, "t", 0.0)

    def advance(self, dt: float) -> None:
        self._local.t = self() + dt


# ----------------------------------------------------------------------------- the clock alone


def test_own_clock_counts_nested_regions_once_and_threads_apart():
    clock = ThreadClock()
    own = OwnClock(clock)
    with own.region():
        clock.advance(2.0)
        with own.region():  # a synchronous runner's job inside the hook: counted by the outer region
            clock.advance(3.0)
        clock.advance(1.0)
    assert own.take() == 6.0
    assert own.take() == 0.0  # taken

    def other() -> None:
        with own.region():
            clock.advance(7.0)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    clock.advance(100.0)  # outside any region: not the engine's
    assert own.take() == 7.0


def test_take_inside_a_region_counts_it_up_to_now_and_the_rest_goes_to_the_next_step():
    clock = ThreadClock()
    own = OwnClock(clock)
    with own.region():
        clock.advance(4.0)
        assert own.take() == 4.0  # the step's close, inside the runner's job
        clock.advance(0.5)  # the job's tail after the close
    assert own.take() == 0.5
    wrapped = own.wrap(lambda x: clock.advance(x) or "done")  # a backend callback
    assert wrapped(1.5) == "done" and own.take() == 1.5


def test_step_overhead_subtracts_blocking_collectives_codec_and_probes_not_async_waits():
    # own 10: 3 codec, 4 in collectives of which 2.5 were an async bucket's issue-to-callback time
    # (no engine code waited then), 1 probe -> 10 - (4 - 2.5) - 3 - 1 = 4.5
    assert step_overhead(10.0, 4.0, 2.5, 3.0, 1.0) == pytest.approx(4.5)
    assert step_overhead(1.0, 0.0, 0.0, 0.0, 0.0) == 1.0


def test_totals_sum_the_overhead_fields():
    t = Totals()
    t.add(StepStats(engine_own_s=2.0, control_comm_s=0.25, overhead_s=1.0))
    t.add(StepStats(engine_own_s=3.0, control_comm_s=0.5, overhead_s=1.5))
    assert (t.engine_own_s, t.control_comm_s, t.overhead_s) == (5.0, 0.75, 2.5)


# ----------------------------------------------------------------------------- in the engine, 2 ranks

CODEC, WIRE, UNTIMED, OBSERVER = 0.003, 0.050, 0.0007, 0.0002  # fake seconds per group and step


class _Timed:
    """Wraps an exchange: CODEC in the Timer's compress, WIRE in its comm, UNTIMED outside its timer."""

    carries_report = carries_exact = False  # read from the class by the engine

    def __init__(self, inner, clock: ThreadClock) -> None:
        self.inner, self.clock = inner, clock

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def run(self, p, ctx, timer):
        timer.run("compress", lambda: self.clock.advance(CODEC))
        out = self.inner.run(p, ctx, timer)
        timer.run("comm", lambda: self.clock.advance(WIRE))
        self.clock.advance(UNTIMED)
        return out


def _engine_steps(rank: int, ws: int, overlap: bool) -> dict:
    from lightning_gc.compressors import build_compressor
    from lightning_gc.engine import EngineConfig, GCEngine, gc_comm_hook
    from lightning_gc.engine.slots import MethodSlot

    clock = ThreadClock()
    time.perf_counter = clock  # every timer of this rank process reads the fake clock
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    ddp = DDP(model, bucket_cap_mb=0.001)
    engine = GCEngine(build_compressor("topk", ratio=0.25),
                      EngineConfig(warmup_steps=1, min_compress_numel=0, overlap=overlap, plan="layer"),
                      list(model.named_parameters()))
    engine.default_slot = MethodSlot(None, engine.compressor, _Timed(engine.exchange, clock), engine.error_feedback)
    engine.group_observer = lambda gid, p, ctx: clock.advance(OBSERVER)  # the engine's own work
    ddp.register_comm_hook(engine, gc_comm_hook)
    steps = []
    for _step in range(3):
        x = torch.randn(8, 16) + rank
        ddp(x).pow(2).sum().backward()
        steps.append(engine.last_step.as_dict())
        model.zero_grad()
    groups = sum(1 for g in engine.plan.groups if not g.exact)
    totals = engine.totals()
    engine.close()
    return {"steps": steps, "groups": groups, "totals": totals}


@pytest.mark.parametrize("overlap", [True, False])
def test_injected_durations_land_in_their_buckets(overlap):
    for res in run_distributed(_engine_steps, 2, overlap, timeout=120):
        g = res["groups"]
        assert g >= 2
        dense, *compressed = res["steps"]
        assert dense["dense"] and dense["overhead_s"] == 0.0 and dense["engine_own_s"] == 0.0
        for s in compressed:
            assert not s["dense"]
            assert s["compress_time_s"] == pytest.approx(g * CODEC, rel=1e-9)
            assert s["comm_time_s"] == pytest.approx(g * WIRE, rel=1e-9)  # the agreements took no fake time
            assert s["engine_own_s"] == pytest.approx(g * (CODEC + WIRE + UNTIMED + OBSERVER), rel=1e-9)
            assert s["overhead_s"] == pytest.approx(g * (UNTIMED + OBSERVER), rel=1e-9)
        assert res["totals"]["overhead_s"] == pytest.approx(2 * g * (UNTIMED + OBSERVER), rel=1e-9)


# ----------------------------------------------------------------------------- in the bench's report


def _rank(g: int, overhead_total: float, measured: int) -> dict:
    return {
        "global_rank": g, "node_rank": g, "local_rank": 0, "stopped": None,
        "step_times": [1.0] * 3 + [0.5] * measured, "compute_times": [0.2, 0.2],
        "engine_window": {"bytes_sent": 100.0 * measured, "overhead_s": overhead_total,
                          "engine_own_s": 2 * overhead_total, "control_comm_s": 0.01 * measured},
        "num_params": 10, "evals": [], "metric": "loss", "mode": "min", "tx_window": None,
    }


def test_aggregate_reports_overhead_per_step_and_as_a_share_of_the_step():
    r = {"steps": 7, "warmup": 3, "procs_per_host": 1, "ranks": 2, "hosts": 2, "schedule": None}
    spec = MethodSpec("topk", {"ratio": 0.01}, gc=True)
    # mean over ranks of the window's total / measured steps: (0.04 + 0.08) / 2 / 4 = 0.015 s a step
    res = aggregate(spec, [_rank(0, 0.04, 4), _rank(1, 0.08, 4)], r, count_wire=False, target=None)
    assert res["overhead_s"] == pytest.approx(0.015)
    assert res["overhead_share"] == pytest.approx(0.015 / 0.5)
    assert res["engine_own_s"] == pytest.approx(0.03)
    assert res["control_comm_s"] == pytest.approx(0.01)
    doc = {"config": {"preset": "mlp", "ranks": 2, "hosts": 2, "procs_per_host": 1, "steps": 7, "warmup": 3,
                      "compute_steps": 2, "metric": "loss", "mode": "min"},
           "emulated": False, "network": {"mode": "loopback"}, "results": [res]}
    md = report.markdown(doc)
    assert "overhead (ms/step, % of step)" in md
    assert "15.0 ms (3.0%)" in md


def test_torch_baselines_have_no_engine_overhead_column_value():
    r = {"steps": 7, "warmup": 3, "procs_per_host": 1, "ranks": 2, "hosts": 2, "schedule": None}
    spec = MethodSpec("ddp", {}, gc=False)
    ranks = [_rank(0, 0.0, 4), _rank(1, 0.0, 4)]
    for rk in ranks:
        rk.update(engine_window=None, powersgd_numel_window=None)
    res = aggregate(spec, ranks, r, count_wire=False, target=None)
    assert res.get("overhead_s") is None
