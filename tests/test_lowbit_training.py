"""The low-bit ring allreduce over many draws, and in a Lightning run (``compressor="lowbit"``).

Oracles: the exact mean over ranks, which the average of the ring's result over many steps (fresh
dither each) must approach within a bound from the sample variance; in training, the ranks'
parameters equal bit for bit and the loss falls. The replay against a float64 reference, the
error bound and the byte counts are in tests/test_lowbit.py.
"""

from __future__ import annotations

import math

import torch
from dist_harness import run_distributed
from test_lowbit import SEED, _inputs

from lightning_gc.comm.exchange import ExchangeTimes, Timer
from lightning_gc.compressors import GroupContext, build_compressor
from lightning_gc.exchanges import make_exchange

STAT_N, STAT_D, STAT_SEEDS = 3, 96, 200


def _stats(rank: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    comp = build_compressor("lowbit", args={"bits": 4, "block_size": 32})
    ex = make_exchange(comp, "auto")
    p = _inputs(n, STAT_D, 99)[rank]
    total = torch.zeros(STAT_D, dtype=torch.float64)
    total2 = torch.zeros(STAT_D, dtype=torch.float64)
    for seed in range(STAT_SEEDS):
        ctx = GroupContext(step=seed, rank=rank, world_size=n, segments=(STAT_D,), group_id=0, seed=SEED)
        m = ex.run(p.clone(), ctx, Timer(torch.device("cpu"), ExchangeTimes()))[0].double()
        total += m
        total2 += m * m
    return total, total2


def test_result_is_unbiased_over_draws():
    """Average of the ring's mean over 200 steps (fresh dither each) → the exact mean: every element
    within 5 standard errors (sample variance), and the standardised errors average near 0."""
    total, total2 = run_distributed(_stats, STAT_N, timeout=300)[0]
    k = STAT_SEEDS
    avg = total / k
    var = (total2 / k - avg * avg).clamp_min(0) * k / (k - 1)
    se = (var / k).sqrt()
    exact = sum(x.double() for x in _inputs(STAT_N, STAT_D, 99)) / STAT_N
    fixed = se == 0  # an element that is its block's maximum at every hop is rounded exactly
    assert all(abs(float(e)) <= 1e-5 for e in (avg - exact)[fixed])
    assert int(fixed.sum()) < STAT_D // 4
    z = (avg - exact)[~fixed] / se[~fixed]
    assert float(z.abs().max()) < 5.0, float(z.abs().max())
    assert abs(float(z.mean())) < 5.0 / math.sqrt(z.numel()), float(z.mean())


def test_trainer_on_two_ranks_trains_with_identical_ranks(tmp_path):
    import lightning as L
    from lit_models import ReportCallback, TinyClassifier, make_loader

    from lightning_gc import GCStrategy

    out = tmp_path / "report"
    out.mkdir()
    trainer = L.Trainer(
        strategy=GCStrategy(compressor="lowbit", compressor_args={"bits": 4}, start_method="spawn"),
        accelerator="cpu", devices=2, logger=False, max_epochs=2, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path),
        callbacks=[ReportCallback(str(out))],
    )
    model = TinyClassifier()
    loader = make_loader()
    x, y = loader.dataset.tensors
    with torch.no_grad():
        before = float(torch.nn.functional.cross_entropy(model(x), y))
    trainer.fit(model, loader)
    reports = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for k in reports[0]["params"]:
        assert torch.equal(reports[0]["params"][k], reports[1]["params"][k]), k
    model.load_state_dict({k: v for k, v in reports[0]["params"].items()}, strict=False)
    with torch.no_grad():
        after = float(torch.nn.functional.cross_entropy(model(x), y))
    assert after < 0.7 * before, (before, after)
    totals = reports[0]["totals"]
    assert reports[0]["comm_hook"] and totals is not None
