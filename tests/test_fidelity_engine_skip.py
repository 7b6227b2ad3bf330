"""Skip and resume with carried state in the engine: Top-k with error memory, 3 gloo ranks.

* **Non-finite step on one rank** (each rank in turn): the engine flags the step on every rank, the
  step session skips the optimizer step everywhere (parameters and momentum untouched), and error
  memory is left exactly as before the step on every rank — not only on the rank that saw the NaN.
  Training then continues bit for bit like a run in which that step never happened, and within
  float tolerance like an independent simulation (all ranks' gradients recomputed here, Top-k by
  ``torch.topk``, error feedback and the mean written out; no lightning_gc code).
* **Resume with non-zero error memory**: a run checkpointed after the skipped step (engine state
  per rank through ``torch.save``, optimizer and model state), rebuilt with another DDP bucket
  layout and resumed, ends bit for bit where the uninterrupted run ends (parameters, momentum,
  every rank's own error memory).
"""

from __future__ import annotations

import io
import math

import pytest
import torch
from dist_harness import run_distributed

WS = 3
STEPS = 8
NAN_STEP = 3
RESUME_AT = 5  # checkpoint after steps 0..4 (the NaN step included), resume for 5..7
RATIO, LR, MOMENTUM = 0.1, 0.05, 0.9
MIN_COMPRESS = (100, 0)  # min_compress_numel: biases sent exactly / every tensor compressed


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(24, 64), torch.nn.Tanh(), torch.nn.Linear(64, 48), torch.nn.Tanh(), torch.nn.Linear(48, 5)
    )


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * rank + step)
    # the scale rotates with rank and step: no rank has the largest gradient at every step
    x = torch.randn(16, 24, generator=g) * (1.0, 2.5, 0.7, 1.6)[(rank + step) % 4]
    y = torch.randint(0, 5, (16,), generator=g)
    return x, y


def _loss(m, x, y):
    return torch.nn.functional.cross_entropy(m(x), y)


def _momentum(opt) -> dict:
    return {k: v["momentum_buffer"].clone() for k, v in opt.state_dict()["state"].items()
            if v.get("momentum_buffer") is not None}


class _Run:
    """Model, DDP, engine, step session and optimizer of one rank."""

    def __init__(self, bucket_cap_mb: float, state: dict | None = None, min_compress_numel: int = 100,
                 compressor: str = "topk") -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        from lightning_gc.compressors import build_compressor
        from lightning_gc.engine import EngineConfig, GCEngine
        from lightning_gc.engine.session import StepSession, session_comm_hook

        self.model = _model()
        if state is not None:
            self.model.load_state_dict(state["model"])
        self.ddp = DDP(self.model, bucket_cap_mb=bucket_cap_mb)
        built = (build_compressor("topk", ratio=RATIO) if compressor == "topk"
                 else build_compressor(compressor, args=dict(rank=2)))
        self.engine = GCEngine(built,
                               EngineConfig(plan="threshold", plan_threshold=2000,
                                            min_compress_numel=min_compress_numel,
                                            warmup_steps=1, seed=5),
                               list(self.model.named_parameters()))
        self.session = StepSession(self.engine, skip_nonfinite=True)
        self.ddp.register_comm_hook(self.session, session_comm_hook)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=LR, momentum=MOMENTUM)
        if state is not None:
            assert self.engine.load_state_dict(state["engine"]) == []  # no memory missing
            self.opt.load_state_dict(state["opt"])

    def step(self, rank: int, step: int, nan: bool) -> None:
        x, y = _batch(rank, step)
        if nan:
            x[0, 0] = float("nan")

        def closure():
            self.opt.zero_grad()
            loss = _loss(self.ddp, x, y)
            loss.backward()
            return loss

        self.session.optimizer_step(self.opt, closure, run=lambda c: self.opt.step(c))

    def checkpoint(self) -> dict:
        buf = io.BytesIO()
        torch.save({"engine": self.engine.state_dict(), "opt": self.opt.state_dict(),
                    "model": self.model.state_dict()}, buf)
        buf.seek(0)
        return torch.load(buf, weights_only=False)

    def snapshot(self) -> dict:
        return {"params": {n: p.detach().clone() for n, p in self.model.named_parameters()},
                "memory": self.engine.error_memory_by_name(), "momentum": _momentum(self.opt)}


def _train(rank: int, nan_rank: int | None, omit: int | None = None, resume_at: int | None = None,
           min_compress_numel: int = 100, compressor: str = "topk") -> dict:
    run = _Run(0.004, min_compress_numel=min_compress_numel, compressor=compressor)
    out: dict = {"groups": [(list(g.names), g.exact) for g in run.engine.plan.groups]}
    for step in range(STEPS):
        if step == omit:
            continue
        if step == resume_at:
            state = run.checkpoint()
            out["saved_memory"] = state["engine"]["memory"]
            run.engine.close()
            run = _Run(0.001, state)  # other bucket layout: memory must be keyed by name, not bucket
        nan = step == NAN_STEP and rank == nan_rank
        before = run.snapshot()
        run.step(rank, step, nan)
        if step == NAN_STEP and nan_rank is not None:
            out["flag"] = run.engine.last_step_nonfinite
            out["at_nan"] = (before, run.snapshot())
            out["nonfinite_steps"] = run.engine.totals()["nonfinite_steps"]
            out["skipped"] = run.session.skipped_steps
    out["final"] = run.snapshot()
    run.engine.close()
    return out


def _simulate(rank: int, groups, omit: int) -> dict:
    """The run without step ``omit``, from all ranks' local gradients: Top-k with error feedback
    per plan group, the mean of the sent values, SGD with momentum."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    params = dict(model.named_parameters())
    mem: dict[tuple[int, int], torch.Tensor] = {}
    for step in range(STEPS):
        if step == omit:
            continue
        local = []
        for r in range(WS):
            model.zero_grad()
            _loss(model, *_batch(r, step)).backward()
            local.append({n: p.grad.detach().reshape(-1).clone() for n, p in params.items()})
        for gi, (names, exact) in enumerate(groups):
            gs = [torch.cat([local[r][n] for n in names]) for r in range(WS)]
            if exact or step == 0:  # exact groups, and the dense warm-up step
                mean = sum(gs) / WS
            else:
                sent = []
                for r in range(WS):
                    p = gs[r] + mem.get((r, gi), 0)
                    idx = torch.topk(p.abs(), math.ceil(RATIO * p.numel())).indices
                    s = torch.zeros_like(p)
                    s[idx] = p[idx]
                    mem[(r, gi)] = p - s
                    sent.append(s)
                mean = sum(sent) / WS
            off = 0
            for n in names:
                k = params[n].numel()
                params[n].grad = mean[off:off + k].view_as(params[n]).clone()
                off += k
        opt.step()
    memory = {}
    for gi, (names, _exact) in enumerate(groups):
        if (rank, gi) in mem:
            off = 0
            for n in names:
                k = params[n].numel()
                memory[n] = mem[(rank, gi)][off:off + k]
                off += k
    return {"params": {n: p.detach().clone() for n, p in params.items()}, "memory": memory}


def _scenarios(rank: int, ws: int) -> dict:
    assert ws == WS
    out = {}
    # with exact groups (biases: a NaN reaches their summed mean on every rank), and without any
    # (every tensor compressed: only the closing report tells the other ranks)
    for mcn in MIN_COMPRESS:
        for r in range(ws):
            out[f"nan{r}", mcn] = _train(rank, nan_rank=r, min_compress_numel=mcn)
        out["omitted", mcn] = _train(rank, nan_rank=None, omit=NAN_STEP, min_compress_numel=mcn)
        out["simulated", mcn] = _simulate(rank, out["omitted", mcn]["groups"], omit=NAN_STEP)
        # lowrank: the closing report rides in the step's last message (the Q allreduce)
        for r in range(ws):
            out[f"nan{r}", mcn, "lowrank"] = _train(rank, nan_rank=r, min_compress_numel=mcn, compressor="lowrank")
        out["omitted", mcn, "lowrank"] = _train(rank, nan_rank=None, omit=NAN_STEP, min_compress_numel=mcn,
                                                compressor="lowrank")
    out["resumed"] = _train(rank, nan_rank=1, resume_at=RESUME_AT)
    return out


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_scenarios, WS, timeout=280)


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_plans_with_and_without_exact_groups(runs):
    groups = runs[0]["omitted", 100]["groups"]
    assert any(exact for _, exact in groups) and sum(not exact for _, exact in groups) >= 2
    groups = runs[0]["omitted", 0]["groups"]
    assert not any(exact for _, exact in groups) and len(groups) >= 2


@pytest.mark.parametrize("compressor", ["topk", "lowrank"])
@pytest.mark.parametrize("mcn", MIN_COMPRESS)
@pytest.mark.parametrize("nan_rank", range(WS))
def test_nonfinite_on_one_rank_skips_everywhere_and_leaves_memory_exactly(runs, nan_rank, mcn, compressor):
    """``lowrank``: the step's closing report rides in its last message (the ``Q`` allreduce), so
    the agreement on the non-finite rank travels there."""
    variant = () if compressor == "topk" else ("lowrank",)
    for rank, res in enumerate(runs):
        r = res[(f"nan{nan_rank}", mcn, *variant)]
        before, after = r["at_nan"]
        assert r["flag"] is True, (nan_rank, rank)
        assert r["skipped"] == 1 and r["nonfinite_steps"] == 1
        assert before["memory"] and any(float(v.abs().max()) > 0 for v in before["memory"].values())
        assert _same(before["memory"], after["memory"]), (nan_rank, rank, "error memory changed")
        assert _same(before["params"], after["params"]), (nan_rank, rank, "parameters changed")
        assert _same(before["momentum"], after["momentum"]), (nan_rank, rank, "momentum changed")
        # ... and training continues exactly like the run in which that step never happened
        final, ref = r["final"], res[("omitted", mcn, *variant)]["final"]
        for key in ("params", "memory", "momentum"):
            assert _same(final[key], ref[key]), (nan_rank, rank, key)


@pytest.mark.parametrize("mcn", MIN_COMPRESS)
def test_run_without_the_step_equals_the_independent_simulation(runs, mcn):
    for rank, res in enumerate(runs):
        got, sim = res["omitted", mcn]["final"], res["simulated", mcn]
        assert got["params"].keys() == sim["params"].keys()
        for n in sim["params"]:
            assert torch.allclose(got["params"][n], sim["params"][n], rtol=1e-5, atol=1e-6), n
        assert got["memory"].keys() == sim["memory"].keys() and sim["memory"]
        for n in sim["memory"]:
            assert torch.allclose(got["memory"][n], sim["memory"][n], rtol=1e-5, atol=1e-6), (rank, n)
    # error memory is each rank's own (so a resume that mixed ranks up would show)
    m0, m1 = runs[0]["omitted", mcn]["final"]["memory"], runs[1]["omitted", mcn]["final"]["memory"]
    assert any(not torch.equal(m0[n], m1[n]) for n in m0)


def test_resume_with_topk_memory_equals_the_uninterrupted_run(runs):
    saved = [res["resumed"]["saved_memory"] for res in runs]
    assert all(any(float(v.abs().max()) > 0 for v in s.values()) for s in saved)
    assert any(not torch.equal(saved[0][n], saved[1][n]) for n in saved[0])  # rank-specific memory
    for rank, res in enumerate(runs):
        final, ref = res["resumed"]["final"], res["nan1", 100]["final"]
        for key in ("params", "memory", "momentum"):
            assert _same(final[key], ref[key]), (rank, key)
