"""Unit tests (single process) for the ordered worker, the planner registry and memory remapping."""

from __future__ import annotations

import threading

import pytest
import torch

from lightning_gc.comm.worker import InlineRunner, OrderedWorker
from lightning_gc.engine.memory import ErrorMemory
from lightning_gc.plans import (
    ParamFacts,
    PlanRequest,
    available_planners,
    build_plan,
    get_planner,
    register_planner,
)


def test_worker_runs_jobs_in_submission_order_on_one_other_thread():
    worker = OrderedWorker()
    seen, threads = [], set()
    gate = threading.Event()

    def job(i):
        if i == 0:
            gate.wait(5)  # the first job blocks: later ones must queue behind it, not overtake
        seen.append(i)
        threads.add(threading.get_ident())

    for i in range(50):
        worker.submit(lambda i=i: job(i))
    assert seen == []  # submit returned without running anything on this thread
    gate.set()
    assert worker.drain(timeout=10)
    assert seen == list(range(50))
    assert len(threads) == 1 and threading.get_ident() not in threads
    assert worker.close()
    with pytest.raises(RuntimeError, match="closed"):
        worker.submit(lambda: None)


def test_worker_survives_a_failing_job_and_inline_runner_runs_at_once():
    worker = OrderedWorker()
    out = []
    worker.submit(lambda: 1 / 0)
    worker.submit(lambda: out.append("after"))
    assert worker.drain(timeout=10) and out == ["after"]
    worker.close()
    inline, ran = InlineRunner(), []
    inline.submit(lambda: ran.append(threading.get_ident()))
    assert ran == [threading.get_ident()]


def _names(plan):
    return [list(g.names) for g in plan.groups]


def test_static_planners_group_in_backward_order_with_small_tensors_exact():
    names = ["a.w", "a.b", "b.w", "b.b", "c.w"]
    numels = [5000, 10, 3000, 10, 6000]
    assert _names(build_plan(names, numels, "model")) == [["c.w", "b.w", "a.w"], ["b.b", "a.b"]]
    assert _names(build_plan(names, numels, "layer")) == [["c.w"], ["b.w"], ["a.w"], ["b.b", "a.b"]]
    assert _names(build_plan(names, numels, "threshold", threshold=8000)) == [["c.w", "b.w"], ["a.w"], ["b.b", "a.b"]]
    assert [g.exact for g in build_plan(names, numels, "model").groups] == [False, True]
    assert _names(build_plan(names, numels, "model", compress=False)) == [["c.w", "b.b", "b.w", "a.b", "a.w"]]


def test_planner_registry_accepts_new_planners_and_refuses_unknown_names():
    def reverse_pairs(req: PlanRequest):
        from lightning_gc.plans import assemble_plan

        big, small = req.split_small()
        return assemble_plan("pairs", [big[i:i + 2] for i in range(0, len(big), 2)], small)

    register_planner("pairs_for_test", reverse_pairs)
    assert "pairs_for_test" in available_planners()
    plan = build_plan(["x", "y", "z"], [2000, 2000, 2000], "pairs_for_test")
    assert _names(plan) == [["z", "y"], ["x"]]
    with pytest.raises(ValueError, match="not a plan kind"):
        get_planner("nope")
    assert ParamFacts(0, "x", 3).backward_s is None


def test_memory_remap_keeps_every_parameter_element():
    names = ["a", "b", "c", "d"]
    numels = [1500, 2500, 1200, 4000]
    old = build_plan(names, numels, "layer")
    new = build_plan(names, numels, "threshold", threshold=3000)
    mem = ErrorMemory()
    truth = {n: torch.arange(k, dtype=torch.float32) + 1000 * i for i, (n, k) in enumerate(zip(names, numels))}
    for g in old.groups:
        mem.stage(g.gid, torch.cat([truth[n] for n in g.names]))
    mem.commit()
    assert mem.remap(old, new, [torch.float32] * 4, torch.device("cpu")) == []
    for g in new.groups:
        assert torch.equal(mem.get(g.gid), torch.cat([truth[n] for n in g.names]))
    expected = sum(float(t.double().pow(2).sum()) for t in truth.values()) ** 0.5
    assert mem.norm() == pytest.approx(expected)
    mem.stage(0, torch.zeros(3))
    mem.discard()
    assert mem.get(0).numel() == new.groups[0].numel  # discarded stage did not replace memory


def test_pipelined_plans_get_small_ddp_buckets_unless_given():
    from lightning_gc import GCStrategy
    from lightning_gc.strategy import PIPELINED_BUCKET_CAP_MB

    assert GCStrategy(plan="layer")._ddp_kwargs["bucket_cap_mb"] == PIPELINED_BUCKET_CAP_MB == 1.0
    assert GCStrategy(plan="threshold")._ddp_kwargs["bucket_cap_mb"] == 1.0
    assert "bucket_cap_mb" not in GCStrategy(plan="model")._ddp_kwargs  # DDP's own default
    assert GCStrategy(plan="layer", bucket_cap_mb=25)._ddp_kwargs["bucket_cap_mb"] == 25
