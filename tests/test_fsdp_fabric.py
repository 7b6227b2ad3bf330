"""``GCFabricModelParallelStrategy``: FSDP2 with the replica exchange from Lightning Fabric.

Four gloo ranks, two replicas of two shard ranks, rank-dependent batches. Oracles: native HSDP by
hand (tests/fsdp_lit.py's ``native_hsdp``: FSDP2's own replica all-reduce, no Lightning) for
the dense exchange, bit for bit; an uninterrupted run for ``fabric.save``/``fabric.load`` with Top-k
(the error memory must come back, or the resumed run differs).
"""

from __future__ import annotations

import os

import torch
from dist_harness import run_distributed
from fsdp_lit import BATCH, WORLD, R, full_params, make_data, make_net, native_hsdp, shard
from lightning.fabric import Fabric

from lightning_gc.model_parallel import GCFabricModelParallelStrategy


def _parallelize(net, mesh):
    shard(net, mesh["data_parallel"], False)
    return net


def _fabric(compressor: str) -> Fabric:
    strategy = GCFabricModelParallelStrategy(_parallelize, compressor=compressor, replicate_size=R,
                                             min_compress_numel=0)
    fabric = Fabric(accelerator="cpu", devices=WORLD, strategy=strategy)
    fabric.launch()
    return fabric


def _train(fabric: Fabric, rank: int, steps: int, start: int = 0, state_from: str | None = None,
           save_at: str | None = None) -> list[torch.Tensor]:
    net = fabric.setup_module(make_net())
    opt = fabric.setup_optimizers(torch.optim.AdamW(net.parameters(), lr=0.02))
    if state_from is not None:
        fabric.load(state_from, {"net": net, "opt": opt})
    data = make_data(steps)
    mine = [data[i] for i in range(rank, len(data), WORLD)]
    for step in range(start, steps):
        chunk = mine[step * BATCH:(step + 1) * BATCH]
        x, y = torch.stack([c[0] for c in chunk]), torch.stack([c[1] for c in chunk])
        fabric.backward(torch.nn.functional.mse_loss(net(x).float(), y))
        opt.step()
        opt.zero_grad()
        if save_at is not None and step + 1 == steps // 2:
            fabric.save(save_at, {"net": net, "opt": opt})
    return full_params(net)


def _cases(rank: int, world: int, tmp: str) -> dict:
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(WORLD))
    dense = _train(_fabric("dense"), rank, 3)
    native = native_hsdp(rank, 3)
    path = os.path.join(tmp, "half")
    whole = _train(_fabric("topk"), rank, 6, save_at=path)
    resumed = _train(_fabric("topk"), rank, 6, start=3, state_from=path)
    return {"dense": dense, "native": native, "whole": whole, "resumed": resumed,
            "memory_files": sorted(os.listdir(os.path.join(path, "lightning_gc")))}


def test_fabric_dense_equals_native_hsdp_and_save_load_resumes_exactly(tmp_path):
    res = run_distributed(_cases, WORLD, str(tmp_path), timeout=400)
    for rank, r in enumerate(res):
        for a, b in zip(r["dense"], r["native"]):
            assert torch.equal(a, b), f"rank {rank}: Fabric's dense exchange differs from native HSDP"
        for a, b in zip(r["whole"], r["resumed"]):
            assert torch.equal(a, b), f"rank {rank}: resuming from fabric.save differs from the uninterrupted run"
        assert r["memory_files"] == [f"rank{i:05d}.pt" for i in range(WORLD)]
    for r in res[1:]:
        for a, b in zip(res[0]["whole"], r["whole"]):
            assert torch.equal(a, b), "every rank holds the same parameters"
