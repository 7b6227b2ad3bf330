"""``compressor="auto"`` on models whose plan leaves nothing, or one group, to compress (2 gloo ranks).

Lightning's ``BoringModel`` is one ``Linear(32, 2)``: every tensor is below ``min_compress_numel``, so
the plan has no lossy group. auto must run DDP's dense path and say so once (no profile, no
decision); the oracle is plain DDP trained on the same data, to the bit. A model with exactly one
tensor above the threshold leaves one lossy group: auto decides as usual and the ranks end identical.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from lit_models import ReportCallback, make_loader

from lightning_gc import GCStrategy

pytestmark = pytest.mark.slow


class Boring(L.LightningModule):
    """``hidden=None``: one ``Linear(16, 2)`` (every tensor small, as Lightning's BoringModel); else
    ``Linear(16, hidden)`` then ``Linear(hidden, 4)``: with ``hidden=128`` only the first weight
    (2048 elements) reaches ``min_compress_numel=1024``."""

    def __init__(self, hidden: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.net = (torch.nn.Linear(16, 4) if hidden is None else
                    torch.nn.Sequential(torch.nn.Linear(16, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 4)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        # rank-dependent data: a missing average would leave the ranks apart
        x = x * (1.0 + self.global_rank)
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class AutoFacts(L.Callback):
    """Each rank's chooser facts and the lightning_gc auto warnings it emitted."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.warned: list[str] = []

    def on_fit_start(self, trainer, pl_module):
        show = warnings.showwarning

        def keep(message, *args, **kwargs):
            if "lightning_gc auto" in str(message):
                self.warned.append(str(message))
            return show(message, *args, **kwargs)
        warnings.simplefilter("always")
        warnings.showwarning = keep

    def on_train_end(self, trainer, pl_module):
        s = trainer.strategy
        a, e = getattr(s, "auto", None), getattr(s, "engine", None)
        facts = {"warned": self.warned}
        if a is not None:
            facts.update(history=a.history, chosen=a.chosen, nothing=a.nothing_to_compress, dense_mode=e.dense_mode,
                         lossy_groups=sum(not g.exact for g in e.plan.groups),
                         compressed_steps=e.totals()["compressed_steps"])
        torch.save(facts, self.out / f"facts{trainer.global_rank}.pt")


def _fit(tmp: Path, strategy, hidden: int | None, steps: int = 12) -> tuple[list[dict], list[dict]]:
    out = tmp / "report"
    out.mkdir(parents=True, exist_ok=True)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp),
                        max_steps=steps, callbacks=[ReportCallback(str(out)), AutoFacts(out)])
    trainer.fit(Boring(hidden), make_loader(shuffle=False))
    return ([torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)],
            [torch.load(out / f"facts{r}.pt", weights_only=False) for r in range(2)])


def _auto(**kw) -> GCStrategy:
    return GCStrategy(compressor="auto", start_method="forkserver", min_compress_numel=1024,
                      network_alpha_s=2e-3, network_beta_s_per_byte=8 / 2e6,
                      auto={"window": 1000, "probe_every": 0, "early_comm_ratio": 0.0, **kw})


def test_auto_with_nothing_to_compress_runs_ddp_and_matches_plain_ddp(tmp_path):
    reports, facts = _fit(tmp_path / "auto", _auto(), hidden=None)
    ddp, _ = _fit(tmp_path / "ddp", L.pytorch.strategies.DDPStrategy(start_method="spawn"), hidden=None)
    for f in facts:
        assert f["nothing"] and f["lossy_groups"] == 0
        assert f["chosen"] == "ddp" and f["dense_mode"] == "fp32" and f["compressed_steps"] == 0
        assert f["history"] == []  # nothing was measured or decided
    assert len(facts[0]["warned"]) == 1 and "no tensor to compress" in facts[0]["warned"][0]
    assert facts[1]["warned"] == []  # rank zero says it, once
    for k, v in reports[0]["params"].items():
        assert torch.equal(v, reports[1]["params"][k]), k  # ranks identical
        assert torch.equal(v, ddp[0]["params"][k]), k  # parity with plain DDP, to the bit


def test_auto_with_one_group_to_compress_decides_and_keeps_ranks_identical(tmp_path):
    reports, facts = _fit(tmp_path / "auto", _auto(candidates=("ddp", "fp16", "topk")), hidden=128)
    for f in facts:
        assert not f["nothing"] and f["lossy_groups"] == 1
        assert [h["trigger"] for h in f["history"]][:1] == ["warmup"]
    assert facts[0]["history"] == facts[1]["history"]  # every input agreed
    assert not any("no tensor to compress" in w for w in facts[0]["warned"])
    h = facts[0]["history"][0]  # the warm-up's decision in one sentence, from its own recorded numbers
    ranked = sorted(h["predictions"].values(), key=lambda p: p["time_per_progress_s"])
    runner = next(p for p in ranked if p["name"] != h["chosen"])

    def num(x):
        return f"{x:.0f}" if abs(x) >= 100 else f"{x:.3g}"
    mbit = 8 / h["network"][1] / 1e6
    assert h["sentence"] == (
        f"chose {h['chosen']} over {runner['name']}: predicted "
        f"{num(1e3 * h['predictions'][h['chosen']]['time_per_progress_s'])} ms per unit of progress against "
        f"{num(1e3 * runner['time_per_progress_s'])} ms on this {num(mbit)} Mbit/s link")
    for k, v in reports[0]["params"].items():
        assert torch.equal(v, reports[1]["params"][k]), k
