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
from torch.utils.data import DataLoader, Subset, TensorDataset

from lightning_gc.model_parallel import GCModelParallelStrategy

R, S = 2, 2
WORLD = R * S
BATCH = 8
IN, HID, OUT = 12, 33, 3  # 33 rows: uneven shards (padding rows) on 2 shard ranks


def _data(steps: int) -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(WORLD * BATCH * steps, IN, generator=g)
    w = torch.randn(IN, OUT, generator=g)
    return TensorDataset(x, x @ w + 0.1 * torch.randn(x.shape[0], OUT, generator=g))


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(IN, HID), torch.nn.GELU(), torch.nn.Linear(HID, HID),
                               torch.nn.GELU(), torch.nn.Linear(HID, OUT))


def _shard(net: torch.nn.Module, mesh, mp: bool) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} if mp else {}
    for layer in net:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh, **kw)
    fully_shard(net, mesh=mesh, **kw)


class Regressor(L.LightningModule):
    def __init__(self, mp: bool = False) -> None:
        super().__init__()
        self.net, self.mp, self.losses = _net(), mp, []

    def configure_model(self) -> None:
        _shard(self.net, self.device_mesh["data_parallel"], self.mp)

    def training_step(self, batch, _):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x).float(), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.02)


def _full(net: torch.nn.Module) -> list[torch.Tensor]:
    return [p.full_tensor().detach().clone() for p in net.parameters()]


def _fit(rank: int, tmp: str, steps: int, strategy_kw: dict, trainer_kw: dict | None = None,
         mp: bool = False, ckpt_path: str | None = None, epoch_steps: int | None = None) -> tuple[list[torch.Tensor], list[float]]:
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(WORLD))
    model = Regressor(mp)
    trainer = L.Trainer(strategy=GCModelParallelStrategy(replicate_size=R, min_compress_numel=0, **strategy_kw),
                        accelerator="cpu", devices=WORLD, max_steps=steps, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp, use_distributed_sampler=False,
                        **({"enable_checkpointing": False} | (trainer_kw or {})))
    data = _data(epoch_steps or steps * (trainer_kw or {}).get("accumulate_grad_batches", 1))
    trainer.fit(model, DataLoader(Subset(data, range(rank, len(data), WORLD)), batch_size=BATCH), ckpt_path=ckpt_path)
    return _full(model.net), model.losses


def _native(rank: int, steps: int, accumulate: int = 1, clip: float | None = None,
            mp: bool = False) -> list[torch.Tensor]:
    """Native HSDP by hand: the oracle (FSDP2's own replica all-reduce, no Lightning)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (R, S), mesh_dim_names=("replicate", "shard"))
    net = _net()
    _shard(net, mesh, mp)
    opt = torch.optim.AdamW(net.parameters(), lr=0.02)
    data = _data(steps * accumulate)
    mine = [data[i] for i in range(rank, len(data), WORLD)]  # as the Trainer's loader of this rank
    for step in range(steps):
        for micro in range(accumulate):
            chunk = mine[(step * accumulate + micro) * BATCH:(step * accumulate + micro + 1) * BATCH]
            x, y = torch.stack([c[0] for c in chunk]), torch.stack([c[1] for c in chunk])
            net.set_requires_gradient_sync(micro == accumulate - 1)
            (torch.nn.functional.mse_loss(net(x).float(), y) / accumulate).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return _full(net)


def _dense_cases(rank: int, world: int, tmp: str) -> dict:
    steps = 3
    out = {}
    out["plain"] = (_fit(rank, tmp, steps, {"compressor": "dense"})[0], _native(rank, steps))
    out["accumulate"] = (_fit(rank, tmp, steps, {"compressor": "dense"}, {"accumulate_grad_batches": 2})[0],
                         _native(rank, steps, accumulate=2))
    out["mixed"] = (_fit(rank, tmp, steps, {"compressor": "dense"}, mp=True)[0], _native(rank, steps, mp=True))
    out["clip"] = (_fit(rank, tmp, steps, {"compressor": "dense"}, {"gradient_clip_val": 0.05})[0],
                   _native(rank, steps, clip=0.05))
    return out


def test_dense_equals_native_hsdp(tmp_path):
    res = run_distributed(_dense_cases, WORLD, str(tmp_path), timeout=400)
    for rank, r in enumerate(res):
        for case in ("plain", "accumulate", "mixed"):
            got, want = r[case]
            for a, b in zip(got, want):
                assert torch.equal(a, b), f"rank {rank}, {case}: differs from native HSDP"
        got, want = r["clip"]
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert not all(torch.equal(a, b) for a, b in zip(r["plain"][0], r["clip"][0])), "clipping took effect"


def _topk_cases(rank: int, world: int, tmp: str) -> dict:
    steps = 30
    topk, losses = _fit(rank, tmp, steps, {"compressor": "topk", "ratio": 0.1})
    dense, dense_losses = _fit(rank, tmp, steps, {"compressor": "dense"})
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
    whole, _ = _fit(rank, tmp, 6, kw, ck, epoch_steps=3)
    path = os.path.join(tmp, "sstep=3.ckpt")
    resumed, _ = _fit(rank, tmp, 6, kw, {"enable_checkpointing": False}, ckpt_path=path, epoch_steps=3)
    files = sorted(os.listdir(os.path.join(path, "lightning_gc")))
    return {"whole": whole, "resumed": resumed, "files": files}


@pytest.mark.parametrize("compressor,args", [("dense", {}), ("topk", {}), ("lowrank", {"rank": 2})])
def test_resume_from_a_distributed_checkpoint_is_exact(tmp_path, compressor, args):
    res = run_distributed(_resume_cases, WORLD, str(tmp_path), compressor, args, timeout=400)
    for r in res:
        assert r["files"] == [f"rank{i:05d}.pt" for i in range(WORLD)], "each rank saved its own error memory"
        for a, b in zip(r["whole"], r["resumed"]):
            assert torch.equal(a, b), "resuming at step 3 reproduces the uninterrupted run"


def test_construction_refuses_what_cannot_run():
    with pytest.raises(ValueError, match="compressor='auto' is not supported"):
        GCModelParallelStrategy(compressor="auto")
    with pytest.raises(ValueError, match="sync='diloco' does not apply"):
        GCModelParallelStrategy(compressor="topk", sync="diloco")
    with pytest.raises(ValueError, match="save_distributed_checkpoint=False"):
        GCModelParallelStrategy(compressor="topk", save_distributed_checkpoint=False)
    with pytest.raises(TypeError, match="unexpected argument 'bucket_cap_mb'"):
        GCModelParallelStrategy(compressor="topk", bucket_cap_mb=4)
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
        _shard(self.net, self.device_mesh["replicate", "data_parallel"], False)


def _misuse(rank: int, world: int, tmp: str) -> list[str]:
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(WORLD))
    out = []
    for cls in (Unsharded, NativeMesh):
        trainer = L.Trainer(strategy=GCModelParallelStrategy(replicate_size=R), accelerator="cpu", devices=WORLD,
                            max_steps=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                            enable_checkpointing=False, default_root_dir=tmp, use_distributed_sampler=False)
        try:
            trainer.fit(cls(), DataLoader(_data(1), batch_size=BATCH))
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


def _logged(rank: int, world: int, tmp: str) -> list[dict]:
    from lightning.pytorch.loggers import CSVLogger

    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(WORLD))
    logger = CSVLogger(tmp, name="fsdp")
    trainer = L.Trainer(strategy=GCModelParallelStrategy(compressor="bf16", replicate_size=R, min_compress_numel=0),
                        accelerator="cpu", devices=WORLD, max_steps=4, logger=logger, log_every_n_steps=2,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        default_root_dir=tmp, use_distributed_sampler=False)
    trainer.fit(Regressor(), DataLoader(_data(4), batch_size=BATCH))
    if rank:
        return []
    import csv

    with open(os.path.join(logger.log_dir, "metrics.csv")) as f:
        return [row for row in csv.DictReader(f) if row.get("gc/bytes_inter_node")]


def test_bytes_between_nodes_are_logged_as_the_ring_model_says(tmp_path):
    rows = run_distributed(_logged, WORLD, str(tmp_path), timeout=300)[0]
    assert len(rows) == 2, "every log_every_n_steps"
    # bf16 allreduce of this rank's shards across R replicas: 2 (R−1)/R · 2 bytes · elements of its shards
    shard_rows = [-(-HID // S), -(-HID // S), -(-OUT // S)]  # padded rows of each Linear's shard
    cols = [IN, HID, HID]
    elements = sum(r * (c + 1) for r, c in zip(shard_rows, cols))  # weight rows and bias of each Linear
    want = 2 * (R - 1) / R * 2 * elements
    for row in rows:
        assert float(row["gc/bytes_inter_node"]) == want
