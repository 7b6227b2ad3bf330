"""``GCModelParallelStrategy`` from a Lightning Trainer: FSDP2 on a 2 × 2 mesh, 4 gloo ranks.

Two replicas ("nodes") of two shard ranks; each rank reads its own batches (rank-dependent data).
The oracle is native HSDP run by hand, without Lightning and without lightning_gc: the same model,
batches and AdamW, ``fully_shard`` on the 2-D (replicate, shard) mesh, FSDP2's own replica
all-reduce. With ``compressor="dense"`` the Trainer's parameters equal it bit for bit, with gradient
accumulation and FSDP2 mixed precision too, and within fp32 rounding with clipping across the mesh.
With Top-k, the replicas stay bit-identical, training converges like native HSDP's, and resuming
from a distributed checkpoint is exact (error memory included).
"""

from __future__ import annotations

import os

import lightning as L
import pytest
import torch
from dist_harness import run_distributed
from fsdp_lit import BATCH, HID, IN, OUT, WORLD, R, Regressor, S, fit, make_data, native_hsdp, shard
from torch.utils.data import DataLoader

from lightning_gc.model_parallel import GCModelParallelStrategy


def _logged_bytes(log_dir: str) -> list[float]:
    import csv

    with open(os.path.join(log_dir, "metrics.csv")) as f:
        return [float(row["gc/bytes_inter_node"]) for row in csv.DictReader(f) if row.get("gc/bytes_inter_node")]


def _dense_cases(rank: int, world: int, tmp: str) -> dict:
    from lightning.pytorch.loggers import CSVLogger

    steps = 3
    out = {}
    logger = CSVLogger(tmp, name="fsdp")
    out["plain"] = (fit(rank, tmp, steps, {"compressor": "dense"}, {"logger": logger, "log_every_n_steps": 1})[0],
                    native_hsdp(rank, steps))
    out["logged"] = _logged_bytes(logger.log_dir) if rank == 0 else []
    out["accumulate"] = (fit(rank, tmp, steps, {"compressor": "dense"}, {"accumulate_grad_batches": 2})[0],
                         native_hsdp(rank, steps, accumulate=2))
    out["mixed"] = (fit(rank, tmp, steps, {"compressor": "dense"}, mp=True)[0], native_hsdp(rank, steps, mp=True))
    out["clip"] = (fit(rank, tmp, steps, {"compressor": "dense"}, {"gradient_clip_val": 0.05})[0],
                   native_hsdp(rank, steps, clip=0.05))
    return out


def test_dense_equals_native_hsdp_and_its_bytes_are_logged(tmp_path):
    res = run_distributed(_dense_cases, WORLD, str(tmp_path), timeout=400)
    # an fp32 ring allreduce of this rank's shards across R replicas: 2 (R−1)/R · 4 bytes · their elements
    shard_rows = [-(-HID // S), -(-HID // S), -(-OUT // S)]  # padded rows of each Linear's shard
    elements = sum(r * (c + 1) for r, c in zip(shard_rows, [IN, HID, HID]))  # weight rows and bias
    assert res[0]["logged"] == [2 * (R - 1) / R * 4 * elements] * 3, "gc/bytes_inter_node, every step"
    for rank, r in enumerate(res):
        for case in ("plain", "accumulate", "mixed"):
            got, want = r[case]
            for a, b in zip(got, want):
                assert torch.equal(a, b), f"rank {rank}, {case}: differs from native HSDP"
        got, want = r["clip"]
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert not all(torch.equal(a, b) for a, b in zip(r["plain"][0], r["clip"][0])), "clipping took effect"


def test_construction_refuses_what_cannot_run():
    with pytest.raises(ValueError, match="compressor='auto' is not supported"):
        GCModelParallelStrategy(compressor="auto")
    with pytest.raises(ValueError, match="sync='diloco' does not apply"):
        GCModelParallelStrategy(compressor="topk", sync="diloco")
    with pytest.raises(ValueError, match="save_distributed_checkpoint=False"):
        GCModelParallelStrategy(compressor="topk", save_distributed_checkpoint=False)
    with pytest.raises(ValueError, match="unexpected argument 'bucket_cap_mb'"):
        GCModelParallelStrategy(compressor="topk", bucket_cap_mb=4)
    with pytest.raises(ValueError, match="Did you mean replicate_size=?"):
        GCModelParallelStrategy(compressor="topk", replicat_size=2)
    with pytest.raises(ValueError, match="replicate_size"):
        GCModelParallelStrategy(compressor="topk", replicate_size=0)
    GCModelParallelStrategy(compressor="qsgd", save_distributed_checkpoint=False)  # no memory to save


def test_the_gc_fsdp_alias_builds_the_strategy():
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_gc  # noqa: F401 - registers the aliases

    strategy = StrategyRegistry.get("gc_fsdp_qsgd")
    assert isinstance(strategy, GCModelParallelStrategy) and strategy.compression.compressor == "qsgd"
    assert "gc_fsdp_marsit" not in StrategyRegistry, "a compressor refused between replicas gets no alias"


class Unsharded(Regressor):
    def configure_model(self) -> None:  # forgets fully_shard
        return None


class NativeMesh(Regressor):
    def configure_model(self) -> None:  # shards on the 2-D mesh: FSDP2 would all-reduce across replicas itself
        shard(self.net, self.device_mesh["replicate", "data_parallel"], False)


def _misuse(rank: int, world: int, tmp: str) -> list[str]:
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(WORLD))
    out = []
    for cls in (Unsharded, NativeMesh):
        trainer = L.Trainer(strategy=GCModelParallelStrategy(replicate_size=R), accelerator="cpu", devices=WORLD,
                            max_steps=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                            enable_checkpointing=False, default_root_dir=tmp, use_distributed_sampler=False)
        try:
            trainer.fit(cls(), DataLoader(make_data(1), batch_size=BATCH))
            out.append("trained")
        except ValueError as e:
            out.append(str(e))
    return out


def test_a_model_sharded_wrongly_stops_every_rank_with_the_fix(tmp_path):
    res = run_distributed(_misuse, WORLD, str(tmp_path), timeout=300)
    assert all(r == res[0] for r in res), "every rank stops with the same message"
    unsharded, native = res[0]
    assert "no module sharded with FSDP2" in unsharded and "fully_shard(layer, mesh=" in unsharded
    assert "replicate dimension (native HSDP)" in native and "device_mesh['data_parallel']" in native
