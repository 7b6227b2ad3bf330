"""Study script (not part of the package): how many steps does Top-k with error feedback need,
against dense, and do error measures of the gradient predict it? docs/measurements/auto.md, "Why the error
proxy misranks Top-k on lm".

N ranks of data-parallel training are simulated in one process: each step takes N consecutive
batches of the preset's training loader (one per "rank"), computes each one's gradient, and
aggregates them as the engine's methods would:

* ``dense``: the mean;
* ``fp16``: the sum of each rank's fp16 cast of its gradient / N (torch's fp16 hook);
* ``topk_mc``: Top-k with momentum correction (Lin et al., DGC, ICLR 2018): each rank runs the
  optimizer's momentum on its own gradient (``u = μu + g``), accumulates ``u`` into its memory,
  sends the top ``ratio`` of that memory, and zeroes the sent coordinates of both (momentum factor
  masking); the aggregate is applied by the optimizer with its momentum set to 0. This is *not* in
  the engine (its error feedback runs on gradients, with momentum applied to the aggregate);
* ``topk``: tensors of at least 1024 elements form one group (``plan="model"``,
  ``min_compress_numel``); each rank keeps the ``ratio`` largest magnitudes of its gradient plus its
  error memory, keeps the rest as memory, and the aggregate is the mean of the ranks' sparse vectors
  (the allgather path). Smaller tensors are averaged exactly.

The aggregate then goes through the preset's clipping and optimizer, as in a Trainer. Every
``--eval-every`` steps the preset's metric is computed on the first 16 validation batches; the run
stops at the target. ``--proxy-starts`` also measures, on the dense trajectory, Top-k's error
measures over windows of ``--proxy-windows`` steps (nothing of it is applied):

* ``d2_oneshot``: the ranks' mean of ``‖g − C(g)‖²/‖g‖²`` at the window's first step (what
  ``compressor="auto"`` measures);
* ``d2_ef_last``: the same for ``x = g + e`` (error memory since the window began) at its last step;
* ``cos``, ``norm_ratio``, ``resid``: of the window's summed applied update ``A`` (the aggregates)
  against the summed exact mean gradient ``G``: ``cos(A, G)``, ``‖A‖/‖G‖``, ``‖G − A‖²/‖G‖²``.

Usage (from the repo root, with the package installed)::

    python docs/studies/progress_sim.py --preset lm --method topk --steps 600 --eval-every 25
    python docs/studies/progress_sim.py --preset lm --method dense --steps 110 --eval-every 0 \\
        --proxy-starts 1,20,80 --proxy-windows 5,10,25
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F

from lightning_gc.examples.presets import get_preset


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="lm")
    ap.add_argument("--method", choices=["dense", "fp16", "topk", "topk_mc"], default="dense")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--ratio", type=float, default=0.01)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--eval-every", type=int, default=25, help="0: never evaluate")
    ap.add_argument("--lr", type=float, default=None, help="the preset's lr otherwise (the bench used 0.05 on quickstart)")
    ap.add_argument("--proxy-starts", default="", help="steps at which Top-k's error windows start")
    ap.add_argument("--proxy-windows", default="5,10,25")
    a = ap.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(0)
    p = get_preset(a.preset, seed=0, **({"lr": a.lr} if a.lr is not None else {}))
    model, dm = p.model, p.datamodule
    dm.prepare_data()
    dm.setup("fit")
    opt = model.configure_optimizers()
    opt = opt["optimizer"] if isinstance(opt, dict) else opt[0] if isinstance(opt, (list, tuple)) else opt
    clip = getattr(model.hparams, "grad_clip", 0) or 0
    params = [q for q in model.parameters() if q.requires_grad]
    mask = torch.cat([torch.full((q.numel(),), q.numel() >= 1024, dtype=torch.bool) for q in params])
    n_big, N = int(mask.sum()), a.ranks
    k = max(1, round(a.ratio * n_big))
    val = list(dm.val_dataloader())[:16]
    lm = hasattr(model, "_loss")

    def loss_of(batch):
        return model._loss(batch) if lm else F.cross_entropy(model(batch[0]), batch[1])

    def evaluate() -> float:
        model.eval()
        with torch.no_grad():
            if lm:
                v = sum(model._loss(b).item() for b in val) / len(val) / math.log(2)
            else:
                v = sum((model(x).argmax(-1) == y).sum().item() for x, y in val) / sum(y.numel() for _, y in val)
        model.train()
        return v

    def topk_sent(x):
        idx = x.abs().topk(k).indices
        s = torch.zeros_like(x)
        s[idx] = x[idx]
        return s

    loader = iter(dm.train_dataloader())

    def next_batch():
        nonlocal loader
        try:
            return next(loader)
        except StopIteration:
            loader = iter(dm.train_dataloader())
            return next(loader)

    memory = [torch.zeros(n_big) for _ in range(N)]
    velocity = [torch.zeros(n_big) for _ in range(N)]
    mu = opt.param_groups[0].get("momentum", 0.0)
    small_velocity = torch.zeros(int((~mask).sum()))
    if a.method == "topk_mc":  # the ranks own the momentum of the compressed group
        for group in opt.param_groups:
            group["momentum"] = 0.0
    starts = [int(s) for s in a.proxy_starts.split(",") if s]
    windows = [int(w) for w in a.proxy_windows.split(",") if w]
    shadows: dict = {}
    curve, reached = [], None
    model.train()
    for step in range(1, a.steps + 1):
        grads = []
        for _ in range(N):
            opt.zero_grad(set_to_none=False)
            loss_of(next_batch()).backward()
            grads.append(torch.cat([q.grad.reshape(-1) for q in params]).clone())
        if a.method == "dense":
            agg = sum(grads) / N
        elif a.method == "fp16":
            agg = sum(g.half().div(N).float() for g in grads)
        elif a.method == "topk":
            agg = sum(grads) / N
            sparse = torch.zeros(n_big)
            for r, g in enumerate(grads):
                x = g[mask] + memory[r]
                s = topk_sent(x)
                memory[r] = x - s
                sparse += s / N
            agg[mask] = sparse
        else:  # topk_mc; the small tensors keep the optimizer's momentum through a velocity of their own
            agg = sum(grads) / N
            sparse = torch.zeros(n_big)
            for r, g in enumerate(grads):
                velocity[r].mul_(mu).add_(g[mask])
                x = memory[r] + velocity[r]
                s = topk_sent(x)
                sent_at = s != 0
                memory[r] = x - s
                velocity[r][sent_at] = 0.0
                sparse += s / N
            small_v = small_velocity.mul_(mu).add_(agg[~mask])
            agg[mask] = sparse
            agg[~mask] = small_v
        for st in starts:
            for m in windows:
                if step == st:
                    shadows[(st, m)] = {"mem": [torch.zeros(n_big) for _ in range(N)], "A": torch.zeros(n_big),
                                        "G": torch.zeros(n_big), "d2": [], "d2ef": []}
                sh = shadows.get((st, m))
                if sh is None or step >= st + m:
                    continue
                for r, g in enumerate(grads):
                    gb = g[mask]
                    x = gb + sh["mem"][r]
                    s = topk_sent(x)
                    sh["mem"][r] = x - s
                    sh["A"] += s / N
                    sh["G"] += gb / N
                    if step == st:
                        sh["d2"].append(((gb - topk_sent(gb)).norm() ** 2 / gb.norm() ** 2).item())
                    sh["d2ef"].append(((x - s).norm() ** 2 / x.norm() ** 2).item())
                if step == st + m - 1:
                    A, G = sh["A"], sh["G"]
                    print(json.dumps({"start": st, "window": m, "d2_oneshot": sum(sh["d2"]) / N,
                                      "d2_ef_last": sum(sh["d2ef"][-N:]) / N,
                                      "cos": (A @ G / (A.norm() * G.norm())).item(),
                                      "norm_ratio": (A.norm() / G.norm()).item(),
                                      "resid": ((G - A).norm() ** 2 / G.norm() ** 2).item()}), flush=True)
        offset = 0
        for q in params:
            q.grad.copy_(agg[offset:offset + q.numel()].view_as(q))
            offset += q.numel()
        if clip:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        if a.eval_every and step % a.eval_every == 0:
            v = evaluate()
            curve.append((step, round(v, 4)))
            if p.reached(v):
                reached = step
                break
    print(json.dumps({"preset": a.preset, "method": a.method, "ratio": a.ratio, "steps_to_target": reached,
                      "target": p.target, "curve": curve}))


if __name__ == "__main__":
    main()
