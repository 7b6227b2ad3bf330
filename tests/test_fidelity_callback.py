"""GradientFidelity (lightning_gc.callbacks.fidelity) against hand-computed references.

Two gloo ranks train a one-matrix linear model on rank-dependent data with a real Lightning
Trainer. Every rank records its batches and its parameters before each step; the parent rebuilds,
by hand, each rank's MSE gradient (closed form), the exact mean, the mean of every rank's own
top-k (``torch.topk`` on magnitudes, not the library's selection) and a hand-written AdamW step on the
exact mean, and checks the callback's figures against them:

* plain Lightning DDP: the gradient and the update are exact (errors ~0, cosines 1);
* Top-k without error feedback under SGD: ``grad_rel_error`` equals ``‖mean topk − mean‖²/‖mean‖²``
  and, SGD being linear, ``update_cos`` equals ``grad_cos``;
* Top-k under AdamW: ``update_cos`` equals the cosine between the real update and a hand-written
  AdamW step (moments fed the exact mean every step), so the shadow optimizer is checked too.
"""

from __future__ import annotations

import math

import pytest
import torch
from dist_harness import run_distributed

from lightning_gc import GCStrategy
from lightning_gc.callbacks import GradientFidelity

pytestmark = pytest.mark.slow

IN, OUT, BATCH, STEPS = 64, 4, 8, 5
RATIO = 1 / 16  # k = 16 of the 256 weights, exactly
WINDOW = 2  # window cosines at the ends of steps 1 and 3
LR_SGD, LR_ADAM, BETAS, EPS, WD = 0.05, 0.01, (0.9, 0.95), 1e-8, 0.1


def test_invalid_settings_are_refused():
    with pytest.raises(ValueError, match="every_n_steps=0 must be an integer >= 1"):
        GradientFidelity(every_n_steps=0, update=False)
    with pytest.raises(ValueError, match="every_n_steps=3 with update=True"):
        GradientFidelity(every_n_steps=3)
    with pytest.raises(ValueError, match="clip_norm=-1.0 must be a norm > 0"):
        GradientFidelity(clip_norm=-1.0)
    with pytest.raises(ValueError, match="window=-2 must be an integer >= 0"):
        GradientFidelity(window=-2)
    with pytest.raises(ValueError, match="per_parameter=True with update=False"):
        GradientFidelity(update=False, per_parameter=True)


def _fit(rank: int, ws: int, strategy_name: str, optimizer: str) -> dict:
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    class Linear(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(7)
            self.w = torch.nn.Linear(IN, OUT, bias=False)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.w(x), y)

        def configure_optimizers(self):
            if optimizer == "adamw":
                return torch.optim.AdamW(self.parameters(), lr=LR_ADAM, betas=BETAS, eps=EPS, weight_decay=WD)
            return torch.optim.SGD(self.parameters(), lr=LR_SGD)

    class Record(L.Callback):
        def __init__(self) -> None:
            self.batches, self.before = [], []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.batches.append([t.clone() for t in batch])
            self.before.append(pl_module.w.weight.detach().clone())

    g = torch.Generator().manual_seed(100 + rank)  # rank-dependent inputs, scales and targets
    x = torch.randn(BATCH * STEPS, IN, generator=g) * (1.0 + 0.5 * rank)
    y = torch.randn(BATCH * STEPS, OUT, generator=g) + rank
    loader = DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)
    strategy = ("ddp" if strategy_name == "ddp" else
                GCStrategy(compressor="topk", ratio=RATIO, error_feedback=False, warmup_steps=1, min_compress_numel=16))
    fidelity, record = GradientFidelity(window=WINDOW, per_parameter=True), Record()
    model = Linear()
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=ws, max_steps=STEPS, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False, callbacks=[fidelity, record])
    trainer.fit(model, loader)
    return {"history": fidelity.history, "summary": fidelity.summary(), "batches": record.batches,
            "before": record.before, "after": model.w.weight.detach().clone()}


def _all_runs(rank: int, ws: int) -> dict:
    from test_fabric import _lightning_env

    _lightning_env(rank, ws)
    return {key: _fit(rank, ws, *key.split("/")) for key in ("ddp/sgd", "topk/sgd", "topk/adamw")}


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_all_runs, 2, timeout=240)


def _grad(w: torch.Tensor, batch) -> torch.Tensor:
    """d/dW mean((x Wᵀ − y)²), by hand, in float64."""
    x, y = (t.double() for t in batch)
    return 2.0 * (x @ w.double().T - y).T @ x / (x.shape[0] * y.shape[1])


def _topk(g: torch.Tensor, k: int) -> torch.Tensor:
    flat = g.reshape(-1)
    out = torch.zeros_like(flat)
    idx = flat.abs().topk(k).indices
    out[idx] = flat[idx]
    return out.view_as(g)


def _cos(a, b):
    return float((a * b).sum() / (a.norm() * b.norm()))


def _expected(runs, key: str):
    """Per step: (exact mean gradient, what the optimizer received, real update) from every rank's data."""
    ranks = [r[key] for r in runs]
    k = round(RATIO * IN * OUT)
    out = []
    for t in range(STEPS):
        w = ranks[0]["before"][t]
        for r in ranks:  # the replicas agree before every step
            assert torch.equal(r["before"][t], w)
        grads = [_grad(w, r["batches"][t]) for r in ranks]
        mean = sum(grads) / len(grads)
        sent = mean if key.startswith("ddp") or t == 0 else sum(_topk(g, k) for g in grads) / len(grads)
        after = ranks[0]["before"][t + 1] if t + 1 < STEPS else ranks[0]["after"]
        out.append((mean, sent, (after - w).double(), w.double()))
    return out


def test_exact_ddp_measures_no_error(runs):
    for r in runs:
        hist = r["ddp/sgd"]["history"]
        assert len(hist) == STEPS
        for h in hist:
            assert h["grad_rel_error"] < 1e-10 and abs(h["grad_cos"] - 1) < 1e-9, h
            assert abs(h["grad_norm_ratio"] - 1) < 1e-6 and abs(h["update_cos"] - 1) < 1e-6, h
            assert h["update_rel_error"] < 1e-8, h


def test_topk_gradient_error_equals_the_hand_reference(runs):
    exp = _expected(runs, "topk/sgd")
    for r in runs:
        hist = r["topk/sgd"]["history"]
        assert len(hist) == STEPS
        for t, (h, (mean, sent, real_u, _)) in enumerate(zip(hist, exp)):
            want = float((sent - mean).pow(2).sum() / mean.pow(2).sum())
            assert h["grad_rel_error"] == pytest.approx(want, rel=1e-5, abs=1e-9), (t, h, want)
            assert h["grad_cos"] == pytest.approx(_cos(sent, mean), rel=1e-6), (t, h)
            assert h["grad_norm_ratio"] == pytest.approx(float(sent.norm() / mean.norm()), rel=1e-6)
            # SGD is linear: the real update is −lr·sent and the shadow's −lr·mean
            assert torch.allclose(real_u, -LR_SGD * sent, atol=1e-6)
            assert h["update_cos"] == pytest.approx(_cos(sent, mean), rel=1e-5), (t, h)
        for end in (1, 3):  # Σ over the window's two steps, by hand; nothing at the other steps
            sums = [sum(exp[t][i] for t in (end - 1, end)) for i in (0, 1)]
            assert hist[end]["grad_window_cos"] == pytest.approx(_cos(sums[1], sums[0]), rel=1e-6), (end, hist[end])
            assert hist[end]["update_window_cos"] == pytest.approx(_cos(sums[1], sums[0]), rel=1e-5), end
        assert all("grad_window_cos" not in hist[t] for t in (0, 2, 4))
        assert hist[0]["grad_rel_error"] < 1e-10  # the dense warm-up step
        assert min(h["grad_rel_error"] for h in hist[1:]) > 0.05  # 1/16 of the weights really is lossy
    # one parameter: its per-parameter means are the run's, and it holds all of the energy
    per = runs[0]["topk/sgd"]["summary"]["per_parameter"]
    assert list(per) == ["w.weight"] and per["w.weight"]["steps"] == STEPS
    assert per["w.weight"]["energy_share"] == pytest.approx(1.0)
    want = sum(_cos(sent, mean) for mean, sent, _, _ in exp) / STEPS
    assert per["w.weight"]["grad_cos"] == pytest.approx(want, rel=1e-6)
    s = runs[0]["topk/sgd"]["summary"]
    assert s["steps"] == STEPS and s["grad_rel_error"] == pytest.approx(
        sum(h["grad_rel_error"] for h in runs[0]["topk/sgd"]["history"]) / STEPS)


def test_adamw_shadow_equals_a_hand_written_adamw_on_the_exact_mean(runs):
    exp = _expected(runs, "topk/adamw")
    b1, b2 = BETAS
    shadow_steps = []
    m = torch.zeros(OUT, IN, dtype=torch.float64)
    v = torch.zeros(OUT, IN, dtype=torch.float64)
    for r in runs:
        assert len(r["topk/adamw"]["history"]) == STEPS
    for t, (mean, _sent, real_u, w) in enumerate(exp):
        m = b1 * m + (1 - b1) * mean
        v = b2 * v + (1 - b2) * mean * mean
        mhat, vhat = m / (1 - b1 ** (t + 1)), v / (1 - b2 ** (t + 1))
        shadow_u = -LR_ADAM * WD * w - LR_ADAM * mhat / (vhat.sqrt() + EPS)
        shadow_steps.append(shadow_u)
        for r in runs:
            h = r["topk/adamw"]["history"][t]
            assert h["update_cos"] == pytest.approx(_cos(real_u, shadow_u), abs=2e-5), (t, h)
            want = float((real_u - shadow_u).pow(2).sum() / shadow_u.pow(2).sum())
            assert h["update_rel_error"] == pytest.approx(want, rel=1e-3, abs=1e-6), (t, h, want)
    for end in (1, 3):  # the window: the real displacement over two steps against the sum of the shadow's
        real = sum(exp[t][2] for t in (end - 1, end))
        want = _cos(real, shadow_steps[end - 1] + shadow_steps[end])
        for r in runs:
            assert r["topk/adamw"]["history"][end]["update_window_cos"] == pytest.approx(want, abs=2e-5), end
    # under Adam the per-coordinate normalisation makes the update error differ from the gradient's
    h = runs[0]["topk/adamw"]["history"][-1]
    assert not math.isclose(h["update_cos"], h["grad_cos"], rel_tol=1e-3)


def test_shadow_starts_from_the_real_state_and_never_moves_it():
    """A resumed run's optimizer already has moments: the shadow starts from a copy of them, and its
    own steps leave the real optimizer's state untouched (load_state_dict alone would share it)."""
    from lightning_gc.callbacks.fidelity import _OptimizerTrack

    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p], lr=0.1)
    p.grad = torch.tensor([1.0, -2.0, 3.0])
    opt.step()
    real = {k: v.clone() for k, v in opt.state[p].items()}
    track = _OptimizerTrack(opt, {id(p): slice(0, 3)}, with_shadow=True)
    (shadow_p,) = track.shadow.param_groups[0]["params"]
    assert torch.equal(track.shadow.state[shadow_p]["exp_avg"], real["exp_avg"])
    shadow_p.grad = torch.full((3,), 5.0)
    track.shadow.step()
    for k, v in real.items():
        assert torch.equal(opt.state[p][k], v), k
