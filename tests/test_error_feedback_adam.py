"""Error feedback's default knowing the optimizers (docs/compressors.md, "Error feedback under Adam").

Measured on the ``gpt`` preset with AdamW, error memory in gradient units cost Top-k, EF-signSGD
and Marsit far more than it saved, so with ``error_feedback=None`` those three default to no error
feedback under an Adam-family optimizer. Oracles: the hand-listed policy per compressor; on two gloo
ranks, the engine's mean gradient equals a hand-computed mean of every rank's own Top-k (torch.topk,
not the library's selection) and no memory is kept; a rank that decides otherwise is refused by
name; a Trainer fit reports the setting, and an explicit ``error_feedback=True`` wins.
"""

from __future__ import annotations

import pytest
import torch
from dist_harness import gather_all, run_distributed
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_gc import GCStrategy
from lightning_gc.compressors import build_compressor
from lightning_gc.compressors.base import adam_family


def _opt(cls, **kw):
    return cls([torch.nn.Parameter(torch.zeros(2))], lr=0.1, **kw)


def test_adam_family_is_told_by_betas():
    for cls in (torch.optim.Adam, torch.optim.AdamW, torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adamax):
        assert adam_family([_opt(cls)]), cls.__name__
    for opt in (_opt(torch.optim.SGD, momentum=0.9), _opt(torch.optim.Adagrad), _opt(torch.optim.RMSprop)):
        assert not adam_family([opt]), type(opt).__name__
    assert adam_family([_opt(torch.optim.SGD), _opt(torch.optim.AdamW)]) and not adam_family([])


# (compressor, default with SGD, default with AdamW): the measured policy, by hand
POLICY = [("topk", True, False), ("efsignsgd", True, False), ("marsit", True, False),
          ("lwtopk", True, True), ("mstopk", True, True), ("star_topk", True, True), ("var_topk", True, True),
          ("lowrank", True, True), ("qsgd", False, False), ("signsgd", False, False), ("randomk", False, False),
          ("gradiveq", False, False), ("fp16", False, False)]


@pytest.mark.parametrize("name, with_sgd, with_adamw", POLICY)
def test_default_per_compressor(name, with_sgd, with_adamw):
    ratio = 0.01 if name in ("topk", "lwtopk", "mstopk", "star_topk", "var_topk", "randomk") else None
    comp = build_compressor(name, ratio)
    assert comp.error_feedback_default([_opt(torch.optim.SGD, momentum=0.9)]) is with_sgd
    assert comp.error_feedback_default([_opt(torch.optim.AdamW)]) is with_adamw


def _engine_run(rank: int, ws: int, optimizer: str) -> dict:
    from lightning_gc.engine import EngineConfig, GCEngine, gc_comm_hook

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 3))
    ddp = DDP(model, bucket_cap_mb=1)
    engine = GCEngine(build_compressor("topk", 0.05), EngineConfig(warmup_steps=1, min_compress_numel=100),
                      list(model.named_parameters()))
    ddp.register_comm_hook(engine, gc_comm_hook)
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-3) if optimizer == "adamw"
           else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    ef_before = engine.error_feedback
    try:
        message = engine.adopt_error_feedback_default([opt])
    except RuntimeError as exc:
        return {"error": str(exc)}
    worst = 0.0
    for step in range(3):
        g = torch.Generator().manual_seed(100 * rank + step)
        x, y = torch.randn(8, 32, generator=g) * (1 + rank), torch.randint(0, 3, (8,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        if step >= 1:  # compressed steps: the mean of every rank's own top 5 % of each compressed group
            replica = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 3))
            replica.load_state_dict(model.state_dict())
            torch.nn.functional.cross_entropy(replica(x), y).backward()
            rep = dict(replica.named_parameters())
            for group in engine.plan.groups:
                if group.exact:
                    continue
                own = torch.cat([rep[n].grad.reshape(-1) for n in group.names])
                k = max(1, int(round(0.05 * own.numel())))
                ref = torch.zeros(own.numel() * ws).view(ws, -1)
                for r, gr in enumerate(gather_all(own, ws)):
                    idx = gr.abs().topk(k).indices
                    ref[r, idx] = gr[idx]
                got = torch.cat([dict(model.named_parameters())[n].grad.reshape(-1) for n in group.names])
                worst = max(worst, float((got - ref.mean(0)).abs().max()))
        opt.step()
    return {"ef_before": ef_before, "ef": engine.error_feedback, "message": message, "worst": worst,
            "memory": len(engine.memory)}


def test_engine_drops_error_feedback_under_adamw_and_sends_the_plain_top_k():
    """topk with AdamW: error feedback goes off, every compressed step is the mean of the ranks' own
    Top-k (nothing carried over), no memory exists. With SGD the default stays on."""
    runs = run_distributed(_both, 2, timeout=180)
    for r, res in enumerate(run["adamw"] for run in runs):
        assert res["ef_before"] is True and res["ef"] is False, res
        assert "error_feedback=False for compressor=topk with AdamW" in res["message"]
        assert res["worst"] <= 1e-6, f"rank {r}: mean gradient off the no-feedback reference by {res['worst']:.3g}"
        assert res["memory"] == 0
    for res in (run["sgd"] for run in runs):
        assert res["ef"] is True and res["message"] is None and res["memory"] > 0


def _both(rank: int, ws: int) -> dict:
    return {opt: _engine_run(rank, ws, opt) for opt in ("adamw", "sgd")}


def _mixed(rank: int, ws: int) -> dict:
    return _engine_run(rank, ws, "adamw" if rank == 0 else "sgd")


def test_ranks_that_decide_differently_are_refused():
    for res in run_distributed(_mixed, 2, timeout=180):
        assert "ranks built different communication setups" in res["error"] and "ef=False" in res["error"]


def _fit(rank: int, ws: int, tmp: str) -> list:
    import lightning as L
    from lit_models import TinyClassifier, make_loader

    class AdamWClassifier(TinyClassifier):
        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    out = []
    for model, ef in ((AdamWClassifier(), None), (AdamWClassifier(), True), (TinyClassifier(), None)):
        strategy = GCStrategy(compressor="topk", ratio=0.05, error_feedback=ef)
        trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                            enable_model_summary=False, enable_checkpointing=False, max_steps=2, default_root_dir=tmp)
        trainer.fit(model, make_loader(n=32))
        out.append(strategy.engine.error_feedback)
    return out


def test_trainer_setup_applies_the_default_and_an_explicit_choice_wins(tmp_path):
    (result,) = run_distributed(_fit, 1, str(tmp_path), timeout=180)
    assert result == [False, True, True]  # AdamW default, AdamW with error_feedback=True, SGD default


def _fabric_setup(rank: int, ws: int) -> list:
    from lightning.fabric import Fabric
    from lit_models import TinyClassifier
    from test_fabric import _lightning_env

    from lightning_gc import GCFabricStrategy

    _lightning_env(rank, ws)
    out = []
    for make in (lambda p: torch.optim.AdamW(p, lr=1e-3), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)):
        strategy = GCFabricStrategy(compressor="topk", ratio=0.1)
        fabric = Fabric(strategy=strategy, accelerator="cpu", devices=2)
        fabric.launch()
        model = TinyClassifier()
        fabric.setup(model, make(model.parameters()))
        out.append(strategy.engine.error_feedback)
    return out


def test_fabric_setup_applies_the_default():
    for res in run_distributed(_fabric_setup, 2, timeout=180):
        assert res == [False, True]  # AdamW, then momentum SGD


def _fit_bf16(rank: int, ws: int, tmp: str) -> dict:
    import lightning as L
    from lit_models import TinyClassifier, make_loader
    from test_fabric import _lightning_env

    class AdamWClassifier(TinyClassifier):
        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    _lightning_env(rank, ws)
    model = AdamWClassifier()
    strategy = GCStrategy(compressor="topk", ratio=0.05)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=ws, precision="bf16-mixed", logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        max_steps=4, default_root_dir=tmp, use_distributed_sampler=False)
    trainer.fit(model, make_loader(n=64, seed=rank))  # rank-dependent data
    return {"ef": strategy.engine.error_feedback, "memory": len(strategy.engine.memory),
            "compressed": strategy.engine.totals()["compressed_steps"],
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def test_bf16_mixed_adamw_default_keeps_ranks_bit_identical(tmp_path):
    """The transformer recipe's precision: under bf16-mixed with AdamW the default turns error
    feedback off on every rank, compressed steps run, and the replicas end bit-identical."""
    a, b = run_distributed(_fit_bf16, 2, str(tmp_path), timeout=180)
    for res in (a, b):
        assert res["ef"] is False and res["memory"] == 0 and res["compressed"] >= 2, res
    for name, p in a["params"].items():
        assert torch.equal(p, b["params"][name]), name
