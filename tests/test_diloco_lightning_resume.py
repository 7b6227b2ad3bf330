"""DiLoCo inside real Lightning training (2 spawned CPU/gloo ranks): an exact resume from a
checkpoint written mid-round, and inner steps under gradient accumulation, clipping and bf16-mixed."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from diloco_lit import fit
from lit_models import TinyClassifier

from lightning_gc import GCStrategy

pytestmark = pytest.mark.slow


def test_checkpoint_mid_round_resumes_exactly(tmp_path):
    """Top-k 20 % Δ with error feedback, H = 3, inner SGD with momentum (per-rank state): the
    checkpoint after epoch 0 (step 4, one step into a round) holds θ_outer as model weights and each
    rank's θ_local, inner optimizer state and error memory; the resumed run ends bit-identical."""

    def strategy():
        return GCStrategy(sync="diloco", compressor="topk", ratio=0.2, diloco_inner_steps=3, start_method="forkserver")

    ckpt_cb = L.pytorch.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_top_k=-1, every_n_epochs=1)
    full = fit(tmp_path / "a", strategy(), model=TinyClassifier(momentum=0.9), callbacks=[ckpt_cb],
                enable_checkpointing=True, max_epochs=3)
    ckpt_file = sorted((tmp_path / "ckpt").glob("epoch=0*.ckpt"))[0]
    ckpt = torch.load(ckpt_file, weights_only=False)
    state = ckpt["lightning_gc"]
    shared = state["diloco/shared"]
    assert shared["inner_step"] == 4 and shared["outer_steps"] == 1
    ranks = state["ranks"]
    assert ranks[0]["diloco"]["theta_local"] is not None and ranks[0]["diloco"]["memories"][0] is not None
    # the two ranks' local models and momentum differ mid-round; the model weights are θ_outer
    names = list(shared["theta_outer"])
    assert not torch.equal(ranks[0]["diloco"]["theta_local"][names[0]], ranks[1]["diloco"]["theta_local"][names[0]])
    weights = [v for k, v in ckpt["state_dict"].items()]
    assert all(torch.equal(w, shared["theta_outer"][n]) for w, n in zip(weights, names))
    resumed = fit(tmp_path / "b", strategy(), model=TinyClassifier(momentum=0.9), ckpt_path=str(ckpt_file),
                   max_epochs=3)
    for r in range(2):
        assert resumed[r]["outer_steps"] == full[r]["outer_steps"] == 4  # 12 steps: 4 rounds
        for k, v in full[r]["params"].items():
            assert torch.equal(v, resumed[r]["params"][k]), f"rank {r} {k} differs after resume"

def test_inner_steps_take_accumulation_clipping_and_bf16_mixed(tmp_path):
    """Gradient accumulation (Lightning's no_sync on the first micro-batch restores DiLoCo's flag),
    clipping at 0.5 and bf16-mixed apply to the local inner steps; no gradient reaches the hook,
    outer steps follow optimizer steps (not micro-batches) and the ranks end identical."""
    res = fit(tmp_path, GCStrategy(sync="diloco", compressor="bf16", diloco_inner_steps=2, start_method="forkserver"),
               model=TinyClassifier(momentum=0.9), accumulate_grad_batches=2, gradient_clip_val=0.5,
               precision="bf16-mixed", max_epochs=2)
    for r in range(2):
        assert res[r]["hook_calls"] == 0
        assert res[r]["global_step"] == 4 and res[r]["outer_steps"] == 2 and res[r]["inner_step"] == 4
        assert res[r]["totals"]["bytes_sent"] > 0
    for k, v in res[0]["params"].items():
        assert torch.equal(v, res[1]["params"][k]), k
