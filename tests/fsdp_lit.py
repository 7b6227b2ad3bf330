"""What the FSDP2 tests share: a small regression model sharded per Linear, its data, a Trainer run
under ``GCModelParallelStrategy`` on harness ranks, and the oracle: native HSDP run by hand (FSDP2's
own replica all-reduce on the 2-D mesh, no Lightning, no lightning_gc)."""

from __future__ import annotations

import os

import lightning as L
import torch
from torch.utils.data import DataLoader, Subset, TensorDataset

from lightning_gc.model_parallel import GCModelParallelStrategy

R, S = 2, 2
WORLD = R * S
BATCH = 8
IN, HID, OUT = 12, 33, 3  # 33 rows: uneven shards (padding rows) on 2 shard ranks


def make_data(steps: int) -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(WORLD * BATCH * steps, IN, generator=g)
    w = torch.randn(IN, OUT, generator=g)
    return TensorDataset(x, x @ w + 0.1 * torch.randn(x.shape[0], OUT, generator=g))


def make_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(IN, HID), torch.nn.GELU(), torch.nn.Linear(HID, HID),
                               torch.nn.GELU(), torch.nn.Linear(HID, OUT))


def shard(net: torch.nn.Module, mesh, mp: bool) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} if mp else {}
    for layer in net:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh, **kw)
    fully_shard(net, mesh=mesh, **kw)


class Regressor(L.LightningModule):
    def __init__(self, mp: bool = False) -> None:
        super().__init__()
        self.net, self.mp, self.losses = make_net(), mp, []

    def configure_model(self) -> None:
        shard(self.net, self.device_mesh["data_parallel"], self.mp)

    def training_step(self, batch, _):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x).float(), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.02)


def full_params(net: torch.nn.Module) -> list[torch.Tensor]:
    return [p.full_tensor().detach().clone() for p in net.parameters()]


def fit(rank: int, tmp: str, steps: int, strategy_kw: dict, trainer_kw: dict | None = None, mp: bool = False,
        ckpt_path: str | None = None, epoch_steps: int | None = None) -> tuple[list[torch.Tensor], list[float]]:
    """A Trainer run on this harness rank (the process group exists: the strategy starts no process);
    each rank reads rows ``rank::WORLD`` of the data in order. Returns (full parameters, losses)."""
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(WORLD))
    model = Regressor(mp)
    options = {"logger": False, "enable_checkpointing": False} | (trainer_kw or {})
    trainer = L.Trainer(strategy=GCModelParallelStrategy(replicate_size=R, min_compress_numel=0, **strategy_kw),
                        accelerator="cpu", devices=WORLD, max_steps=steps, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp, use_distributed_sampler=False, **options)
    data = make_data(epoch_steps or steps * (trainer_kw or {}).get("accumulate_grad_batches", 1))
    trainer.fit(model, DataLoader(Subset(data, range(rank, len(data), WORLD)), batch_size=BATCH), ckpt_path=ckpt_path)
    return full_params(model.net), model.losses


def native_hsdp(rank: int, steps: int, accumulate: int = 1, clip: float | None = None,
                mp: bool = False) -> list[torch.Tensor]:
    """Native HSDP by hand: the oracle (FSDP2's own replica all-reduce, no Lightning)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (R, S), mesh_dim_names=("replicate", "shard"))
    net = make_net()
    shard(net, mesh, mp)
    opt = torch.optim.AdamW(net.parameters(), lr=0.02)
    data = make_data(steps * accumulate)
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
    return full_params(net)


