"""Per-group method slots: a group switched to another method at a step boundary.

Oracle: every rank's local gradients are gathered and the expected mean and error memory are
computed by hand (Top-k by ``torch.topk``, not the library's selection), including the memory rule
of a switch: kept when the new method uses error feedback, flushed into the next send otherwise.
"""

from __future__ import annotations

import copy

import pytest
import torch
from compression_oracles import topk_keep
from dist_harness import gather_all, run_distributed
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_gc.compressors import build_compressor
from lightning_gc.engine import EngineConfig, GCEngine, gc_comm_hook
from lightning_gc.engine.slots import MethodSpec


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 64), torch.nn.Tanh(), torch.nn.Linear(64, 48), torch.nn.Tanh(),
                               torch.nn.Linear(48, 5))


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(16, 24, generator=g) * (1.0, 2.5, 0.7, 1.6, 1.2)[(rank + step) % 5]
    return x, torch.randint(0, 5, (16,), generator=g)


def _loss(m, x, y):
    return torch.nn.functional.cross_entropy(m(x), y)



RATIO = 0.1


def _switch_ranks(rank: int, ws: int) -> dict:
    model = _model()
    replica = copy.deepcopy(model)
    ddp = DDP(model, bucket_cap_mb=0.004)
    engine = GCEngine(build_compressor("topk", ratio=RATIO), EngineConfig(plan="layer", warmup_steps=1,
                                                                           min_compress_numel=1000),
                      list(model.named_parameters()))
    ddp.register_comm_hook(engine, gc_comm_hook)
    lossy = [g for g in engine.plan.groups if not g.exact]
    assert sorted(g.names for g in lossy) == [("0.weight",), ("2.weight",)]
    g0 = lossy[0]  # switched; the other stays on the default Top-k
    # the switches, before the step they apply to: 2 → group 0 dense (flush), 4 → group 0 efsignsgd
    # (error feedback: keep), 5 → group 0 back to the default Top-k
    switches = {2: MethodSpec("dense"), 4: MethodSpec("efsignsgd"), 5: None}
    mem = {g.names: [torch.zeros(g.numel) for _ in range(ws)] for g in lossy}  # reference memory per rank
    worst = 0.0
    out: dict = {"mem_kept": None}
    for step in range(6):
        if step in switches:
            before = engine.error_memory_by_name()
            engine.set_group_method(g0.gid, switches[step])
            if step == 4:  # kept: the memory is untouched by the switch
                after = engine.error_memory_by_name()
                out["mem_kept"] = all(torch.equal(before[n], after[n]) for n in before)
        replica.load_state_dict(model.state_dict())
        x, y = _batch(rank, step)
        replica.zero_grad()
        _loss(replica, x, y).backward()
        local = {n: p.grad.detach().reshape(-1).clone() for n, p in replica.named_parameters()}
        all_local = {n: gather_all(local[n], ws) for n in local}
        ddp.zero_grad()
        _loss(ddp, x, y).backward()
        got = {n: p.grad.detach().reshape(-1).clone() for n, p in model.named_parameters()}
        for g in lossy:
            (name,) = g.names
            gs = all_local[name]
            if step < 1:  # dense warm-up
                expect = sum(gs) / ws
            elif g is g0 and step in (2, 3):  # dense, no error feedback: memory flushed at step 2 only
                expect = sum(gs[r] + mem[g.names][r] for r in range(ws)) / ws
                mem[g.names] = [torch.zeros(g.numel) for _ in range(ws)]
            elif g is g0 and step == 4:  # EF-signSGD with the kept memory: checked for agreement only
                expect = None
                mem[g.names] = [torch.zeros(g.numel) for _ in range(ws)]  # unknown here: re-read below
            else:  # Top-k with error feedback
                ps = [gs[r] + mem[g.names][r] for r in range(ws)]
                kept = [topk_keep(p, RATIO) for p in ps]
                expect = sum(kept) / ws
                mem[g.names] = [p - k for p, k in zip(ps, kept)]
            if expect is not None:
                worst = max(worst, float((got[name] - expect).abs().max()))
            if g is g0 and step == 4:  # take the engine's memory (all ranks) as the reference from here
                e = engine.error_memory_by_name()[name].reshape(-1)
                mem[g.names] = gather_all(e, ws)
        eng_mem = engine.error_memory_by_name()
        for g in lossy:
            (name,) = g.names
            ref = mem[g.names][rank]
            if g is g0 and step in (2, 3):
                assert name not in eng_mem, f"step {step}: flushed memory must be gone"
            else:  # no entry yet (dense warm-up): zero memory
                e = eng_mem[name].reshape(-1) if name in eng_mem else torch.zeros_like(ref)
                worst = max(worst, float((e - ref).abs().max()))
        torch.optim.SGD(model.parameters(), lr=0.05).step()
    out["worst"] = worst
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    out["slots"] = engine.slot_specs()
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_switching_a_groups_method_follows_the_memory_rule(world_size):
    res = run_distributed(_switch_ranks, world_size)
    for r in res:
        assert r["worst"] < 1e-6, r["worst"]
        assert r["mem_kept"] is True
        assert r["slots"] == []  # back to the default method at step 5
    for n, p in res[0]["params"].items():
        for other in res[1:]:
            assert torch.equal(p, other["params"][n]), n


def _disagree_ranks(rank: int, ws: int) -> str:
    model = _model()
    engine = GCEngine(build_compressor("topk", ratio=RATIO), EngineConfig(plan="layer", min_compress_numel=1000),
                      list(model.named_parameters()))
    gid = next(g.gid for g in engine.plan.groups if not g.exact)
    spec = MethodSpec("topk", ratio=0.05 if rank == ws - 1 else 0.02)  # one rank differs
    try:
        engine.set_group_method(gid, spec)
    except RuntimeError as e:
        return str(e)
    finally:
        engine.close()
    return "no error"


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_rank_dependent_switch_is_refused_on_every_rank(world_size):
    msgs = run_distributed(_disagree_ranks, world_size)
    for m in msgs:
        assert "ranks built different communication setups" in m and "set_group_method" in m, m
        assert f"[{world_size - 1}]" in m  # the rank that differs is named


def test_slots_refuse_exact_groups_and_survive_a_checkpoint():
    model = _model()
    cfg = EngineConfig(plan="layer", min_compress_numel=1000)
    engine = GCEngine(build_compressor("topk", ratio=RATIO), cfg, list(model.named_parameters()))
    exact = next(g.gid for g in engine.plan.groups if g.exact)
    with pytest.raises(ValueError, match=f"group {exact} .* is sent exactly"):
        engine.set_group_method(exact, MethodSpec("qsgd"))
    with pytest.raises(ValueError):
        engine.set_group_method(0, MethodSpec("no_such_compressor"))
    with pytest.raises(ValueError, match="ratio"):
        engine.set_group_method(0, MethodSpec("topk", ratio=2.0))
    engine.set_group_method(0, MethodSpec("qsgd", compressor_args={"levels": 3}))
    state = engine.state_dict()
    other = GCEngine(build_compressor("topk", ratio=RATIO), cfg, list(_model().named_parameters()))
    assert other.slot_of(0).describe() != engine.slot_of(0).describe()
    other.load_state_dict(state)
    assert other.slot_of(0).describe() == engine.slot_of(0).describe()
    assert "levels=3" in other.slot_of(0).describe() or "3" in other.slot_of(0).describe()
    assert other.slot_of(1) is other.default_slot


def _resume_ranks(rank: int, ws: int) -> dict:
    """Group 0 on PowerSGD-style low rank (warm start: its ``Q̄`` carries from step to step) in a
    slot, checkpointed after step 3: the resumed engine's next two steps equal the uninterrupted
    run's bit for bit (a slot rebuilt without its exchange state restarts ``Q̄`` and differs)."""
    cfg = EngineConfig(plan="layer", warmup_steps=1, min_compress_numel=1000)

    def build(model):
        ddp = DDP(model, bucket_cap_mb=0.004)
        engine = GCEngine(build_compressor("topk", ratio=RATIO), cfg, list(model.named_parameters()))
        ddp.register_comm_hook(engine, gc_comm_hook)
        return ddp, engine

    def train(model, ddp, steps):
        for step in steps:
            x, y = _batch(rank, step)
            ddp.zero_grad()
            _loss(ddp, x, y).backward()
            torch.optim.SGD(model.parameters(), lr=0.05).step()

    model = _model()
    ddp, engine = build(model)
    gid = next(g.gid for g in engine.plan.groups if not g.exact)
    engine.set_group_method(gid, MethodSpec("lowrank", compressor_args={"rank": 2}))
    train(model, ddp, range(4))
    state, params = engine.state_dict(), copy.deepcopy(model.state_dict())
    train(model, ddp, range(4, 6))
    resumed = _model()
    resumed.load_state_dict(params)
    ddp2, engine2 = build(resumed)
    engine2.load_state_dict(state)
    train(resumed, ddp2, range(4, 6))
    out = {n: bool(torch.equal(p, dict(resumed.named_parameters())[n])) for n, p in model.named_parameters()}
    engine.close()
    engine2.close()
    return out


def test_a_slots_exchange_state_survives_a_checkpoint():
    for r in run_distributed(_resume_ranks, 2):
        assert all(r.values()), r
