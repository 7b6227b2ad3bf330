"""Re-measure the single-process figures quoted in docs/workloads.md.

Two measurements, each a plain loop over the preset's own model and data (no Trainer, one CPU
thread, seeded), so that a reader can check the docs on their machine:

``python -m lightning_gc.examples.measure synthetic-images``
    How hard ``SyntheticImageData`` (the ``cnn`` preset's data) is: a linear classifier on raw
    pixels (Adam, lr 1e-3, batch 64, 3 epochs) against the preset's ResNet-18 at ``--width``
    (its own optimizer, batch 16, validated every 50 steps up to ``--steps``).

``python -m lightning_gc.examples.measure step-time --preset NAME [--precision P] [--steps N]``
    One preset's step time without a Trainer (``training_step`` + ``backward`` +
    ``optimizer.step()``, median of ``N - 2`` steps after 2 untimed ones) in ``32-true`` or
    ``bf16-mixed`` (autocast around the forward, as Lightning's precision plugin does). On a CPU
    without bf16 instructions (AVX512-BF16/AMX) the bf16 products are emulated and slower than
    fp32; with them, faster.

``python -m lightning_gc.examples.measure gpt-fit --precision P``
    The same preset trained by ``Trainer(accelerator="cpu", devices=4, strategy="ddp",
    precision=P, max_steps=45)``, one thread per rank: the median over steps 6-45 of the slowest
    rank's batch time (``on_train_batch_start`` to ``on_train_batch_end``). One precision per
    invocation: Lightning starts the other ranks by re-running the command.

Accuracies are a function of the seed; times depend on the machine and on what else runs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.nn import functional as F

from .presets import get_preset


def _accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 256) -> float:
    model.eval()
    with torch.no_grad():
        hits = sum(int((model(x[i:i + batch]).argmax(1) == y[i:i + batch]).sum()) for i in range(0, len(x), batch))
    return hits / len(x)


def synthetic_images(width: int = 16, steps: int = 400, epochs: int = 3, seed: int = 0,
                     num_train: int = 8192, log=print) -> dict:
    """Linear-classifier accuracy per epoch and the ResNet's accuracy every 50 steps."""
    preset = get_preset("cnn", seed=seed, width=width, num_train=num_train)
    data = preset.datamodule
    xtr, ytr = data.generate("train")
    xva, yva = data.generate("val")
    out: dict = {"linear": [], "resnet": []}

    torch.manual_seed(seed)
    linear = torch.nn.Linear(xtr[0].numel(), int(data.hparams.num_classes))
    opt = torch.optim.Adam(linear.parameters(), lr=1e-3)
    flat_val = xva.flatten(1)
    for epoch in range(1, epochs + 1):
        perm = torch.randperm(len(xtr))
        for i in range(0, len(xtr), 64):
            idx = perm[i:i + 64]
            opt.zero_grad()
            F.cross_entropy(linear(xtr[idx].flatten(1)), ytr[idx]).backward()
            opt.step()
        acc = _accuracy(linear, flat_val, yva)
        out["linear"].append((epoch, acc))
        log(f"linear classifier on pixels: epoch {epoch} val_acc {acc:.4f}")

    torch.manual_seed(seed)
    model = preset.model
    opt = model.configure_optimizers()
    perm = torch.randperm(len(xtr))
    batch = 16
    for step in range(1, steps + 1):
        start = (step - 1) * batch % len(xtr)
        idx = perm[start:start + batch]
        model.train()
        opt.zero_grad()
        F.cross_entropy(model(xtr[idx]), ytr[idx]).backward()
        opt.step()
        if step % 50 == 0 or step == steps:
            acc = _accuracy(model, xva, yva)
            out["resnet"].append((step, acc))
            log(f"ResNet-18 width {width}: step {step} val_acc {acc:.4f}")
    return out


def step_time(preset: str, precision: str = "32-true", steps: int = 15, untimed: int = 2, log=print) -> float:
    """Median seconds of one training step of ``preset`` (``training_step`` + ``backward`` + ``step``).

    No Trainer: the preset's model, its optimizer and real batches from its datamodule, with the
    forward under ``torch.autocast(bfloat16)`` for ``"bf16-mixed"`` (as Lightning's precision
    plugin does). ``gpt`` is built with ``total_steps=1000`` (its schedule needs a length)."""
    if steps <= untimed:
        raise ValueError(f"steps={steps} must exceed untimed={untimed}: nothing would be timed.")
    if precision not in ("32-true", "bf16-mixed"):
        raise ValueError(f"precision={precision!r} is not measured here; use '32-true' or 'bf16-mixed'.")
    p = get_preset(preset, seed=0, **({"total_steps": 1000} if preset == "gpt" else {}))
    model = p.model
    opt = model.configure_optimizers()
    opt = opt["optimizer"] if isinstance(opt, dict) else opt
    p.datamodule.setup("fit")
    batches = iter(p.datamodule.train_dataloader())
    times = []
    for i in range(steps):
        batch = next(batches)
        t0 = time.perf_counter()
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
            loss = model.training_step(batch, i)
        loss = loss["loss"] if isinstance(loss, dict) else loss
        loss.float().backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    median = statistics.median(times[untimed:])
    log(f"{preset} {precision}: median of {steps - untimed} steps after {untimed} untimed: {median * 1000:.1f} ms")
    return median


class _BatchTimer:
    """Lightning callback: wall time of every training batch on this rank."""

    def __new__(cls):
        import lightning as L

        class BatchTimer(L.Callback):
            def __init__(self) -> None:
                self.times: list[float] = []
                self._t0 = 0.0

            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
                self._t0 = time.perf_counter()

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
                self.times.append(time.perf_counter() - self._t0)

        return BatchTimer()


def gpt_fit(precision: str = "32-true", devices: int = 4, steps: int = 45, skip: int = 5, log=print) -> float:
    """Median (over steps ``skip+1 .. steps``) of the slowest rank's batch time, in seconds."""
    import lightning as L

    # one precision per process: Lightning's launcher re-runs this command for the other ranks
    preset = get_preset("gpt", seed=0, total_steps=1000)
    timer = _BatchTimer()
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy="ddp", precision=precision,
                        max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0, callbacks=[timer])
    trainer.fit(preset.model, datamodule=preset.datamodule)
    mine = torch.tensor(timer.times[skip:steps], dtype=torch.float64)
    if torch.distributed.is_initialized():  # the slowest rank at each step
        torch.distributed.all_reduce(mine, op=torch.distributed.ReduceOp.MAX)
    median = float(mine.median())
    if trainer.global_rank == 0:
        log(f"gpt {precision}, {devices} ranks: median slowest-rank batch time over steps "
            f"{skip + 1}-{steps}: {median * 1000:.0f} ms")
    return median


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_gc.examples.measure", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    s = sub.add_parser("synthetic-images", help="linear classifier vs ResNet-18 on the cnn preset's data")
    s.add_argument("--width", type=int, default=16)
    s.add_argument("--steps", type=int, default=400)
    s.add_argument("--seed", type=int, default=0)
    g = sub.add_parser("step-time", help="one preset's training step without a Trainer")
    g.add_argument("--preset", required=True)
    g.add_argument("--precision", choices=("32-true", "bf16-mixed"), default="32-true")
    g.add_argument("--steps", type=int, default=15)
    f = sub.add_parser("gpt-fit", help="the gpt preset on 4 DDP ranks in 32-true and bf16-mixed")
    f.add_argument("--precision", choices=("32-true", "bf16-mixed"), default="32-true")
    f.add_argument("--devices", type=int, default=4)
    f.add_argument("--steps", type=int, default=45)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.what == "synthetic-images":
        synthetic_images(width=args.width, steps=args.steps, seed=args.seed)
    elif args.what == "step-time":
        step_time(args.preset, precision=args.precision, steps=args.steps)
    else:
        gpt_fit(precision=args.precision, devices=args.devices, steps=args.steps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
