"""lightning_gc/sync/optimizer_state.py: the ranks' drifted optimizer states made one, on 3 gloo ranks.

Oracles: the mean of every rank's state, computed in float64 from all ranks' tensors gathered in the
test (with a bfloat16 wire: of their bfloat16 roundings, within the rounding of its partial sums); bit-identical parameters after a per-step update from identical parameters and gradients (and,
for contrast, different parameters without the averaging); a step counter that differs raises on
every rank.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_harness import gather_all, run_distributed

from lightning_gc.sync.optimizer_state import average_optimizer_state, repair_optimizer_state

WS = 3


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def _local_steps(model, opt, rank: int, steps: int) -> None:
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own data: the states drift apart
    for _ in range(steps):
        x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def _flat_state(opt, key: str) -> torch.Tensor:
    return torch.cat([opt.state[p][key].reshape(-1) for p in opt.param_groups[0]["params"]])


def _one_update(model, opt) -> torch.Tensor:
    """Identical parameters (rank 0's) and an identical batch on every rank, then one optimizer step."""
    for p in model.parameters():
        dist.broadcast(p.data, src=0)
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _drifted(rank: int, ws: int, kind: str, wire_dtype: torch.dtype | None = None) -> dict:
    out = {}
    for average in (False, True):
        model = _model()
        opt = (torch.optim.AdamW(model.parameters(), lr=0.01) if kind == "adamw"
               else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        _local_steps(model, opt, rank, 3)
        keys = ("exp_avg", "exp_avg_sq") if kind == "adamw" else ("momentum_buffer",)
        wired = (lambda t: t.to(wire_dtype)) if wire_dtype is not None else (lambda t: t)
        before = {k: gather_all(wired(_flat_state(opt, k)).double(), ws) for k in keys}
        if average:
            out["sent"] = average_optimizer_state(opt, wire_dtype=wire_dtype)
            for k in keys:
                after = gather_all(_flat_state(opt, k), ws)
                want = sum(before[k]) / ws
                out[f"{k} err"] = float((after[rank].double() - want).abs().max() / want.abs().max())
                # the N - 1 partial sums each round by at most half a unit in the last place (2^-8 relative)
                bound = 2 * (ws - 1) * 2.0 ** -8 * sum(b.abs() for b in before[k]) / ws
                out[f"{k} within rounding"] = bool(((after[rank].double() - want).abs() <= bound).all())
                out[f"{k} same"] = all(torch.equal(after[0], a) for a in after)
            if kind == "adamw":
                out["steps"] = [float(opt.state[p]["step"]) for p in opt.param_groups[0]["params"]]
        params = gather_all(_one_update(model, opt), ws)
        out[f"identical after update, averaged={average}"] = all(torch.equal(params[0], q) for q in params)
    return out


def test_adamw_moments_become_their_mean_and_the_replicas_stay_identical():
    for o in run_distributed(_drifted, WS, "adamw"):
        assert o["exp_avg err"] < 1e-6 and o["exp_avg_sq err"] < 1e-6, o
        assert o["exp_avg same"] and o["exp_avg_sq same"]
        assert o["steps"] == [3.0] * 4  # the counter is checked, not averaged
        assert o["identical after update, averaged=True"]
        assert not o["identical after update, averaged=False"]  # the drift the averaging removes
        assert o["sent"] > 0


def test_a_bfloat16_wire_halves_the_bytes_and_keeps_the_mean_within_its_rounding():
    fp32 = run_distributed(_drifted, WS, "adamw")
    for o, full in zip(run_distributed(_drifted, WS, "adamw", torch.bfloat16), fp32):
        assert o["exp_avg within rounding"] and o["exp_avg_sq within rounding"], o
        assert o["exp_avg same"] and o["exp_avg_sq same"]  # every rank the same bits
        assert o["sent"] == pytest.approx(full["sent"] / 2, rel=0.02)  # each tensor rounds its own ring bytes
        assert o["steps"] == [3.0] * 4
        assert o["identical after update, averaged=True"]


def test_a_wire_dtype_that_is_not_floating_point_is_refused():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    with pytest.raises(ValueError, match="wire_dtype=torch.int8 must be a floating-point"):
        average_optimizer_state(opt, wire_dtype=torch.int8)


def test_sgd_momentum_buffers_become_their_mean():
    for o in run_distributed(_drifted, WS, "sgd"):
        assert o["momentum_buffer err"] < 1e-6 and o["momentum_buffer same"]
        assert o["identical after update, averaged=True"] and not o["identical after update, averaged=False"]


def _uneven(rank: int, ws: int) -> str:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    _local_steps(model, opt, rank, 3 if rank != 1 else 4)
    try:
        average_optimizer_state(opt)
    except ValueError as e:
        return str(e)
    return "no error"


def test_a_step_counter_that_differs_raises_on_every_rank():
    for msg in run_distributed(_uneven, WS):
        assert "'step' differs between ranks" in msg and "same optimizer steps" in msg, msg


# ---------------------------------------------------------------------- leaving DiLoCo mid-round
def _leave_diloco(rank: int, ws: int, average: bool) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightning_gc.assembly import build_session
    from lightning_gc.config import GCConfig

    model = _model()
    ddp = DDP(model)
    asm = build_session(GCConfig.from_flat(sync="diloco", diloco_inner_steps=5, compressor="dense"), ddp,
                        announce=False)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(100 + rank)
    batches = [(torch.randn(8, 6, generator=g) * (1 + rank), torch.randint(0, 3, (8,), generator=g))
               for _ in range(10)]
    for x, y in batches[:7]:  # an outer step at 5, then 2 inner steps of the next round: drifted state
        def closure(x=x, y=y):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(ddp(x), y)
            loss.backward()
            return loss
        asm.session.optimizer_step(opt, closure, lambda c: opt.step(c))
    out = {"sent": asm.diloco.leave() if average else 0}
    if not average:
        asm.diloco.finish()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    out["params identical at the switch"] = all(torch.equal(flat, q) for q in gather_all(flat, ws))
    out["theta_outer"] = all(torch.equal(p.detach(), o) for p, o in zip(model.parameters(), asm.diloco.theta_outer))
    identical = []
    for x, y in batches[7:]:  # per-step data parallelism: the mean gradient, identical on every rank
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad.div_(ws)
        opt.step()
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        identical.append(all(torch.equal(flat, q) for q in gather_all(flat, ws)))
    out["identical per-step"] = identical
    asm.session.close()
    return out


def test_leaving_diloco_mid_round_keeps_the_replicas_bit_identical_per_step():
    for o in run_distributed(_leave_diloco, WS, True):
        assert o["params identical at the switch"] and o["theta_outer"]
        assert o["identical per-step"] == [True, True, True], o
        assert o["sent"] > 0
    # without averaging the inner optimizers' drifted moments, the same per-step updates split the replicas
    for o in run_distributed(_leave_diloco, WS, False):
        assert o["params identical at the switch"] and o["identical per-step"][0] is False


# ---------------------------------------------------------------- repairing a non-finite state
def _repaired(rank: int, ws: int, bad: tuple[int, ...], kind: str) -> dict:
    """AdamW or SGD with momentum, drifted on each rank's data; the ranks in ``bad`` then hold a NaN in
    their state of the first layer's weight, and every rank repairs the first layer's two tensors
    (the second layer, never repaired, holds an inf on rank 0, which must stay)."""
    model = _model()
    opt = (torch.optim.AdamW(model.parameters(), lr=0.01) if kind == "adamw"
           else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    _local_steps(model, opt, rank, 3)
    first = [model[0].weight, model[0].bias]
    key = "exp_avg_sq" if kind == "adamw" else "momentum_buffer"
    if rank in bad:
        opt.state[model[0].weight][key][0, 0] = float("nan")
    if rank == 0:
        opt.state[model[2].weight][key][0, 0] = float("inf")
    tensors = lambda p: {k: v.clone() for k, v in opt.state.get(p, {}).items()}  # noqa: E731
    before = [gather_all(torch.cat([v.reshape(-1).double() for v in tensors(p).values()]), ws) for p in first]
    other = tensors(model[2].weight)
    sent = repair_optimizer_state(opt, first)
    out = {"sent": sent, "kept": all(torch.equal(other[k], v) for k, v in tensors(model[2].weight).items()),
           "has_state": [p in opt.state for p in first]}
    if all(out["has_state"]):
        out["after"] = [torch.cat([v.reshape(-1).double() for v in tensors(p).values()]) for p in first]
        out["before"] = before
    return out


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_a_rank_whose_state_went_non_finite_takes_the_finite_ranks_mean(kind):
    """Rank 1's state is NaN: it takes the float64 mean of ranks 0 and 2 (its step counter is the same on
    every rank and stays); ranks 0 and 2 keep their own bits; parameters outside the repair keep theirs."""
    outs = run_distributed(_repaired, WS, (1,), kind)
    for rank, o in enumerate(outs):
        assert o["kept"] and o["has_state"] == [True, True]
        for k, after in enumerate(o["after"]):
            before = o["before"][k]
            if rank == 1:
                want = (before[0] + before[2]) / 2
                assert torch.allclose(after, want, rtol=1e-6, atol=0), (kind, k)  # fp32: one rounding of the sum
            else:
                assert torch.equal(after, before[rank]), (kind, rank, k)
        assert o["sent"] > 4  # the flag and the state


def test_no_rank_non_finite_costs_one_flag_and_changes_nothing():
    outs = run_distributed(_repaired, WS, (), "adamw")
    for rank, o in enumerate(outs):
        assert o["kept"] and all(torch.equal(a, b[rank]) for a, b in zip(o["after"], o["before"]))
        assert o["sent"] == round(2 * (WS - 1) * 4 / WS)  # one float32 flag on the ring


def test_every_rank_non_finite_drops_that_state_on_every_rank():
    """No finite rank to take a mean from: every rank drops the repaired parameters' state alike (AdamW
    then starts it afresh, step counters included, on every rank)."""
    for o in run_distributed(_repaired, WS, (0, 1, 2), "adamw"):
        assert o["has_state"] == [False, False] and o["kept"]
