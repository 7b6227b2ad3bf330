"""``GCModelParallelStrategy`` with a compressor: convergence and exact resume, 4 gloo ranks (2 × 2).

Oracles: the replicas hold the same parameters bit for bit; Top-k with error feedback trains to near
the dense exchange's loss (which equals native HSDP's, tests/test_fsdp_strategy.py); and a run resumed
from the distributed checkpoint at step 3 equals the uninterrupted run bit for bit — which it does only
if each rank's error memory and PowerSGD's warm start come back from ``lightning_gc/rankNNNNN.pt``.
"""

from __future__ import annotations

import os

import torch
from dist_harness import run_distributed
from fsdp_lit import WORLD, fit


def _topk_cases(rank: int, world: int, tmp: str) -> dict:
    steps = 30
    topk, losses = fit(rank, tmp, steps, {"compressor": "topk", "ratio": 0.1})
    dense, dense_losses = fit(rank, tmp, steps, {"compressor": "dense"})
    return {"topk": topk, "losses": losses, "dense_losses": dense_losses}


def test_topk_keeps_replicas_identical_and_converges(tmp_path):
    res = run_distributed(_topk_cases, WORLD, str(tmp_path), timeout=400)
    for r in res[1:]:
        for a, b in zip(res[0]["topk"], r["topk"]):
            assert torch.equal(a, b), "every rank holds the same parameters"
    first = sum(r["losses"][0] for r in res) / WORLD
    last = sum(sum(r["losses"][-5:]) / 5 for r in res) / WORLD
    dense_last = sum(sum(r["dense_losses"][-5:]) / 5 for r in res) / WORLD
    assert last < 0.5 * first, "Top-k with error feedback trains"
    assert last < 2.0 * dense_last + 0.05, "and lands near native-equivalent dense training"


def _resume_cases(rank: int, world: int, tmp: str, compressor: str, args: dict) -> dict:
    from lightning.pytorch.callbacks import ModelCheckpoint

    kw = {"compressor": compressor, "compressor_args": args}
    ck = {"enable_checkpointing": True,
          "callbacks": [ModelCheckpoint(dirpath=tmp, every_n_train_steps=3, save_top_k=-1, filename="s{step}")]}
    # epochs of 3 steps: the checkpoint at step 3 closes an epoch, so the resumed run reads the same batches
    whole, _ = fit(rank, tmp, 6, kw, ck, epoch_steps=3)
    path = os.path.join(tmp, "sstep=3.ckpt")
    resumed, _ = fit(rank, tmp, 6, kw, {"enable_checkpointing": False}, ckpt_path=path, epoch_steps=3)
    files = sorted(os.listdir(os.path.join(path, "lightning_gc")))
    return {"whole": whole, "resumed": resumed, "files": files}


def _both_resumes(rank: int, world: int, tmp: str) -> dict:
    return {c: _resume_cases(rank, world, os.path.join(tmp, c), c, a)
            for c, a in (("topk", {}), ("lowrank", {"rank": 2}))}


def test_resume_from_a_distributed_checkpoint_is_exact(tmp_path):
    res = run_distributed(_both_resumes, WORLD, str(tmp_path), timeout=400)
    for r in res:
        for compressor, case in r.items():
            assert case["files"] == [f"rank{i:05d}.pt" for i in range(WORLD)], "each rank saved its own memory"
            for a, b in zip(case["whole"], case["resumed"]):
                assert torch.equal(a, b), f"{compressor}: resuming at step 3 reproduces the uninterrupted run"
