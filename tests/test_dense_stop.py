"""A dense step that stops on the link canary (lightning_gc/engine/dense_stop.py, run by
``GCEngine.run_before_step``; lightning_gc/auto/canary.py), on spawned gloo ranks.

Oracles, from every rank's own gradients gathered by ``all_gather`` (never through the engine):

* a step after a canary that saw nothing is the 16-bit hook's mean;
* a step that stops leaves the compressed groups' gradients zero on every rank, averages the exact
  group's, and keeps each rank's own compressed gradient as its error memory; the next dense step
  then sends the mean of (gradient + that memory), and the memory is gone;
* a rank whose deferred gradient is non-finite makes the step non-finite on every rank, and the
  memory stays as it was;
* the value each rank carried in the canary arrives as the mean over the ranks.
"""

from __future__ import annotations

import math

import pytest
import torch
from dist_harness import gather_all, run_distributed
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_gc.auto.canary import CanaryJob, LinkCanary
from lightning_gc.comm.cost_model import NetworkModel
from lightning_gc.compressors import build_compressor
from lightning_gc.engine import EngineConfig, GCEngine, gc_comm_hook

NEVER = LinkCanary(nbytes=64, factor=1e9, margin_s=1e3)
ALWAYS = LinkCanary(nbytes=64, factor=1.0, margin_s=0.0)  # against a model that predicts 0 s


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Tanh(), torch.nn.Linear(40, 5))


def _grads(model: DDP, rank: int, step: int, poison: bool = False) -> None:
    g = torch.Generator().manual_seed(1000 * rank + step)
    # rank-dependent scale that changes with the step: no rank has the largest gradients every step
    x = torch.randn(16, 24, generator=g) * (1.0, 2.5, 0.7, 1.6)[(rank + step) % 4]
    y = torch.randint(0, 5, (16,), generator=g)
    model.zero_grad()
    # poison: the first layer's weight gradient (a compressed group's) is NaN on this rank, nothing else
    hook = model.module[0].weight.register_hook(lambda g: torch.full_like(g, math.nan)) if poison else None
    torch.nn.functional.cross_entropy(model(x), y).backward()
    if hook is not None:
        hook.remove()


def _local(model: torch.nn.Module, rank: int, step: int) -> list[torch.Tensor]:
    """This rank's own gradients of ``step`` (a plain copy of the module, no DDP, no hook)."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(16, 24, generator=g) * (1.0, 2.5, 0.7, 1.6)[(rank + step) % 4]
    y = torch.randint(0, 5, (16,), generator=g)
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def _mean(ts: list[torch.Tensor], ws: int) -> list[torch.Tensor]:
    return [sum(gather_all(t, ws)) / ws for t in ts]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / (b.abs().max() + 1e-12))


def _run(rank: int, ws: int) -> dict:
    model = _model()
    twin = _model()  # the same weights, for this rank's own gradients
    ddp = DDP(model, bucket_cap_mb=0.002)  # several buckets: every one follows the canary's verdict
    # the biases (40 and 5 elements) are below min_compress_numel: the plan's exact group
    engine = GCEngine(build_compressor("topk", ratio=0.1), EngineConfig(warmup_steps=1, min_compress_numel=64),
                      list(model.named_parameters()))
    ddp.register_comm_hook(engine, gc_comm_hook)
    engine.adopt_network(NetworkModel(0.0, 0.0))
    engine.set_dense_mode("fp16")
    canary = [NEVER]  # the canary sung before each step (the test swaps it)
    exact = [p.numel() < 64 for p in model.parameters()]
    out: dict = {"go_on": [], "stop": {}, "flush": [], "poison": {}, "carried": []}

    def step(s: int, poison: bool = False) -> list[torch.Tensor]:
        engine.run_before_step(CanaryJob(canary[0], 0.1 * (rank + 1) + s, engine.network.model, engine.exchange_group,
                                          ws, engine.device))
        _grads(ddp, rank, s, poison)
        engine.before_optimizer_step()
        engine.after_optimizer_step()  # no optimizer: the weights stay, so the twin's gradients match
        out["carried"].append(engine.last_step.carried_wall_mean_s)
        return [p.grad.detach().clone() for p in model.parameters()]

    step(0)  # the warm-up (fp32, no check)
    for s in (1, 2):  # steps that go on: the fp16 hook's mean
        got = step(s)
        want = _mean(_local(twin, rank, s), ws)
        out["go_on"].append({"worst": max(_rel(a, b) for a, b in zip(got, want)),
                             "stopped": engine.last_step.dense_stopped,
                             "check_s": engine.last_step.dense_check_s,
                             "check_bytes": engine.last_step.dense_check_bytes,
                             "bytes_sent": engine.last_step.bytes_sent})
    canary[0] = ALWAYS
    got = step(3)
    own = _local(twin, rank, 3)
    want = _mean(own, ws)
    mem = engine.error_memory_by_name()
    names = [n for n, _ in model.named_parameters()]
    out["stop"] = {
        "stopped": engine.last_step.dense_stopped, "nonfinite": engine.last_step.nonfinite,
        "lossy_zero": all(bool((g == 0).all()) for g, e in zip(got, exact) if not e),
        "exact_worst": max(_rel(g, w) for g, w, e in zip(got, want, exact) if e),
        "memory_worst": max(_rel(mem[n].view_as(o), o) for n, o, e in zip(names, own, exact) if not e),
        "memory_names": sorted(mem), "flush_pending": engine.dense_flush_pending,
    }
    canary[0] = NEVER
    got = step(4)  # goes on, and sends the memory with it
    nxt = _local(twin, rank, 4)
    withmem = [g + (o if not e else 0) for g, o, e in zip(nxt, own, exact)]
    want = _mean(withmem, ws)
    out["flush"] = {"worst": max(_rel(a, b) for a, b in zip(got, want)), "memory_after": sorted(engine.error_memory_by_name()),
                    "flush_pending": engine.dense_flush_pending}
    # a stopped step whose deferred gradient is non-finite on one rank: non-finite everywhere, no memory kept
    canary[0] = ALWAYS
    got = step(5, poison=rank == ws - 1)
    out["poison"] = {"stopped": engine.last_step.dense_stopped, "nonfinite": engine.last_step.nonfinite,
                     "memory": sorted(engine.error_memory_by_name()),
                     "exact_finite": all(bool(torch.isfinite(g).all()) for g, e in zip(got, exact) if e)}
    engine.close()
    return out


@pytest.mark.parametrize("ws", [3])
def test_a_dense_step_goes_on_or_stops_with_nothing_lost(ws):
    results = run_distributed(_run, ws, timeout=240)
    for r, res in enumerate(results):
        for s, g in enumerate(res["go_on"], start=1):
            assert not g["stopped"], (r, s, g)
            assert g["worst"] < 2e-3, (r, s, g)  # the 16-bit hook's rounding
            assert g["check_s"] is not None and g["check_s"] > 0 and g["check_bytes"] == 64, (r, s, g)
        st = res["stop"]
        assert st["stopped"] and not st["nonfinite"], (r, st)
        assert st["lossy_zero"], (r, st)
        assert st["exact_worst"] < 1e-6, (r, st)  # fp32, by the direct allreduce
        assert st["memory_worst"] == 0.0, (r, st)  # this rank's own gradient, bit for bit
        assert st["memory_names"] == ["0.weight", "2.weight"] and st["flush_pending"], (r, st)
        fl = res["flush"]
        assert fl["worst"] < 2e-3 and fl["memory_after"] == [] and not fl["flush_pending"], (r, fl)
        po = res["poison"]
        # the exact group's mean is finite: the non-finite verdict came from the flag in its message
        assert po["stopped"] and po["nonfinite"] and po["memory"] == [] and po["exact_finite"], (r, po)
        # the value each rank carried in the canary before a step, averaged over the ranks: exact in float64
        for s, got in enumerate(res["carried"]):
            want = sum(0.1 * (k + 1) + s for k in range(ws)) / ws
            assert got == pytest.approx(want, rel=1e-12), (r, s, got, want)
        assert res["carried"] == results[0]["carried"]
