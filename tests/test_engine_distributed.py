"""Multi-process oracles for the engine under real DDP on gloo.

Every rank trains the same model on *rank-dependent* data, so a missing or wrong reduction shows.
Each rank also computes its own local gradient with a hook-free replica; all local gradients are
all-gathered, and the test recomputes, independently of the engine's exchange code, what the mean
gradient and every rank's error memory must be. Then it checks that

* the gradient DDP hands the optimizer equals that reference,
* this rank's error memory equals its error-fed input minus what it transmitted,
* all ranks hold bit-identical parameters after every step,
* ``dense`` is bit-identical to DDP without a hook, Top-k at ratio 1.0 matches it,
* a non-finite gradient on one rank is agreed on by all and leaves error memory untouched.
"""

from __future__ import annotations

import copy

import pytest
import torch
from dist_harness import gather_all, run_distributed
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_gc.compressors import GroupContext, build_compressor, ratio_to_k, takes_ratio
from lightning_gc.engine import EngineConfig, GCEngine, gc_comm_hook

STEPS = 4


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(24, 64), torch.nn.Tanh(), torch.nn.Linear(64, 48), torch.nn.Tanh(), torch.nn.Linear(48, 5)
    )


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * rank + step)
    # rank-dependent scale, so a missing mean shows; it changes with the step so that no rank (in
    # particular not the last one) has the largest gradients at every step, at 2 ranks too
    x = torch.randn(16, 24, generator=g) * (1.0, 2.5, 0.7, 1.6, 1.2)[(rank + step) % 5]
    y = torch.randint(0, 5, (16,), generator=g)
    return x, y


def _loss(m, x, y):
    return torch.nn.functional.cross_entropy(m(x), y)



def _reference_mean(name: str, ps: list[torch.Tensor], ctxs: list[GroupContext], ratio, got: torch.Tensor):
    """Mean of the ranks' compressed contributions and each rank's contribution, computed without
    the compressor or the exchange (``got``, the engine's mean, is used only where the algorithm
    is random: RandomK's index set is read from it and then checked, QSGD's mean is bounded)."""
    ws = len(ps)
    n = ps[0].numel()
    if name in ("topk", "lwtopk", "mstopk"):  # MSTopk: exactly torch.topk's set on tie-free data
        outs = []
        for p, c in zip(ps, ctxs):
            d = torch.zeros_like(p)
            off = 0
            segs = c.segments if name == "lwtopk" else (n,)
            for seg in segs:
                part = p[off:off + seg]
                idx = torch.topk(part.abs(), ratio_to_k(ratio, seg)).indices + off
                d[idx] = p[idx]
                off += seg
            outs.append(d)
        return sum(outs) / ws, outs
    if name == "signsgd":
        signs = [torch.where(p >= 0, 1.0, -1.0) for p in ps]
        scale = sum(p.abs().mean() for p in ps) / ws
        own = [s * p.abs().mean() for s, p in zip(signs, ps)]
        return torch.sign(sum(signs)) * scale, own
    if name == "efsignsgd":
        own = [torch.where(p >= 0, 1.0, -1.0) * p.abs().mean() for p in ps]
        return sum(own) / ws, own
    if name == "randomk":
        # the support of the mean is the shared random index set: exactly k positions, and the
        # values there are the hand average of every rank's p scaled by n/k (unbiased). A rank
        # using other indices would be missing from these values (and its error memory, checked
        # by the caller, would be wrong).
        k = ratio_to_k(ratio, n)
        support = torch.nonzero(got, as_tuple=False).flatten()
        assert support.numel() == k, f"randomk: {support.numel()} non-zero elements, want k={k}"
        own = []
        for p in ps:
            d = torch.zeros_like(p)
            d[support] = p[support] * (n / k)
            own.append(d)
        return sum(own) / ws, own
    if name == "qsgd":
        # every rank's value is its p rounded to one of the two adjacent levels of norm/s (s = 7,
        # bucket 512): the mean is within the mean of the level spacings of the true mean
        s, bs = 7, 512
        bound = torch.zeros(n)
        for p in ps:
            for b0 in range(0, n, bs):
                bound[b0:b0 + bs] += float(p[b0:b0 + bs].double().norm()) / s / ws
        true = sum(ps) / ws
        err = (got - true).abs()
        assert bool((err <= bound * (1 + 1e-5) + 1e-7).all()), f"qsgd: error {float((err - bound).max()):.3g} over bound"
        assert float(err.max()) > 0, "qsgd: the mean is exact, nothing was quantised"
        return got, None
    if name in ("fp16", "bf16"):  # every element rounded to the half-precision type
        dtype = torch.float16 if name == "fp16" else torch.bfloat16
        own = [p.to(dtype).float() for p in ps]
        return sum(own) / ws, own
    raise AssertionError(f"no reference for {name}")


def _check_compressor(rank: int, ws: int, name: str, ratio, ef: bool, warmup: int) -> dict:
    model = _model()
    replica = copy.deepcopy(model)
    ddp = DDP(model, bucket_cap_mb=0.004)  # several buckets: groups span buckets
    comp = build_compressor(name, ratio=ratio if takes_ratio(name) else None)
    cfg = EngineConfig(warmup_steps=warmup, error_feedback=ef, min_compress_numel=100, seed=5)
    engine = GCEngine(comp, cfg, list(model.named_parameters()))
    ddp.register_comm_hook(engine, gc_comm_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    names = [n for n, _ in model.named_parameters()]
    ref_mem = {}  # (rank, gid) -> tensor, for all ranks
    worst_grad, worst_mem, worst_norm = 0.0, 0.0, 0.0
    gains: list[tuple] = []  # (step, engine's gain, engine's ewma, reference gain, reference ewma)
    ewma = None
    exchange: list[tuple] = []  # per step: this rank's time in the exchanges, the closing report's mean over ranks
    for step in range(STEPS):
        replica.load_state_dict(model.state_dict())
        x, y = _batch(rank, step)
        if step != 2:  # a value for this step's closing report; none before step 2 (so that mean is None)
            engine.carry_wall(0.25 * (rank + 1) + step)
        replica.zero_grad()
        _loss(replica, x, y).backward()
        local = {n: p.grad.detach().reshape(-1).clone() for n, p in replica.named_parameters()}
        all_local = {n: gather_all(local[n], ws) for n in names}
        opt.zero_grad()
        _loss(ddp, x, y).backward()
        got = {n: p.grad.detach().reshape(-1).clone() for n, p in model.named_parameters()}
        dense_step = step < warmup
        sent2 = p2 = 0.0  # Σ over ranks and lossy groups of ‖C(p_r)‖² and ‖p_r‖² (this step)
        for g in engine.plan.groups:
            gs = [torch.cat([all_local[n][r] for n in g.names]) for r in range(ws)]
            got_flat = torch.cat([got[n] for n in g.names])
            if g.exact or dense_step:
                ref = sum(gs) / ws
            else:
                ps = [gs[r] + ref_mem.get((r, g.gid), 0) if ef else gs[r] for r in range(ws)]
                ctxs = [GroupContext(step=step, rank=r, world_size=ws, segments=g.numels, group_id=g.gid, seed=5)
                        for r in range(ws)]
                ref, own = _reference_mean(name, ps, ctxs, ratio, got_flat)
                if own is not None:
                    sent2 += sum(float(o.double().pow(2).sum()) for o in own)
                    p2 += sum(float(p.double().pow(2).sum()) for p in ps)
                if ef:
                    for r in range(ws):
                        ref_mem[(r, g.gid)] = ps[r] - own[r]
                    worst_mem = max(worst_mem, float((engine.memory[g.gid] - ref_mem[(rank, g.gid)]).abs().max()))
            worst_grad = max(worst_grad, float((got_flat - ref).abs().max() / (ref.abs().max() + 1e-12)))
        if not dense_step and p2 > 0:
            # the gain the engine reports at this step describes this step (its sums travel in the
            # step's closing report); the EWMA is updated with it
            ref_gain = sent2 / p2
            b = cfg.gain_ewma_beta
            ewma = ref_gain if ewma is None else b * ewma + (1 - b) * ref_gain
            gains.append((step, engine.last_step.gain, engine.last_step.gain_ewma, ref_gain, ewma))
        exchange.append((engine.last_step.exchange_comm_s, engine.last_step.exchange_comm_mean_s,
                         engine.last_step.carried_wall_mean_s))
        opt.step()
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        assert all(torch.equal(flat, o) for o in gather_all(flat, ws)), f"{name}: ranks diverged at step {step}"
        true_norm = sum(float(m.double().pow(2).sum()) for m in engine.memory.values()) ** 0.5
        worst_norm = max(worst_norm, abs(engine.last_step.error_norm - true_norm) / (true_norm + 1e-12))
    return {"grad": worst_grad, "mem": worst_mem, "norm": worst_norm, "steps": engine.step, "calls": engine.hook_calls,
            "gains": gains, "exchange": exchange}


CASES = [
    ("topk", 0.1, True), ("lwtopk", 0.1, True), ("mstopk", 0.1, True), ("randomk", 0.2, False),
    ("randomk", 0.2, True), ("qsgd", None, False), ("signsgd", None, False), ("efsignsgd", None, True),
    ("fp16", None, False), ("bf16", None, False),
]


def _all_cases(rank: int, ws: int, cases) -> dict:
    return {f"{n}-{r}-{ef}": _check_compressor(rank, ws, n, r, ef, warmup=1) for n, r, ef in cases}


@pytest.mark.parametrize("ws,cases", [(2, CASES), (3, [c for c in CASES if c[0] in ("topk", "signsgd", "qsgd", "randomk")])])
def test_aggregate_and_error_memory_match_reference(ws, cases):
    results = run_distributed(_all_cases, ws, cases, timeout=300)
    for key in results[0]:
        for r in range(ws):
            res = results[r][key]
            tol = 1e-2 if key.startswith(("fp16", "bf16")) else 1e-5
            assert res["grad"] <= tol, f"{key} rank {r}: relative gradient error {res['grad']:.3g}"
            assert res["mem"] <= 1e-5, f"{key} rank {r}: error-memory mismatch {res['mem']:.3g}"
            assert res["norm"] <= 1e-3, f"{key} rank {r}: logged error norm off by {res['norm']:.3g}"
            assert res["steps"] == STEPS and res["calls"] > STEPS  # several buckets per step
            if key.startswith(("topk", "lwtopk", "mstopk", "randomk", "signsgd", "efsignsgd")):
                _check_gains(key, r, res["gains"])
        # the exchange time's mean over ranks (auto's exchange test reads it): the same on every rank, the
        # mean of the ranks' own times, and none on the dense warm-up step
        per_step = list(zip(*(results[r][key]["exchange"] for r in range(ws))))
        assert all(own[1] is None and own[2] is None for own in per_step[0]), key  # a dense step drops the value
        for step, own in enumerate(per_step[1:], start=1):
            assert len({o[1] for o in own}) == 1, (key, step, own)
            assert own[0][1] == pytest.approx(sum(o[0] for o in own) / ws, rel=1e-9, abs=1e-12), (key, step, own)
            # the value each rank carried into the step (GCEngine.carry_wall), averaged over the ranks; the
            # one carried into the dense step 0 went nowhere, and step 2 had none
            want = None if step == 2 else sum(0.25 * (r + 1) + step for r in range(ws)) / ws
            assert all(o[2] == want for o in own), (key, step, own)


def _check_gains(key: str, rank: int, gains: list[tuple]) -> None:
    """gain = Σ_r‖C(p_r)‖² / Σ_r‖p_r‖² of the same compressed step, identical on all ranks."""
    assert len(gains) == STEPS - 1, gains  # warm-up 1
    for step, gain, ewma, want, want_ewma in gains:
        assert gain == pytest.approx(want, rel=1e-5), f"{key} rank {rank} step {step}: gain {gain} != {want}"
        assert ewma == pytest.approx(want_ewma, rel=1e-5), f"{key} rank {rank} step {step}: ewma {ewma} != {want_ewma}"
    assert all(g[1] > 0 for g in gains) and any(abs(g[1] - 1) > 1e-3 for g in gains), gains


def _parity_with_ddp(rank: int, ws: int) -> dict:
    out = {}
    for name, ratio in (("dense", None), ("topk", 1.0)):
        plain_model, gc_model = _model(), _model()
        plain = DDP(plain_model, bucket_cap_mb=0.004)
        gc = DDP(gc_model, bucket_cap_mb=0.004)
        engine = GCEngine(build_compressor(name, ratio=ratio), EngineConfig(warmup_steps=1, min_compress_numel=0),
                          list(gc_model.named_parameters()))
        gc.register_comm_hook(engine, gc_comm_hook)
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (plain_model, gc_model)]
        worst, exact = 0.0, True
        for step in range(STEPS):
            x, y = _batch(rank, step)
            for m, o in zip((plain, gc), opts):
                o.zero_grad()
                _loss(m, x, y).backward()
            for a, b in zip(plain_model.parameters(), gc_model.parameters()):
                exact &= torch.equal(a.grad, b.grad)
                worst = max(worst, float((a.grad - b.grad).abs().max()))
                b.grad.copy_(a.grad)  # keep trajectories identical so each step compares like with like
            for o in opts:
                o.step()
        out[name] = {"exact": exact, "worst": worst, "hook": gc._get_ddp_logging_data().get("comm_hook"),
                     "compressed_steps": engine.totals()["compressed_steps"]}
    return out


def test_dense_is_bit_identical_to_ddp_and_topk_ratio_one_matches():
    for res in run_distributed(_parity_with_ddp, 2):
        assert res["dense"]["exact"], res
        assert res["dense"]["hook"] == "gc_comm_hook"
        assert res["topk"]["worst"] < 1e-6, res
        assert res["topk"]["compressed_steps"] == STEPS - 1


def _dense_carry(rank: int, ws: int, device: str = "cpu") -> dict:
    """Dense modes with GCEngine.enable_dense_carry: the value each rank carried rides in the first
    bucket. The gradients must still equal plain DDP's (fp32: bit for bit; fp16: the hook's
    rounding), and every rank must read the mean of the ranks' values. ``device="cuda"``: the same
    on the GPU (tests/test_cuda.py), every rank on ``cuda:0``."""
    out = {}
    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    for mode in ("fp32", "fp16"):
        plain_model, gc_model = _model().to(device), _model().to(device)
        ids = [0] if cuda else None
        plain = DDP(plain_model, device_ids=ids, bucket_cap_mb=0.004)
        gc = DDP(gc_model, device_ids=ids, bucket_cap_mb=0.004)  # several buckets: only the first carries
        engine = GCEngine(build_compressor("topk", ratio=0.1), EngineConfig(warmup_steps=1, min_compress_numel=0),
                          list(gc_model.named_parameters()))
        gc.register_comm_hook(engine, gc_comm_hook)
        engine.set_dense_mode(mode)
        engine.enable_dense_carry()
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (plain_model, gc_model)]
        worst, exact, carried, payload = 0.0, True, [], []
        for step in range(STEPS):
            if step != 2:  # none before step 2: the mean is None on every rank
                engine.carry_wall(0.25 * (rank + 1) + step)
            x, y = (t.to(device) for t in _batch(rank, step))
            for m, o in zip((plain, gc), opts):
                o.zero_grad()
                _loss(m, x, y).backward()
            for a, b in zip(plain_model.parameters(), gc_model.parameters()):
                want = a.grad if mode == "fp32" or step < 1 else a.grad.to(torch.float16).float()
                exact &= torch.equal(a.grad, b.grad)
                worst = max(worst, float((want - b.grad).abs().max() / (want.abs().max() + 1e-12)))
                b.grad.copy_(a.grad)
            engine.before_optimizer_step()
            for o in opts:
                o.step()
            engine.after_optimizer_step()
            carried.append(engine.last_step.carried_wall_mean_s)
            payload.append(engine.last_step.bytes_payload)
        out[mode] = {"exact": exact, "worst": worst, "carried": carried, "payload": payload,
                     "numel": sum(p.numel() for p in gc_model.parameters()),
                     "compressed_steps": engine.totals()["compressed_steps"]}
    return out


@pytest.mark.parametrize("ws", [2, 3])
def test_a_dense_step_carries_the_value_in_its_first_bucket(ws):
    check_dense_carry(run_distributed(_dense_carry, ws), ws)


def check_dense_carry(results: list[dict], ws: int) -> None:
    """The oracle of test_a_dense_step_carries_the_value_in_its_first_bucket (shared with tests/test_cuda.py)."""
    for r, res in enumerate(results):
        # the carried element leaves the gradient DDP's mean: bit for bit at 2 ranks; at 3 the first bucket
        # is one element longer, so gloo's ring cuts it into other chunks and may sum an element's three
        # values in another order (last-bit differences, as another bucket layout gives in DDP itself)
        if ws == 2:
            assert res["fp32"]["exact"], (r, res["fp32"]["worst"])
        assert res["fp32"]["worst"] < 1e-6, (r, res["fp32"]["worst"])
        assert res["fp16"]["worst"] < 2e-3, (r, res["fp16"]["worst"])
        for mode, rel in (("fp32", 1e-6), ("fp16", 2e-3)):
            assert res[mode]["compressed_steps"] == 0
            for step, got in enumerate(res[mode]["carried"]):
                if step == 2:
                    assert got is None, (mode, r, step, got)
                else:
                    want = sum(0.25 * (k + 1) + step for k in range(ws)) / ws
                    assert got == pytest.approx(want, rel=rel), (mode, r, step, got, want)
        assert res["fp16"]["carried"] == results[0]["fp16"]["carried"]  # identical on every rank
        # one element more per step, in the first bucket only (step 0: the fp32 warm-up)
        n = res["fp32"]["numel"] + 1
        assert res["fp32"]["payload"] == [4 * n] * STEPS
        assert res["fp16"]["payload"] == [4 * n] + [2 * n] * (STEPS - 1)


def _nonfinite(rank: int, ws: int) -> dict:
    model = _model()
    ddp = DDP(model)
    engine = GCEngine(build_compressor("topk", ratio=0.1), EngineConfig(warmup_steps=0, min_compress_numel=100),
                      list(model.named_parameters()))
    ddp.register_comm_hook(engine, gc_comm_hook)
    flags, finite, mem_unchanged = [], [], None
    for step in range(3):
        x, y = _batch(rank, step)
        if step == 1 and rank == 1:
            x[0, 0] = float("nan")
        before = {k: v.clone() for k, v in engine.memory.items()}
        model.zero_grad()
        _loss(ddp, x, y).backward()
        flags.append(engine.last_step_nonfinite)
        finite.append(all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()))
        if step == 1:
            mem_unchanged = all(torch.equal(before[k], engine.memory[k]) for k in before) and bool(before)
    return {"flags": flags, "finite": finite, "mem_unchanged": mem_unchanged,
            "mem_finite": all(bool(torch.isfinite(m).all()) for m in engine.memory.values()),
            "nonfinite_steps": engine.totals()["nonfinite_steps"]}


def test_nonfinite_gradient_on_one_rank_is_agreed_and_memory_not_poisoned():
    for res in run_distributed(_nonfinite, 2):
        assert res["flags"] == [False, True, False], res
        assert res["finite"] == [True, False, True], res
        assert res["mem_unchanged"] and res["mem_finite"], res
        assert res["nonfinite_steps"] == 1
