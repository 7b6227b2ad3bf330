"""OSP inside real Lightning training (2 spawned CPU/gloo ranks): checkpoint mid-run resumes
exactly, ranks end identical, the statistics reach the logger, the setup refusals fire."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from dist_harness import run_distributed
from lit_models import ReportCallback, TinyClassifier, make_loader

from lightning_gc import GCStrategy

pytestmark = pytest.mark.slow


class _OSPReport(ReportCallback):
    """Also records, per optimizer step, the deferred fraction OSP used."""

    def __init__(self, out_dir: str) -> None:
        super().__init__(out_dir)
        self.fractions: list[float] = []
        self.clip_factors: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self.fractions.append(trainer.strategy.osp.last_stats.deferred_fraction)
        self.clip_factors.append(trainer.strategy.osp.last_stats.clip_factor)

    def on_train_end(self, trainer, pl_module):
        super().on_train_end(trainer, pl_module)
        import os

        info = torch.load(os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"), weights_only=False)
        info["fractions"] = self.fractions
        info["clip_factors"] = self.clip_factors
        info["osp_step"] = trainer.strategy.osp.step
        torch.save(info, os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"))


def _fit(tmp, ckpt_path=None, callbacks=(), strategy_kw=None, model_kw=None, model_cls=TinyClassifier, **trainer_kw):
    out = tmp / "report"
    out.mkdir(parents=True, exist_ok=True)
    kw = strategy_kw or dict(compressor="dense", osp_deferred_fraction=0.6)
    strategy = GCStrategy(sync="osp", start_method="forkserver", **kw)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(tmp),
                        callbacks=[_OSPReport(str(out)), *callbacks], **{"max_epochs": 3, **trainer_kw})
    trainer.fit(model_cls(**(model_kw or {})), make_loader(n=128), ckpt_path=ckpt_path)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def test_osp_checkpoint_mid_run_resumes_exactly_and_ranks_agree(tmp_path):
    ckpt_cb = L.pytorch.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_top_k=-1, every_n_epochs=1)
    full = _fit(tmp_path / "a", callbacks=[ckpt_cb], enable_checkpointing=True)
    assert full[0]["fractions"][0] == 0.0 and max(full[0]["fractions"]) > 0.2  # step 0 BSP, then deferred (1536-element layer does not fit)
    for k, v in full[0]["params"].items():  # after the final drain the replicas are identical
        assert torch.equal(v, full[1]["params"][k]), k
    ckpt = sorted((tmp_path / "ckpt").glob("epoch=0*.ckpt"))[0]
    saved = torch.load(ckpt, weights_only=False)["lightning_gc"]["ranks"]
    assert saved[0]["osp"]["deferred"] and saved[0]["osp"]["deferred"] == saved[1]["osp"]["deferred"]
    resumed = _fit(tmp_path / "b", ckpt_path=str(ckpt))
    for r in range(2):
        assert resumed[r]["osp_step"] == full[r]["osp_step"] == full[r]["global_step"]
        for k, v in full[r]["params"].items():
            assert torch.equal(v, resumed[r]["params"][k]), f"rank {r} {k} differs after resume"


def test_osp_schedule_with_compressed_stages_resumes_mid_round_exactly(tmp_path):
    """Top-k routine and deferred stages (error memory in both), the S(Gu) schedule with 3-step
    rounds (an epoch is 4 steps, so the epoch-0 checkpoint falls inside round 2) and a non-finite
    step after it: the resumed run ends bit-identical to the uninterrupted one. The network model
    is pinned fast so that Umax sits at the cap: the budget depends on the losses only, not on
    measured times (below the cap the two runs would differ by their measured compute times, as
    two uninterrupted runs do)."""
    kw = dict(compressor="topk", ratio=0.3, osp_round_steps=3, osp_deferred_compressor="topk",
              osp_deferred_ratio=0.2, network_alpha_s=1e-9, network_beta_s_per_byte=1e-15)
    model_kw = dict(nan_at_step=5, lr=0.3)
    ckpt_cb = L.pytorch.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_top_k=-1, every_n_epochs=1)
    full = _fit(tmp_path / "a", callbacks=[ckpt_cb], strategy_kw=kw, model_kw=model_kw, enable_checkpointing=True)
    ckpt = sorted((tmp_path / "ckpt").glob("epoch=0*.ckpt"))[0]
    saved = torch.load(ckpt, weights_only=False)["lightning_gc"]["ranks"]
    for r in range(2):
        osp = saved[r]["osp"]
        assert osp["step"] == 4 and osp["round_losses"], "the checkpoint is not inside a schedule round"
        assert osp["schedule"]["rounds_done"] == 1
        assert saved[r]["memory"], "no routine error memory in the checkpoint"
    assert max(full[0]["fractions"]) > 0, "the schedule never deferred anything"
    assert full[0]["fractions"][:3] == [0.0, 0.0, 0.0]  # round 1 is synchronous
    resumed = _fit(tmp_path / "b", ckpt_path=str(ckpt), strategy_kw=kw, model_kw=model_kw)
    for r in range(2):
        assert resumed[r]["fractions"] == full[r]["fractions"][4:]
        for k, v in full[r]["params"].items():
            assert torch.equal(v, resumed[r]["params"][k]), f"rank {r} {k} differs after resume"
        assert torch.equal(full[r]["params"][k], full[1 - r]["params"][k])
        assert full[r]["memory"].keys() == resumed[r]["memory"].keys()
        for k, v in full[r]["memory"].items():  # the routine error memory too
            assert torch.equal(v, resumed[r]["memory"][k]), f"rank {r} memory {k} differs after resume"
        assert full[r]["skipped"] == 1 and resumed[r]["skipped"] == 1  # the non-finite step, after the checkpoint


class _AdamWModel(TinyClassifier):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.1)


def test_osp_with_adamw_norm_clipping_and_bf16_resumes_exactly_and_ranks_agree(tmp_path):
    """The transformer recipe's setting: AdamW, gradient_clip_val (norm), bf16-mixed. Clipping goes
    through OSP (its factor is below 1 on steps that deferred layers), the replicas end identical,
    and a run resumed from the epoch-0 checkpoint (Adam's moments and step count in it) ends
    bit-identical to the uninterrupted one."""
    run = dict(model_cls=_AdamWModel, precision="bf16-mixed", gradient_clip_val=0.05)
    ckpt_cb = L.pytorch.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_top_k=-1, every_n_epochs=1)
    full = _fit(tmp_path / "a", callbacks=[ckpt_cb], enable_checkpointing=True, **run)
    clipped = [f for f, d in zip(full[0]["clip_factors"], full[0]["fractions"]) if d > 0]
    assert clipped and max(clipped) < 1.0, full[0]["clip_factors"]  # every deferring step was clipped by OSP
    assert full[0]["clip_factors"] == full[1]["clip_factors"]
    for k, v in full[0]["params"].items():
        assert torch.equal(v, full[1]["params"][k]), k
    ckpt = sorted((tmp_path / "ckpt").glob("epoch=0*.ckpt"))[0]
    resumed = _fit(tmp_path / "b", ckpt_path=str(ckpt), **run)
    for r in range(2):
        assert resumed[r]["clip_factors"] == full[r]["clip_factors"][4:]  # 4 steps per epoch
        for k, v in full[r]["params"].items():
            assert torch.equal(v, resumed[r]["params"][k]), f"rank {r} {k} differs after resume"


class _RMSpropModel(TinyClassifier):
    def configure_optimizers(self):
        return torch.optim.RMSprop(self.parameters(), lr=1e-3)


def _rmsprop_refusal(rank: int, world_size: int, tmp: str) -> str:
    trainer = L.Trainer(strategy=GCStrategy(compressor="dense", sync="osp"), accelerator="cpu", devices=1,
                        logger=False, enable_progress_bar=False, enable_model_summary=False, max_steps=1,
                        default_root_dir=tmp)
    try:
        trainer.fit(_RMSpropModel(), make_loader(n=32))
    except ValueError as e:
        return str(e)
    return "not refused"


def test_osp_refuses_an_optimizer_it_cannot_replay_at_setup(tmp_path):
    # in a spawned process: the refusal comes after DDP set up its process group, whose store would
    # otherwise stay bound to MASTER_PORT in the pytest process and break later Lightning tests
    (msg,) = run_distributed(_rmsprop_refusal, 1, str(tmp_path), timeout=120)
    assert "cannot train with optimizer RMSprop" in msg and "SGD, Adam and AdamW" in msg


class _ValueClipModel(_AdamWModel):
    """Clips by value in its configure_gradient_clipping override (the other path to the plugin)."""

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.clip_calls = getattr(self, "clip_calls", 0) + 1
        self.clip_gradients(optimizer, gradient_clip_val=0.01, gradient_clip_algorithm="value")


def test_osp_clips_by_value_through_an_override_and_ranks_agree(tmp_path):
    full = _fit(tmp_path, model_cls=_ValueClipModel, max_epochs=1)
    assert max(full[0]["fractions"]) > 0
    assert full[0]["clip_factors"] == [1.0] * len(full[0]["clip_factors"])  # value clipping has no factor
    for k, v in full[0]["params"].items():
        assert torch.equal(v, full[1]["params"][k]), k


@pytest.mark.parametrize("kwargs, match", [
    (dict(sync="ssp"), "sync='ssp' is invalid"),
    (dict(osp_deferred_fraction=0.5), "only applies with sync='osp'"),
    (dict(sync="osp", osp_deferred_fraction=0.95), "osp_deferred_fraction=0.95 is invalid"),
    (dict(sync="osp", osp_round_steps=0), "osp_round_steps=0"),
    (dict(osp_deferred_compressor="topk"), "osp_deferred_compressor='topk' only applies with sync='osp'"),
    (dict(sync="osp", osp_deferred_compressor="nope"), "osp_deferred_compressor='nope' .* cannot be built"),
])
def test_osp_arguments_refused_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GCStrategy(**kwargs)
