"""Streaming DiLoCo inside real Lightning training (2 spawned CPU/gloo ranks): an exact resume with
an exchange in flight, and GCMonitor's DiLoCo scalars in TensorBoard."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from diloco_lit import fit
from lit_models import TinyClassifier, make_loader

from lightning_gc import GCStrategy

pytestmark = pytest.mark.slow


def test_streaming_checkpoint_with_an_exchange_in_flight_resumes_exactly(tmp_path):
    """Streaming DiLoCo, F = 2, H = 4, τ = 1, α = 0.5, Top-k 20 % Δ with error feedback: fragment 1 is
    sent at step 4 and applied at step 5 on the worker thread, so the checkpoint after epoch 0
    (step 4) holds its result in flight (mean, and per rank what it did not send); the resumed run
    ends bit-identical to the uninterrupted one, and the end of fit leaves the ranks identical."""

    def strategy():
        return GCStrategy(sync="diloco", compressor="topk", ratio=0.2, diloco_inner_steps=4, diloco_fragments=2,
                          diloco_overlap_steps=1, diloco_mixing=0.5, start_method="forkserver")

    ckpt_cb = L.pytorch.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_top_k=-1, every_n_epochs=1)
    full = fit(tmp_path / "a", strategy(), model=TinyClassifier(momentum=0.9), callbacks=[ckpt_cb],
                enable_checkpointing=True, max_epochs=3)
    ckpt_file = sorted((tmp_path / "ckpt").glob("epoch=0*.ckpt"))[0]
    state = torch.load(ckpt_file, weights_only=False)["lightning_gc"]
    shared = state["diloco/shared"]
    assert shared["inner_step"] == 4 and list(shared["pending"]) == [1]
    assert shared["pending"][1]["due"] == 5 and shared["pending"][1]["mean"] is not None
    assert state["ranks"][0]["diloco"]["pending"][1]["residual"] is not None
    resumed = fit(tmp_path / "b", strategy(), model=TinyClassifier(momentum=0.9), ckpt_path=str(ckpt_file),
                   max_epochs=3)
    for r in range(2):
        # fragment 0 applied at 3, 7, 11; fragment 1 at 5, 9 and (sent at 12) at the end; then both closed
        assert resumed[r]["outer_steps"] == full[r]["outer_steps"] == 8
        assert resumed[r]["hook_calls"] == 0
        for k, v in full[r]["params"].items():
            assert torch.equal(v, resumed[r]["params"][k]), f"rank {r} {k} differs after resume"
    for k, v in full[0]["params"].items():
        assert torch.equal(v, full[1]["params"][k]), k

def test_monitor_logs_outer_steps_and_bytes_per_step_to_tensorboard(tmp_path):
    """H = 3 over 8 steps with log_every_n_steps=1: ``gc/diloco_outer_step`` is 1 exactly at steps
    3 and 6, ``gc/bytes_sent`` is the Δ ring allreduce there and 0 on inner steps."""
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trainer = L.Trainer(strategy=GCStrategy(sync="diloco", compressor="dense", diloco_inner_steps=3,
                                            start_method="forkserver"),
                        accelerator="cpu", devices=2, max_epochs=2, log_every_n_steps=1, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False,
                        logger=TensorBoardLogger(str(tmp_path), name="tb"))
    model = TinyClassifier(momentum=0.0)
    trainer.fit(model, make_loader(n=128))
    acc = EventAccumulator(str(tmp_path / "tb" / "version_0"), size_guidance={"scalars": 0})
    acc.Reload()
    outer = [e.value for e in acc.Scalars("gc/diloco_outer_step")]
    sent = [e.value for e in acc.Scalars("gc/bytes_sent")]
    n = sum(p.numel() for p in model.parameters())
    assert outer == [0, 0, 1, 0, 0, 1, 0, 0]
    assert sent == [0, 0, 4 * n, 0, 0, 4 * n, 0, 0]
    assert [e.value for e in acc.Scalars("gc/bytes_dense")] == [4 * n] * 8
    norms = {e.step: e.value for e in acc.Scalars("gc/diloco_delta_norm")}
    assert min(norms) == 2 and norms[2] > 0 and norms[5] > 0 and norms[2] != norms[5]
