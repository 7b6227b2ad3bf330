"""DiLoCo inside real Lightning training (2 spawned CPU/gloo ranks, rank-dependent data through
DDP's sampler): parity with DDP at H = 1, no gradient traffic in inner steps, bit-identical ranks
after outer steps and evaluation on θ_outer. Resume: tests/test_diloco_lightning_resume.py;
Streaming DiLoCo and the monitor: tests/test_diloco_lightning_streaming.py."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from diloco_lit import ValLoaderClassifier, fit
from lit_models import TinyClassifier

from lightning_gc import GCStrategy

pytestmark = pytest.mark.slow


def test_h1_with_plain_outer_sgd_at_lr_1_equals_ddp(tmp_path):
    """H = 1, dense Δ, outer SGD lr 1 without momentum, inner SGD without momentum: each outer step
    is θ − mean_r(θ − θ_local,r) = θ − η·mean_r(g_r), DDP's update in real arithmetic. 16 steps."""
    ddp = fit(tmp_path / "ddp", L.pytorch.strategies.DDPStrategy(start_method="spawn"), max_epochs=4)
    diloco = fit(tmp_path / "dl", GCStrategy(sync="diloco", compressor="dense", diloco_inner_steps=1,
                                              diloco_outer_args={"lr": 1.0}, start_method="forkserver"), max_epochs=4)
    for r in range(2):
        assert diloco[r]["hook_calls"] == 0  # DDP never handed a bucket to the hook: no gradient traffic
        assert diloco[r]["outer_steps"] == diloco[r]["global_step"] == ddp[r]["global_step"] == 16
        for k, v in ddp[r]["params"].items():
            assert torch.allclose(diloco[r]["params"][k], v, atol=2e-6, rtol=1e-5), k
    for k, v in diloco[0]["params"].items():
        assert torch.equal(v, diloco[1]["params"][k]), k

def test_ranks_drift_inside_a_round_and_agree_after_it_evaluation_sees_theta_outer(tmp_path):
    """H = 3, 16 steps, validation every 4 steps (inside a round): the ranks evaluate identical
    parameters (θ_outer), training continues from θ_local, and the end of fit closes the last round
    (16 % 3 = 1 open step) so the ranks end identical. Bytes: Δ once per outer step."""
    res = fit(tmp_path, GCStrategy(sync="diloco", compressor="dense", diloco_inner_steps=3, start_method="forkserver"),
               model=ValLoaderClassifier(momentum=0.9), val=True, val_check_interval=4, max_epochs=4)
    n = sum(v.numel() for v in res[0]["params"].values())
    for r in range(2):
        assert res[r]["hook_calls"] == 0
        assert res[r]["outer_steps"] == 6  # 5 full rounds + the closing one
        assert res[r]["totals"]["bytes_sent"] == 6 * 4 * n  # ring allreduce of 4n bytes at N = 2
    assert len(res[0]["evaluated"]) == len(res[1]["evaluated"]) == 4
    for a, b in zip(res[0]["evaluated"], res[1]["evaluated"]):
        assert torch.equal(a, b)
    for k, v in res[0]["params"].items():
        assert torch.equal(v, res[1]["params"][k]), k


def test_a_nan_step_on_one_rank_costs_one_round_not_the_rest_of_the_run(tmp_path):
    """H = 4, 16 steps, inner SGD with momentum 0.9; rank 1's loss is NaN at step 5, so its gradient,
    momentum and parameters go NaN. The round of steps 5-8 is discarded on both ranks; rank 1's
    momentum takes rank 0's (the finite ranks' mean), so the rounds after it are taken: 3 outer
    steps of 4, and both ranks end identical and finite. Before the repair, rank 1's NaN momentum
    made every later round NaN: 1 outer step of 4."""
    res = fit(tmp_path, GCStrategy(sync="diloco", compressor="dense", diloco_inner_steps=4, start_method="forkserver"),
              model=TinyClassifier(momentum=0.9, nan_at_step=5, nan_rank=1), max_epochs=4)
    for r in range(2):
        assert res[r]["global_step"] == 16 and res[r]["outer_steps"] == 3, res[r]["outer_steps"]
        assert all(torch.isfinite(v).all() for v in res[r]["params"].values())
    for k, v in res[0]["params"].items():
        assert torch.equal(v, res[1]["params"][k]), k
