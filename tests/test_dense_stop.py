"""A dense step that can stop (lightning_gc/engine/dense_stop.py), on spawned gloo ranks.

Oracles, from every rank's own gradients gathered by ``all_gather`` (never through the engine):

* a step that goes on is the 16-bit hook's mean (the chunk's direct sum is the rest of the sum);
* a step that stops leaves the compressed groups' gradients zero on every rank, averages the exact
  group's, and keeps each rank's own compressed gradient as its error memory; the next dense step
  then sends the mean of (gradient + that memory), and the memory is gone;
* a rank whose deferred gradient is non-finite makes the step non-finite on every rank, and the
  memory stays as it was;
* the verdict uses the *fastest* rank's time: ranks that waited for a late rank do not stop the step,
  and every rank takes the same verdict.
"""

from __future__ import annotations

import math
import time

import pytest
import torch
import torch.distributed as dist
from dist_harness import gather_all, run_distributed
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_gc.comm.cost_model import NetworkModel
from lightning_gc.compressors import build_compressor
from lightning_gc.engine import EngineConfig, GCEngine, gc_comm_hook
from lightning_gc.engine.dense_stop import DenseStop, check_chunk

NEVER = DenseStop(chunk_bytes=64, factor=1e9, margin_s=1e3)
ALWAYS = DenseStop(chunk_bytes=64, factor=1.0, margin_s=0.0)  # against a model that predicts 0 s


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
    ddp = DDP(model, bucket_cap_mb=0.002)  # several buckets: the first checks, the later ones follow its verdict
    # the biases (40 and 5 elements) are below min_compress_numel: the plan's exact group
    engine = GCEngine(build_compressor("topk", ratio=0.1), EngineConfig(warmup_steps=1, min_compress_numel=64),
                      list(model.named_parameters()))
    ddp.register_comm_hook(engine, gc_comm_hook)
    engine.adopt_network(NetworkModel(0.0, 0.0))
    engine.set_dense_mode("fp16")
    engine.enable_dense_stop(NEVER)
    exact = [p.numel() < 64 for p in model.parameters()]
    out: dict = {"go_on": [], "stop": {}, "flush": [], "poison": {}, "carried": []}

    def step(s: int, poison: bool = False) -> list[torch.Tensor]:
        engine.carry_wall(0.1 * (rank + 1) + s)
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
                             "check_bytes": engine.last_step.dense_check_bytes})
    engine.enable_dense_stop(ALWAYS)
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
    engine.enable_dense_stop(NEVER)
    got = step(4)  # goes on, and sends the memory with it
    nxt = _local(twin, rank, 4)
    withmem = [g + (o if not e else 0) for g, o, e in zip(nxt, own, exact)]
    want = _mean(withmem, ws)
    out["flush"] = {"worst": max(_rel(a, b) for a, b in zip(got, want)), "memory_after": sorted(engine.error_memory_by_name()),
                    "flush_pending": engine.dense_flush_pending}
    # a stopped step whose deferred gradient is non-finite on one rank: non-finite everywhere, no memory kept
    engine.enable_dense_stop(ALWAYS)
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
        # the value each rank handed to carry_wall before a step, averaged over the ranks in that step's check
        # message (in the warm-up's first bucket at step 0): exact in float64
        for s, got in enumerate(res["carried"]):
            want = sum(0.1 * (k + 1) + s for k in range(ws)) / ws
            assert got == pytest.approx(want, rel=1e-9 if s else 1e-6), (r, s, got, want)
        assert res["carried"] == results[0]["carried"]


def _skewed(rank: int, ws: int) -> dict:
    """Rank r reaches the chunk 40·r ms late: the early ranks' own times hold the wait for the last
    one, the last rank's does not. Against a model that predicts 0 s and a 15 ms margin, the fastest
    rank's time (the last rank's, about a loopback exchange) goes on; the slowest (80 ms) would stop."""
    stop = DenseStop(chunk_bytes=4096, factor=1.0, margin_s=0.015)
    out = []
    for attempt in range(3):
        dist.barrier()
        time.sleep(0.04 * rank)
        chunk = torch.full((1024,), float(rank + 1))
        res = check_chunk(chunk, 1.0 + rank, stop, NetworkModel(0.0, 0.0), None, ws)
        out.append({"stop": res.stop, "fastest": res.fastest_s, "carried": res.carried,
                    "sum": float(chunk[0]), "bytes": res.bytes_sent})
    return {"runs": out}


def test_the_verdict_is_the_fastest_ranks_and_the_same_on_every_rank():
    ws = 3
    results = run_distributed(_skewed, ws)
    for attempt in range(3):
        runs = [res["runs"][attempt] for res in results]
        assert len({(r["stop"], r["fastest"], r["carried"]) for r in runs}) == 1, runs  # identical on every rank
        assert not runs[0]["stop"] and runs[0]["fastest"] < 0.015, runs
        assert all(r["sum"] == 6.0 for r in runs), runs  # 1 + 2 + 3
        assert runs[0]["carried"] == pytest.approx(2.0), runs  # the mean of 1, 2, 3
        # the chunk to N-1 peers, then the two floats to N-1 peers
        assert all(r["bytes"] == (ws - 1) * (4096 + 16) for r in runs), runs


def _confirm(rank: int, ws: int) -> dict:
    """check_wire with the first chunk's verdict forced to stop: the second chunk decides. Forced
    'go on' at the second: both chunks' sums are in the wire, the rest untouched; forced 'stop' at
    both: the wire is untouched and the verdict is the second's."""
    from lightning_gc.engine import dense_stop

    real = dense_stop.check_chunk
    verdicts: list[bool] = []

    def scripted(*args, **kw):
        res = real(*args, **kw)
        res.stop = verdicts.pop(0)
        return res

    dense_stop.check_chunk = scripted
    out = {}
    stop = DenseStop(chunk_bytes=16, factor=1.0, margin_s=0.0)  # 4 fp32 elements per chunk
    for name, script in (("second_goes_on", [True, False]), ("both_stop", [True, True])):
        verdicts[:] = script
        wire = torch.arange(10, dtype=torch.float32) * (rank + 1)
        res, upto = dense_stop.check_wire(wire, float(rank), stop, NetworkModel(0.0, 0.0), None, ws)
        out[name] = {"wire": wire.tolist(), "upto": upto, "stop": res.stop, "attempts": res.attempts,
                     "carried": res.carried, "payload": res.payload_bytes}
    dense_stop.check_chunk = real
    return out


def test_a_stop_is_confirmed_by_a_second_chunk():
    ws = 2
    results = run_distributed(_confirm, ws)
    total = sum(r + 1 for r in range(ws))  # every element is i * (r + 1) on rank r
    for r, res in enumerate(results):
        go = res["second_goes_on"]
        assert not go["stop"] and go["attempts"] == 2 and go["upto"] == 8 and go["payload"] == 32, go
        assert go["wire"][:8] == [i * total / ws for i in range(8)], go  # both chunks: the mean
        assert go["wire"][8:] == [i * (r + 1) for i in (8, 9)], go  # the rest: not yet sent
        assert go["carried"] == pytest.approx(sum(range(ws)) / ws), go  # the first chunk's
        both = res["both_stop"]
        assert both["stop"] and both["upto"] == 0 and both["wire"] == [i * (r + 1) for i in range(10)], both


def test_dense_stop_options_are_checked():
    with pytest.raises(ValueError, match="chunk_bytes=0"):
        DenseStop(chunk_bytes=0)
    with pytest.raises(ValueError, match="factor=0.5"):
        DenseStop(factor=0.5)
    with pytest.raises(ValueError, match="margin_s=nan"):
        DenseStop(margin_s=math.nan)
    s = DenseStop(chunk_bytes=1000, factor=4.0, margin_s=0.02)
    assert s.predicted_s(None, 1000, 4) is None and not s.stops(10.0, None)
    net = NetworkModel(1e-3, 1e-6)  # 1 ms + 3 copies of 1000 B at 1 µs/B: 4 ms
    assert s.predicted_s(net, 1000, 4) == pytest.approx(4e-3)
    assert not s.stops(0.0239, 4e-3) and s.stops(0.024, 4e-3)  # the margin binds: 4 + 20 ms
    big = DenseStop(chunk_bytes=1000, factor=4.0, margin_s=0.001)
    assert not big.stops(0.0159, 4e-3) and big.stops(0.016, 4e-3)  # the factor binds: 4 x 4 ms
