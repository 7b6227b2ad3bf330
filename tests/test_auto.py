"""``compressor="auto"`` inside real Lightning training on 2 spawned CPU/gloo ranks.

The network is pinned (``network_alpha_s``/``network_beta_s_per_byte``) so that the choice depends
on measured compute and codec costs only; the oracle recomputes the choice from the inputs the
chooser recorded (agreed across ranks) with the hand-written equations of tests/auto_oracle.py.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from auto_oracle import argmin_by_hand
from lit_models import ReportCallback, TinyClassifier, make_loader

from lightning_gc import GCStrategy
from lightning_gc.config import GCConfig

pytestmark = pytest.mark.slow

SLOW_LINK = dict(network_alpha_s=2e-3, network_beta_s_per_byte=8 / 2e6)  # 2 Mbit/s, 2 ms per message


class AutoReport(L.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer, pl_module):
        a, e = trainer.strategy.auto, trainer.strategy.engine
        torch.save({"history": a.history, "chosen": a.chosen, "dense_mode": e.dense_mode, "slots": e.slot_specs(),
                    "compressed_steps": e.totals()["compressed_steps"]},
                   self.out / f"auto{trainer.global_rank}.pt")


def _fit(tmp: Path, strategy: GCStrategy, ckpt_path=None, callbacks=(), **kw):
    out = tmp / "report"
    out.mkdir(parents=True, exist_ok=True)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(tmp),
                        callbacks=[ReportCallback(str(out)), AutoReport(out), *callbacks],
                        **{"max_epochs": 2, "enable_checkpointing": False, **kw})
    trainer.fit(TinyClassifier(), make_loader(), ckpt_path=ckpt_path)
    return ([torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)],
            [torch.load(out / f"auto{r}.pt", weights_only=False) for r in range(2)])


def _strategy(**auto):
    # one decision only: no window completes (calibration, drift) and no periodic re-probe; those decide
    # from measured step times, which differ between two runs (tests/test_auto_model.py covers them)
    return GCStrategy(compressor="auto", start_method="spawn", min_compress_numel=16,
                      auto={"window": 1000, "probe_every": 0, **auto}, **SLOW_LINK)


def test_ranks_choose_alike_and_the_choice_is_the_brute_force_minimum(tmp_path):
    reports, autos = _fit(tmp_path, _strategy(progress_weight=0.5))
    assert autos[0]["history"] == autos[1]["history"]  # every input and prediction agreed
    (h,) = autos[0]["history"]
    assert h["trigger"] == "warmup" and h["step"] == 1  # 1 skipped + 1 profiled dense step
    assert h["network"] == [SLOW_LINK["network_alpha_s"], SLOW_LINK["network_beta_s_per_byte"]]
    want = argmin_by_hand(h["costs"], h["workload"], *h["network"], 2, 0.5)
    assert h["chosen"] == want
    # at 2 Mbit/s fp32 DDP cannot be the pick: any 16-bit or compressed method sends less
    assert want != "ddp"
    a = autos[0]
    if want in ("fp16", "bf16"):
        assert a["dense_mode"] == want and a["compressed_steps"] == 0
    else:
        assert a["dense_mode"] is None and a["compressed_steps"] == 16 - 2
        assert all(s["spec"]["compressor"] for s in a["slots"] if "spec" in s)
    for k, v in reports[0]["params"].items():
        assert torch.equal(v, reports[1]["params"][k]), k


def test_a_resumed_run_keeps_the_choice_and_is_exact(tmp_path):
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_top_k=-1, every_n_epochs=1)
    full, full_auto = _fit(tmp_path / "a", _strategy(candidates=["ddp", "topk", "efsign"]), callbacks=[ckpt],
                           enable_checkpointing=True)
    first = sorted((tmp_path / "ckpt").glob("epoch=0*.ckpt"))[0]
    resumed, resumed_auto = _fit(tmp_path / "b", _strategy(candidates=["ddp", "topk", "efsign"]),
                                 ckpt_path=str(first))
    def decisions(history):  # measured_step_s: the first window after the decision, measured by the run itself
        return [{k: v for k, v in h.items() if k != "measured_step_s"} for h in history]

    assert decisions(resumed_auto[0]["history"]) == decisions(full_auto[0]["history"])  # no second profile
    assert resumed_auto[0]["chosen"] == full_auto[0]["chosen"] != "ddp"
    for r in range(2):
        for k, v in full[r]["params"].items():
            assert torch.equal(v, resumed[r]["params"][k]), f"rank {r} {k} differs after resume"


@pytest.mark.parametrize("kwargs, match", [
    (dict(compressor="auto", ratio=0.1), "ratio=0.1 cannot be given"),
    (dict(compressor="auto", sync="osp"), "sync='osp' is not supported"),
    (dict(compressor="auto", plan="layer"), "plan='layer' is not supported"),
    (dict(compressor="topk", auto={"progress_weight": 2.0}), "only apply with compressor='auto'"),
    (dict(compressor="auto", auto={"candidates": ["fp16", "topk"]}), "must include 'ddp'"),
    (dict(compressor="auto", auto={"candidates": ["ddp", "zip"]}), "candidate 'zip' is unknown"),
    (dict(compressor="auto", auto={"progress_weight": -1}), "progress_weight=-1"),
    (dict(compressor="auto", auto={"windw": 3}), r"unknown option\(s\) \['windw'\]"),
])
def test_bad_auto_settings_are_refused_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GCStrategy(**kwargs)


def test_auto_config_round_trips_through_flat_names():
    cfg = GCConfig.from_flat(compressor="auto", auto_progress_weight=0.25, auto_candidates=("ddp", "qsgd"))
    assert cfg.auto.progress_weight == 0.25 and cfg.auto.candidates == ("ddp", "qsgd")
    assert cfg.engine.warmup_steps == cfg.auto.dense_steps_needed == 2
    assert GCConfig.from_flat(**cfg.to_flat()) == cfg
