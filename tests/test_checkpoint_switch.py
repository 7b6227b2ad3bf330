"""A checkpoint taken right at a method switch, while error memory still waits for its flush.

Two switches leave error memory owed to the next step: a group moved to a method without error
feedback (``GCEngine.set_group_method``: the memory is added once to the group's next send), and
the engine moved to a dense mode (``GCEngine.set_dense_mode``: the memory is added once to the next
finite dense step's buckets). A checkpoint taken between the switch and that step must carry the
pending flush, or the resumed run never sends what was owed and every later step differs.

Oracle: the same run without the interruption, on 2 gloo ranks with rank-dependent batches; after
the resume, every parameter at every step equals the uninterrupted run's, bit for bit.
"""

from __future__ import annotations

import copy

import pytest
import torch
from dist_harness import run_distributed
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_gc.compressors import build_compressor
from lightning_gc.engine import EngineConfig, GCEngine, gc_comm_hook
from lightning_gc.engine.slots import MethodSpec

SWITCH_AT = 3  # the switch (and the checkpoint) come before this step
STEPS = 6


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 64), torch.nn.Tanh(), torch.nn.Linear(64, 48), torch.nn.Tanh(),
                               torch.nn.Linear(48, 5))


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(16, 24, generator=g) * (1.0, 2.5, 0.7, 1.6, 1.2)[(rank + step) % 5]
    return x, torch.randint(0, 5, (16,), generator=g)


def _build(model: torch.nn.Module):
    ddp = DDP(model, bucket_cap_mb=0.004)
    engine = GCEngine(build_compressor("topk", ratio=0.1),
                      EngineConfig(plan="layer", warmup_steps=1, min_compress_numel=1000),
                      list(model.named_parameters()))
    ddp.register_comm_hook(engine, gc_comm_hook)
    return ddp, engine


def _train(model, ddp, steps, rank) -> list[dict[str, torch.Tensor]]:
    after = []
    for step in steps:
        x, y = _batch(rank, step)
        ddp.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        torch.optim.SGD(model.parameters(), lr=0.05).step()
        after.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return after


def _switch(engine: GCEngine, kind: str) -> str:
    if kind == "group":
        gid = next(g.gid for g in engine.plan.groups if g.names == ("0.weight",))
        engine.set_group_method(gid, MethodSpec("dense"))  # no error feedback: its memory is flushed next step
        return "|".join(e["names"][0] for e in engine.slot_specs() if e.get("flush"))
    engine.set_dense_mode("fp32")
    return f"dense_flush_pending={engine.dense_flush_pending}"


def _resume_at_switch(rank: int, ws: int, kind: str) -> dict:
    model = _model()
    ddp, engine = _build(model)
    _train(model, ddp, range(SWITCH_AT), rank)
    memory = engine.error_memory_by_name()
    pending = _switch(engine, kind)
    state, params = copy.deepcopy(engine.state_dict()), copy.deepcopy(model.state_dict())
    straight = _train(model, ddp, range(SWITCH_AT, STEPS), rank)
    resumed = _model()
    resumed.load_state_dict(params)
    ddp2, engine2 = _build(resumed)
    engine2.load_state_dict(state)
    again = _train(resumed, ddp2, range(SWITCH_AT, STEPS), rank)
    engine.close()
    engine2.close()
    return {"pending": pending, "memory_norm": sum(float(m.norm()) for m in memory.values()),
            "straight": straight, "resumed": again}


@pytest.mark.parametrize("kind, pending", [("group", "0.weight"), ("dense", "dense_flush_pending=True")])
def test_resume_from_a_checkpoint_taken_at_the_switch_is_bit_identical(kind, pending):
    for rank, r in enumerate(run_distributed(_resume_at_switch, 2, kind)):
        assert r["pending"] == pending, r["pending"]  # a flush was pending when the checkpoint was taken
        assert r["memory_norm"] > 0  # ... of a non-zero error memory
        for k, (want, got) in enumerate(zip(r["straight"], r["resumed"])):
            for n in want:
                assert torch.equal(got[n], want[n]), (rank, SWITCH_AT + k, n, float((got[n] - want[n]).abs().max()))
