"""DiLoCo inside real Lightning training (2 spawned CPU/gloo ranks, rank-dependent data through
DDP's sampler): parity with DDP at H = 1, no gradient traffic in inner steps, bit-identical ranks
after outer steps, evaluation on θ_outer, and an exact resume from a checkpoint written mid-round."""

from __future__ import annotations

import os

import lightning as L
import pytest
import torch
from lit_models import ReportCallback, TinyClassifier, make_loader

from lightning_gc import GCStrategy

pytestmark = pytest.mark.slow


class _DiLoCoReport(ReportCallback):
    """Adds DiLoCo's counters and the parameters each rank evaluated on."""

    def __init__(self, out_dir: str) -> None:
        super().__init__(out_dir)
        self.evaluated: list[torch.Tensor] = []

    def on_validation_start(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.evaluated.append(torch.cat([p.detach().reshape(-1).clone() for p in pl_module.parameters()]))

    def on_train_end(self, trainer, pl_module):
        super().on_train_end(trainer, pl_module)
        self._diloco = getattr(trainer.strategy, "diloco", None)

    def on_fit_end(self, trainer, pl_module):
        # after the strategy's teardown, which closes an unfinished DiLoCo round
        path = os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt")
        if not os.path.exists(path):  # nothing was trained (resumed at the last step)
            super().on_train_end(trainer, pl_module)
        info = torch.load(path, weights_only=False)
        d = getattr(self, "_diloco", None)
        info.update(evaluated=self.evaluated, outer_steps=d.outer_steps if d else None,
                    inner_step=d.inner_step if d else None,
                    totals=trainer.strategy.engine.totals() if getattr(trainer.strategy, "engine", None) else None,
                    params={k: v.detach().clone() for k, v in pl_module.state_dict().items()})
        torch.save(info, path)


class _ValLoaderClassifier(TinyClassifier):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.cross_entropy(self(x), y), sync_dist=True)


def _fit(tmp, strategy, model=None, ckpt_path=None, callbacks=(), val=False, **trainer_kw):
    out = tmp / "report"
    out.mkdir(parents=True, exist_ok=True)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(tmp), num_sanity_val_steps=0,
                        callbacks=[_DiLoCoReport(str(out)), *callbacks], **{"max_epochs": 2, **trainer_kw})
    model = model or TinyClassifier(momentum=0.0)
    loaders = dict(val_dataloaders=make_loader(n=64, seed=3, shuffle=False)) if val else {}
    trainer.fit(model, make_loader(n=128), ckpt_path=ckpt_path, **loaders)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def test_h1_with_plain_outer_sgd_at_lr_1_equals_ddp(tmp_path):
    """H = 1, dense Δ, outer SGD lr 1 without momentum, inner SGD without momentum: each outer step
    is θ − mean_r(θ − θ_local,r) = θ − η·mean_r(g_r), DDP's update in real arithmetic. 16 steps."""
    ddp = _fit(tmp_path / "ddp", L.pytorch.strategies.DDPStrategy(start_method="spawn"), max_epochs=4)
    diloco = _fit(tmp_path / "dl", GCStrategy(sync="diloco", compressor="dense", diloco_inner_steps=1,
                                              diloco_outer_args={"lr": 1.0}, start_method="spawn"), max_epochs=4)
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
    res = _fit(tmp_path, GCStrategy(sync="diloco", compressor="dense", diloco_inner_steps=3, start_method="spawn"),
               model=_ValLoaderClassifier(momentum=0.9), val=True, val_check_interval=4, max_epochs=4)
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


def test_checkpoint_mid_round_resumes_exactly(tmp_path):
    """Top-k 20 % Δ with error feedback, H = 3, inner SGD with momentum (per-rank state): the
    checkpoint after epoch 0 (step 4, one step into a round) holds θ_outer as model weights and each
    rank's θ_local, inner optimizer state and error memory; the resumed run ends bit-identical."""

    def strategy():
        return GCStrategy(sync="diloco", compressor="topk", ratio=0.2, diloco_inner_steps=3, start_method="spawn")

    ckpt_cb = L.pytorch.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_top_k=-1, every_n_epochs=1)
    full = _fit(tmp_path / "a", strategy(), model=TinyClassifier(momentum=0.9), callbacks=[ckpt_cb],
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
    resumed = _fit(tmp_path / "b", strategy(), model=TinyClassifier(momentum=0.9), ckpt_path=str(ckpt_file),
                   max_epochs=3)
    for r in range(2):
        assert resumed[r]["outer_steps"] == full[r]["outer_steps"] == 4  # 12 steps: 4 rounds
        for k, v in full[r]["params"].items():
            assert torch.equal(v, resumed[r]["params"][k]), f"rank {r} {k} differs after resume"


def test_inner_steps_take_accumulation_clipping_and_bf16_mixed(tmp_path):
    """Gradient accumulation (Lightning's no_sync on the first micro-batch restores DiLoCo's flag),
    clipping at 0.5 and bf16-mixed apply to the local inner steps; no gradient reaches the hook,
    outer steps follow optimizer steps (not micro-batches) and the ranks end identical."""
    res = _fit(tmp_path, GCStrategy(sync="diloco", compressor="bf16", diloco_inner_steps=2, start_method="spawn"),
               model=TinyClassifier(momentum=0.9), accumulate_grad_batches=2, gradient_clip_val=0.5,
               precision="bf16-mixed", max_epochs=2)
    for r in range(2):
        assert res[r]["hook_calls"] == 0
        assert res[r]["global_step"] == 4 and res[r]["outer_steps"] == 2 and res[r]["inner_step"] == 4
        assert res[r]["totals"]["bytes_sent"] > 0
    for k, v in res[0]["params"].items():
        assert torch.equal(v, res[1]["params"][k]), k


def test_monitor_logs_outer_steps_and_bytes_per_step_to_tensorboard(tmp_path):
    """H = 3 over 8 steps with log_every_n_steps=1: ``gc/diloco_outer_step`` is 1 exactly at steps
    3 and 6, ``gc/bytes_sent`` is the Δ ring allreduce there and 0 on inner steps."""
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trainer = L.Trainer(strategy=GCStrategy(sync="diloco", compressor="dense", diloco_inner_steps=3,
                                            start_method="spawn"),
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


def test_streaming_checkpoint_with_an_exchange_in_flight_resumes_exactly(tmp_path):
    """Streaming DiLoCo, F = 2, H = 4, τ = 1, α = 0.5, Top-k 20 % Δ with error feedback: fragment 1 is
    sent at step 4 and applied at step 5 on the worker thread, so the checkpoint after epoch 0
    (step 4) holds its result in flight (mean, and per rank what it did not send); the resumed run
    ends bit-identical to the uninterrupted one, and the end of fit leaves the ranks identical."""

    def strategy():
        return GCStrategy(sync="diloco", compressor="topk", ratio=0.2, diloco_inner_steps=4, diloco_fragments=2,
                          diloco_overlap_steps=1, diloco_mixing=0.5, start_method="spawn")

    ckpt_cb = L.pytorch.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_top_k=-1, every_n_epochs=1)
    full = _fit(tmp_path / "a", strategy(), model=TinyClassifier(momentum=0.9), callbacks=[ckpt_cb],
                enable_checkpointing=True, max_epochs=3)
    ckpt_file = sorted((tmp_path / "ckpt").glob("epoch=0*.ckpt"))[0]
    state = torch.load(ckpt_file, weights_only=False)["lightning_gc"]
    shared = state["diloco/shared"]
    assert shared["inner_step"] == 4 and list(shared["pending"]) == [1]
    assert shared["pending"][1]["due"] == 5 and shared["pending"][1]["mean"] is not None
    assert state["ranks"][0]["diloco"]["pending"][1]["residual"] is not None
    resumed = _fit(tmp_path / "b", strategy(), model=TinyClassifier(momentum=0.9), ckpt_path=str(ckpt_file),
                   max_epochs=3)
    for r in range(2):
        # fragment 0 applied at 3, 7, 11; fragment 1 at 5, 9 and (sent at 12) at the end; then both closed
        assert resumed[r]["outer_steps"] == full[r]["outer_steps"] == 8
        assert resumed[r]["hook_calls"] == 0
        for k, v in full[r]["params"].items():
            assert torch.equal(v, resumed[r]["params"][k]), f"rank {r} {k} differs after resume"
    for k, v in full[0]["params"].items():
        assert torch.equal(v, full[1]["params"][k]), k
