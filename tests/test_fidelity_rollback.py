"""Rollback leaves no trace: every state TrainingSnapshot claims to restore, checked one by one.

The snapshot (lightning_gc/adaptive/snapshot.py) claims parameters and buffers, gradients,
optimizer state, LR schedulers, the step session (engine state: step counter, error memory, gain
EWMA, totals, ratio, network tracker, exchange state; last step's statistics, non-finite flag and
hook-call count; skipped-step counter) and the RNG states: torch CPU, CUDA (when initialised),
NumPy and Python's ``random``. The compressors' own randomness (RandomK's shared index stream,
QSGD's private rounding stream) is derived from the seed, the engine's step counter, the group and
the rank, so it is restored with the step counter: checked by replaying it.

Oracles:
* each component read right after ``restore()`` equals the same component read right after
  ``capture()`` (named per component, per RNG), after two explorations and two restores (the
  snapshot stays valid), and the exploration really changed each of them (else the check is void);
* a run that captured, explored (another ratio, a non-finite step on one rank, every global RNG
  drawn from) and restored continues bit for bit like a run that never explored (2 gloo ranks,
  DDP, the engine's hook through a StepSession, Adam with weight decay, a StepLR schedule,
  BatchNorm buffers and Dropout).
"""

from __future__ import annotations

import copy
import random
from dataclasses import asdict

import numpy as np
import pytest
import torch
from dist_harness import run_distributed

from lightning_gc.adaptive import TrainingSnapshot

PRE, EXPLORE, AFTER = 4, 3, 4  # steps before the capture, explored, after the restore


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = torch.nn.Linear(20, 64)
        self.bn = torch.nn.BatchNorm1d(64)
        self.drop = torch.nn.Dropout(0.3)  # draws from the global torch RNG in forward
        self.fc2 = torch.nn.Linear(64, 4)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.bn(self.fc1(x)))))


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype \
            and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def _differing(a: dict, b: dict) -> list[str]:
    return [k for k in a if not _equal(a[k], b[k])]


def _state(model, opt, sched, session) -> dict:
    """Every component the snapshot claims, read through public interfaces (copies)."""
    engine = session.engine
    eng = copy.deepcopy(engine.state_dict())
    stats, nonfinite, hook_calls = engine.reporting_state()
    return {
        "params_and_buffers": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "grads": {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
        "optimizer": copy.deepcopy(opt.state_dict()),
        "scheduler": copy.deepcopy(sched.state_dict()),
        "lr": [g["lr"] for g in opt.param_groups],
        "engine_step": eng.pop("step"),
        "error_memory": eng.pop("memory"),
        "gain_ewma": eng.pop("gain_ewma"),
        "totals": eng.pop("totals"),
        "ratio": eng.pop("ratio"),
        "network": eng.pop("network"),
        "exchange_state": eng.pop("exchange"),
        "engine_rest": eng,
        "last_stats": None if stats is None else asdict(stats),
        "last_nonfinite": nonfinite,
        "hook_calls": hook_calls,
        "skipped_steps": session.skipped_steps,
        "rng_torch": torch.get_rng_state(),
        "rng_numpy": np.random.get_state(),
        "rng_python": random.getstate(),
    }


def _train_step(ddp, opt, sched, session, rank: int, step: int, nan: bool) -> float:
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(8, 20, generator=g) * (1.0, 2.0, 0.5)[(rank + step) % 3]
    # noise from every global RNG: a generator left unrestored changes the data
    x = x + 0.1 * torch.randn(8, 20) + 0.1 * torch.from_numpy(np.random.randn(8, 20)).float()
    x = x * (1.0 + 0.1 * random.random())
    y = torch.randint(0, 4, (8,), generator=g)
    if nan:
        x[0, 0] = float("nan")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        return loss

    loss = session.optimizer_step(opt, closure, run=lambda c: opt.step(c))
    sched.step()
    return float(loss)


def _run(rank: int, ws: int, comp_name: str, explore: bool) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightning_gc.compressors import build_compressor, takes_ratio
    from lightning_gc.engine import EngineConfig, GCEngine
    from lightning_gc.engine.session import StepSession, session_comm_hook

    torch.manual_seed(11)
    np.random.seed(12)
    random.seed(13)
    model = _Net()
    ddp = DDP(model, bucket_cap_mb=0.002)
    has_ratio = takes_ratio(comp_name)
    engine = GCEngine(build_compressor(comp_name, ratio=0.25 if has_ratio else None),
                      EngineConfig(warmup_steps=1, min_compress_numel=64, seed=3), list(model.named_parameters()))
    session = StepSession(engine, skip_nonfinite=True)
    ddp.register_comm_hook(session, session_comm_hook)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    out: dict = {"losses": []}
    for step in range(PRE):  # a non-finite step before the capture: skipped_steps = 1 to restore
        out["losses"].append(_train_step(ddp, opt, sched, session, rank, step, nan=step == 2 and rank == 1))
    if explore:
        snap = TrainingSnapshot.capture(model, [opt], [sched], session=session)
        out["before"] = _state(model, opt, sched, session)
        for trial, ratio in enumerate((0.5, 0.1)):
            if has_ratio:
                session.set_ratio(ratio)
            for i in range(EXPLORE):  # the candidate's steps, one of them non-finite on rank 0
                _train_step(ddp, opt, sched, session, rank, 100 + 10 * trial + i, nan=i == 1 and rank == 0)
            out[f"explored{trial}"] = _state(model, opt, sched, session)
            snap.restore()
            out[f"after{trial}"] = _state(model, opt, sched, session)
    for step in range(PRE, PRE + AFTER):
        out["losses"].append(_train_step(ddp, opt, sched, session, rank, step, nan=False))
    out["final"] = _state(model, opt, sched, session)
    engine.close()
    return out


def _scenarios(rank: int, ws: int) -> dict:
    # one spawn for all four runs (the spawn and imports dominate)
    return {(name, explore): _run(rank, ws, name, explore)
            for name in ("randomk", "qsgd") for explore in (False, True)}


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_scenarios, 2, timeout=280)


# what an exploration must change, so that "restored" is not vacuous (per compressor)
CHANGED = {"params_and_buffers", "grads", "optimizer", "scheduler", "lr", "engine_step", "error_memory",
           "gain_ewma", "totals", "last_stats", "hook_calls", "skipped_steps", "rng_torch", "rng_numpy",
           "rng_python"}


@pytest.mark.parametrize("name", ["randomk", "qsgd"])
def test_every_claimed_component_is_restored_after_each_exploration(runs, name):
    for rank, res in enumerate(runs):
        r = res[(name, True)]
        before = r["before"]
        assert before["skipped_steps"] == 1 and before["error_memory"], "the capture holds carried state"
        assert any(float(v.abs().max()) > 0 for v in before["error_memory"].values())
        for trial in (0, 1):
            explored, after = r[f"explored{trial}"], r[f"after{trial}"]
            changed = set(_differing(before, explored))
            want = CHANGED | ({"ratio"} if name == "randomk" else set())
            assert want <= changed, (rank, trial, sorted(want - changed))
            assert explored["skipped_steps"] == 2  # the non-finite candidate step was skipped
            assert _differing(before, after) == [], (rank, trial, _differing(before, after))


TIMES = ("compress_time_s", "comm_time_s", "exchange_comm_s", "exchange_comm_mean_s", "predicted_comm_s", "probe_s",
         "engine_own_s", "control_comm_s", "overhead_s")


def _untimed(state: dict) -> dict:
    """Two separate runs measure different seconds: compare everything else."""
    out = dict(state)
    for key in ("totals", "last_stats"):
        out[key] = {k: v for k, v in state[key].items() if k not in TIMES}
    return out


@pytest.mark.parametrize("name", ["randomk", "qsgd"])
def test_run_that_explored_continues_bit_for_bit_like_one_that_never_did(runs, name):
    for rank, res in enumerate(runs):
        ref, exp = res[(name, False)], res[(name, True)]
        assert np.array_equal(exp["losses"], ref["losses"], equal_nan=True)
        diff = _differing(_untimed(ref["final"]), _untimed(exp["final"]))
        assert diff == [], (rank, diff)
    # and the ranks agree with each other
    # and the ranks hold the same parameters and optimizer state (BatchNorm's running statistics are
    # each rank's own until DDP broadcasts rank 0's at the next forward)
    a, b = runs[0][(name, True)]["final"], runs[1][(name, True)]["final"]
    assert _equal({k: v for k, v in a["params_and_buffers"].items() if not k.startswith("bn.running")
                   and not k.endswith("num_batches_tracked")},
                  {k: v for k, v in b["params_and_buffers"].items() if not k.startswith("bn.running")
                   and not k.endswith("num_batches_tracked")})
    assert _equal(a["optimizer"], b["optimizer"])


# ---------------------------------------------------------------------------------------------- one process
def _grads_state(model):
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def test_gradients_none_and_present_are_restored_both_ways_and_snapshot_survives_two_restores():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5), torch.nn.Linear(5, 3))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.5, total_steps=50)
    x = torch.randn(7, 6)
    for _ in range(2):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        sched.step()
    model[2].bias.grad = None  # at capture: one gradient absent, the others present
    snap = TrainingSnapshot.capture(model, [opt], [sched])
    want_params = {k: v.clone() for k, v in model.state_dict().items()}
    want_grads = _grads_state(model)
    want_opt = copy.deepcopy(opt.state_dict())
    want_sched = copy.deepcopy(sched.state_dict())
    for _ in range(2):  # the second restore checks that the first did not hand the snapshot's tensors out
        opt.zero_grad(set_to_none=True)
        model(x * 3).pow(2).mean().backward()  # now bias has a gradient ...
        model[0].weight.grad = None  # ... and this one has none
        opt.step()
        sched.step()
        snap.restore()
        assert _equal({k: v for k, v in model.state_dict().items()}, want_params)
        assert _equal(_grads_state(model), want_grads)
        assert model[2].bias.grad is None and model[0].weight.grad is not None
        assert _equal(copy.deepcopy(opt.state_dict()), want_opt)
        assert _equal(copy.deepcopy(sched.state_dict()), want_sched)
        assert [g["lr"] for g in opt.param_groups] == want_sched["_last_lr"]
    # after a restore, training goes on exactly as from the capture (Adam's moments and step count)
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()
    after_restore = {k: v.clone() for k, v in model.state_dict().items()}
    snap.restore()
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()
    assert _equal(after_restore, {k: v for k, v in model.state_dict().items()})


def test_every_global_rng_is_restored():
    """Each generator separately: the draws after restore repeat the draws after capture."""
    module = torch.nn.Linear(2, 2)
    snap = TrainingSnapshot.capture(module)
    first = (torch.rand(5), np.random.rand(5), [random.random() for _ in range(5)])
    snap.restore()
    again = (torch.rand(5), np.random.rand(5), [random.random() for _ in range(5)])
    assert torch.equal(first[0], again[0]), "torch CPU generator"
    assert np.array_equal(first[1], again[1]), "numpy generator"
    assert first[2] == again[2], "python random"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_rng_is_restored_when_initialised():
    torch.cuda.init()
    module = torch.nn.Linear(2, 2).cuda()
    snap = TrainingSnapshot.capture(module)
    first = [torch.rand(5, device=f"cuda:{i}") for i in range(torch.cuda.device_count())]
    snap.restore()
    again = [torch.rand(5, device=f"cuda:{i}") for i in range(torch.cuda.device_count())]
    for a, b in zip(first, again):
        assert torch.equal(a, b)


def test_structure_change_is_refused():
    module = torch.nn.Sequential(torch.nn.Linear(2, 2))
    snap = TrainingSnapshot.capture(module)
    module.add_module("extra", torch.nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match="state_dict keys changed during exploration"):
        snap.restore()
