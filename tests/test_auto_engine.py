"""The engine's dense modes (what ``compressor="auto"`` switches to for ``ddp``/``fp16``/``bf16``).

Oracles, from every rank's local gradient gathered by hand:

* a 16-bit dense step equals torch's ``fp16_compress_hook`` run by DDP itself (bit for bit), and a
  hand-written ``cast → ÷N → allreduce → copy back`` of the local gradient;
* entering a dense mode with error memory adds each rank's memory once to its next finite dense
  step (the average is ``mean_r(g_r + e_r)``), then clears it; a non-finite step keeps it pending;
* leaving the dense mode for Top-k starts from empty memory (``mean_r topk(g_r)``, Top-k by
  ``torch.topk`` here, not the library's selection).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from compression_oracles import topk_keep
from dist_harness import gather_all, run_distributed
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_gc.compressors import build_compressor
from lightning_gc.engine import EngineConfig, GCEngine, gc_comm_hook

RATIO = 0.1


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 64), torch.nn.Tanh(), torch.nn.Linear(64, 5))


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(16, 24, generator=g) * (1.0, 2.5, 0.7, 1.6)[(rank + step) % 4]
    return x, torch.randint(0, 5, (16,), generator=g)


def _loss(m, x, y):
    return torch.nn.functional.cross_entropy(m(x), y)



def _fp16_mean(x: torch.Tensor, ws: int) -> torch.Tensor:
    """torch's fp16_compress_hook by hand: cast, divide, allreduce in fp16, back to fp32."""
    t = x.to(torch.float16).div_(ws)
    dist.all_reduce(t)
    return t.float()


def _modes_ranks(rank: int, ws: int) -> dict:
    model = _model()
    replica = copy.deepcopy(model)
    ddp = DDP(model)
    engine = GCEngine(build_compressor("topk", ratio=RATIO), EngineConfig(plan="model", warmup_steps=1,
                                                                           min_compress_numel=100),
                      list(model.named_parameters()))
    ddp.register_comm_hook(engine, gc_comm_hook)
    lossy = [g for g in engine.plan.groups if not g.exact]
    names = [n for g in lossy for n in g.names]
    exact_names = [n for g in engine.plan.groups if g.exact for n in g.names]
    # what each step runs: 0 dense warm-up, 1-2 Top-k, 3 fp16 with a NaN on the last rank (flush kept),
    # 4 fp16 (flush), 5 fp16, 6 fp32 dense, 7 Top-k again
    modes = {3: "fp16", 6: "fp32", 7: None}
    mem = [torch.zeros(sum(engine.params[i].numel() for g in lossy for i in g.param_ids)) for _ in range(ws)]
    out: dict = {"worst": 0.0, "memory_after": {}, "nonfinite": []}
    for step in range(8):
        if step in modes:
            engine.set_dense_mode(modes[step])
        replica.load_state_dict(model.state_dict())
        x, y = _batch(rank, step)
        if step == 3 and rank == ws - 1:
            x = x * float("nan")
        replica.zero_grad()
        _loss(replica, x, y).backward()
        local = {n: p.grad.detach().reshape(-1).clone() for n, p in replica.named_parameters()}
        ddp.zero_grad()
        _loss(ddp, x, y).backward()
        bad = engine.before_optimizer_step()
        out["nonfinite"].append(bad)
        got = {n: p.grad.detach().reshape(-1).clone() for n, p in model.named_parameters()}
        flat_local = torch.cat([local[n] for n in names])
        flat_got = torch.cat([got[n] for n in names])
        all_flat = gather_all(flat_local, ws)
        if step == 0 or step == 6:
            expect = sum(all_flat) / ws
            tol = 1e-6
        elif step in (1, 2, 7):
            ps = [all_flat[r] + mem[r] for r in range(ws)]
            kept = [topk_keep(p, RATIO) for p in ps]
            expect = sum(kept) / ws
            mem = [p - k for p, k in zip(ps, kept)]
            tol = 1e-6
        elif step == 3:
            expect = None  # non-finite on one rank: skipped, memory must stay pending
        else:  # 4: flush of the memory kept through step 3; 5: plain fp16
            expect = _fp16_mean(flat_local + mem[rank], ws)
            mem = [torch.zeros_like(m) for m in mem] if step == 4 else mem
            # two fp16 addends round the same in any order; from three on, the order of gloo's sum over
            # a bucket of another size may differ from ours by a rounding of the sum
            tol = 0.0 if ws == 2 else 2e-3 * float(expect.abs().max())
        if expect is not None:
            out["worst"] = max(out["worst"], float((flat_got - expect).abs().max()) - tol)
        # the small tensors always travel exactly: fp32 in fp32 modes and Top-k steps, fp16 in fp16 steps
        for n in exact_names:
            if step in (4, 5):
                e = _fp16_mean(local[n], ws)
                t16 = 0.0 if ws == 2 else 2e-3 * float(e.abs().max())
                out["worst"] = max(out["worst"], float((got[n] - e).abs().max()) - t16)
            elif step != 3:
                e = sum(gather_all(local[n], ws)) / ws
                out["worst"] = max(out["worst"], float((got[n] - e).abs().max()) - 1e-6)
        eng_mem = engine.error_memory_by_name()
        out["memory_after"][step] = sum(float(v.pow(2).sum()) for v in eng_mem.values()) if eng_mem else 0.0
        if not bad:
            torch.optim.SGD(model.parameters(), lr=0.05).step()
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    out["dense_mode"] = engine.dense_mode
    engine.close()
    return out


@pytest.mark.parametrize("world_size", [3])  # 3: the fp16 sum's order matters (2 checked bit for bit below)
def test_dense_modes_flush_error_memory_once_and_match_hand_written_collectives(world_size):
    res = run_distributed(_modes_ranks, world_size)
    for r in res:
        assert r["worst"] <= 0.0, r["worst"]
        assert r["nonfinite"] == [False, False, False, True, False, False, False, False]
        mem = r["memory_after"]
        assert mem[2] > 0 and mem[3] == pytest.approx(mem[2])  # the NaN step kept the pending memory
        assert mem[4] == 0.0 and mem[5] == 0.0 and mem[6] == 0.0  # flushed once by step 4
        assert mem[7] > 0  # Top-k again builds new memory
        assert r["dense_mode"] is None
    for n, p in res[0]["params"].items():
        for other in res[1:]:
            assert torch.equal(p, other["params"][n]), n


def _hook_parity_ranks(rank: int, ws: int, mode: str) -> dict:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    def bf16_hook(pg, bucket):  # DDP refuses torch's bf16 hook by name off NCCL; its body runs on gloo
        return default_hooks._compress_hook(torch.bfloat16, pg, bucket)

    ours, theirs = _model(), _model()
    a, b = DDP(ours), DDP(theirs)
    engine = GCEngine(build_compressor("topk", ratio=RATIO), EngineConfig(warmup_steps=0),
                      list(ours.named_parameters()))
    a.register_comm_hook(engine, gc_comm_hook)
    b.register_comm_hook(None, fp16_compress_hook if mode == "fp16" else bf16_hook)
    engine.set_dense_mode(mode)
    opt_a, opt_b = torch.optim.SGD(ours.parameters(), lr=0.1), torch.optim.SGD(theirs.parameters(), lr=0.1)
    same = []
    for step in range(3):
        x, y = _batch(rank, step)
        for m, opt in ((a, opt_a), (b, opt_b)):
            opt.zero_grad()
            _loss(m, x, y).backward()
        engine.before_optimizer_step()
        same.append(all(torch.equal(p.grad, q.grad) for p, q in zip(ours.parameters(), theirs.parameters())))
        opt_a.step()
        opt_b.step()
    stats = engine.last_step
    engine.close()
    return {"same": same, "bytes": stats.bytes_payload, "numel": sum(p.numel() for p in ours.parameters())}


@pytest.mark.parametrize("mode", ["fp16", "bf16"])
def test_a_16_bit_dense_mode_equals_torchs_compress_hook_bit_for_bit(mode):
    for r in run_distributed(_hook_parity_ranks, 2, mode):
        assert r["same"] == [True, True, True]
        assert r["bytes"] == 2 * r["numel"]  # 16 bits per element on the wire


def test_dense_mode_is_validated_and_checkpointed():
    model = _model()
    engine = GCEngine(build_compressor("topk", ratio=RATIO), EngineConfig(), list(model.named_parameters()))
    with pytest.raises(ValueError, match="'fp8'.*None.*'fp32', 'fp16' or 'bf16'"):
        engine.set_dense_mode("fp8")
    engine.set_dense_mode("bf16")
    assert engine.step_is_dense()
    state = engine.state_dict()
    other = GCEngine(build_compressor("topk", ratio=RATIO), EngineConfig(), list(_model().named_parameters()))
    other.load_state_dict(state)
    assert other.dense_mode == "bf16" and other.step_is_dense()
