"""Lightning Fabric: GCFabricStrategy trains like GCStrategy under a Trainer, on 2 gloo ranks.

Oracles: the Trainer path (GCStrategy, itself tested against hand references in test_strategy.py
and test_engine_*.py) fed the same rank-dependent batches gives the parameters Fabric must reach;
an uninterrupted Fabric run gives what a run resumed from ``fabric.save``/``fabric.load`` must
reach; counts and ratios are hand values (steps, warm-up, ratio option).
"""

from __future__ import annotations

import os

import lightning as L
import pytest
import torch
from dist_harness import run_distributed
from lit_models import TinyClassifier
from torch.utils.data import DataLoader, TensorDataset

from lightning_gc import GCFabricStrategy, GCStrategy

STEPS, BATCH, RATIO = 6, 16, 0.1


def _rank_data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's samples: different per rank, and rank 1's inputs scaled, so a missing or
    one-sided reduction changes the result."""
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(STEPS * BATCH, 16, generator=g) * (1 + rank)
    y = torch.randint(0, 4, (STEPS * BATCH,), generator=g)
    return x, y


class RankDataModel(TinyClassifier):
    def train_dataloader(self):
        return DataLoader(TensorDataset(*_rank_data(self.global_rank)), batch_size=BATCH, shuffle=False)


def _lightning_env(rank: int, world_size: int) -> None:  # processes are ours: Lightning must not launch any
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world_size))


def _params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def _fabric_train(rank: int, steps: range, strategy: GCFabricStrategy, ckpt: str | None = None,
                  resume: str | None = None) -> tuple[torch.nn.Module, GCFabricStrategy, list[dict]]:
    from lightning.fabric import Fabric

    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=2)
    fabric.launch()
    model = TinyClassifier()  # same seeded initialisation as the Trainer's model
    optimizer = torch.optim.SGD(model.parameters(), lr=model.hparams.lr, momentum=model.hparams.momentum)
    fmodel, foptimizer = fabric.setup(model, optimizer)
    if resume is not None:
        fabric.load(resume, {"model": fmodel, "optimizer": foptimizer})
    x, y = _rank_data(rank)
    logged = []
    for i in steps:
        xb, yb = x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH]
        foptimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(fmodel(xb), yb)
        fabric.backward(loss)
        foptimizer.step()
        logged.append(fabric.strategy.metrics())
    if ckpt is not None:
        fabric.save(ckpt, {"model": fmodel, "optimizer": foptimizer})
    return model, fabric.strategy, logged


def _both_paths(rank: int, world_size: int, tmp: str) -> dict:
    _lightning_env(rank, world_size)

    def gc_kwargs():
        return dict(compressor="topk", ratio=RATIO, warmup_steps=1)

    # 1. the Trainer path
    model = RankDataModel()
    trainer = L.Trainer(strategy=GCStrategy(**gc_kwargs()), accelerator="cpu", devices=2, max_steps=STEPS,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False)
    trainer.fit(model)
    trainer_params = _params(model)
    trainer_totals = trainer.strategy.engine.totals()
    # 2. Fabric, uninterrupted
    fmodel, strategy, logged = _fabric_train(rank, range(STEPS), GCFabricStrategy(**gc_kwargs()))
    ddp_hook = strategy.ddp_model._get_ddp_logging_data().get("comm_hook")
    out = {"trainer": trainer_params, "trainer_totals": trainer_totals, "fabric": _params(fmodel),
           "fabric_totals": strategy.engine.totals(), "summary": strategy.summary().as_dict(), "logged": logged,
           "hook": ddp_hook, "memory": {k: v.clone() for k, v in strategy.engine.error_memory_by_name().items()}}
    strategy.close()
    # 3. Fabric, checkpoint after half the steps, new objects, resume
    ckpt = os.path.join(tmp, "fabric.ckpt")
    _, first, _ = _fabric_train(rank, range(STEPS // 2), GCFabricStrategy(**gc_kwargs()), ckpt=ckpt)
    first.close()
    saved = torch.load(ckpt, weights_only=False)["lightning_gc"]
    resumed, second, _ = _fabric_train(rank, range(STEPS // 2, STEPS), GCFabricStrategy(**gc_kwargs()), resume=ckpt)
    out.update(resumed=_params(resumed), resumed_step=second.engine.step, saved_ranks=len(saved["ranks"]),
               resumed_memory={k: v.clone() for k, v in second.engine.error_memory_by_name().items()})
    second.close()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_distributed(_both_paths, 2, str(tmp_path_factory.mktemp("fabric")), timeout=300)


def test_fabric_reaches_the_trainer_paths_parameters(runs):
    for res in runs:
        assert res["hook"] == "gc_comm_hook"  # Fabric's DDPStrategy registers no hook: ours did
        assert res["fabric"].keys() == res["trainer"].keys()
        for name, p in res["trainer"].items():
            assert torch.equal(res["fabric"][name], p), name
        for key in ("steps", "compressed_steps", "bytes_sent", "bytes_dense"):
            assert res["fabric_totals"][key] == res["trainer_totals"][key], key
    for name in runs[0]["fabric"]:  # replicas agree
        assert torch.equal(runs[0]["fabric"][name], runs[1]["fabric"][name])
    # rank-dependent error memory: what each rank did not send differs
    assert not torch.equal(runs[0]["memory"]["net.0.weight"], runs[1]["memory"]["net.0.weight"])


def test_fabric_summary_and_logged_tags(runs):
    for rank, res in enumerate(runs):
        s = res["summary"]
        assert (s["steps"], s["compressed_steps"], s["dense_steps"], s["rank"]) == (STEPS, STEPS - 1, 1, rank)
        assert [m["gc/dense_step"] for m in res["logged"]] == [1.0] + [0.0] * (STEPS - 1)
        assert [m["gc/ratio"] for m in res["logged"]] == [1.0] + [RATIO] * (STEPS - 1)
        assert all(m["gc/bytes_ratio"] < 0.5 for m in res["logged"][1:])  # Top-k at 10%: far below dense


def test_fabric_resume_from_checkpoint_is_exact(runs):
    for res in runs:
        assert res["saved_ranks"] == 2 and res["resumed_step"] == STEPS
        for name, p in res["fabric"].items():
            assert torch.equal(res["resumed"][name], p), f"{name} differs after resume"
        for name, m in res["memory"].items():
            assert torch.equal(res["resumed_memory"][name], m), f"error memory of {name} differs after resume"


# ---------------------------------------------------------------- construction (no processes)
def test_fabric_alias_and_refusals():
    from lightning.fabric import Fabric

    fabric = Fabric(strategy="gc_qsgd", accelerator="cpu", devices=2)
    assert isinstance(fabric.strategy, GCFabricStrategy) and fabric.strategy.compressor_name == "qsgd"
    with pytest.raises(ValueError, match=r"Did you mean strategy='gc_topk'\?.*lightning-gc list"):
        Fabric(strategy="gc_topkk", accelerator="cpu", devices=2)
    with pytest.raises(ValueError, match=r"use GCFabricStrategy\(compressor='qsgd'\)"):
        GCFabricStrategy("qsgd")
    with pytest.raises(ValueError, match=r"sync='osp'\) is not supported.*GCStrategy\(sync='osp'\) with a Lightning"):
        GCFabricStrategy(sync="osp")
    with pytest.raises(ValueError, match=r"plan='omgs'\) is not supported"):
        GCFabricStrategy(plan="omgs")
    # the same validation as GCStrategy: value, reason, fix
    with pytest.raises(ValueError, match=r"ratio=1.5 is invalid for compressor 'topk'.*must lie in \(0, 1\]"):
        GCFabricStrategy(ratio=1.5)
    with pytest.raises(ValueError, match=r"Did you mean bucket_cap_mb=\?"):
        GCFabricStrategy(bucket_cap_mbb=25)
    s = GCFabricStrategy(compressor="topk", plan="layer", find_unused_parameters=True)
    assert s._ddp_kwargs == {"find_unused_parameters": True, "bucket_cap_mb": 1.0}  # GCStrategy's defaults
