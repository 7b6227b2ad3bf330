"""Figure of docs/lowbit.md: bytes per rank per step against N, and the ring's error growth.

    python docs/studies/lowbit_bytes.py docs/studies/lowbit_bytes.png

Bytes come from the byte models of the code (lightning_gc.comm.cost_model and the compressors'
payload sizes) for the `gpt` preset's 437,760 gradient elements; the error factor is
lightning_gc.compressors.lowbit.ring_error_factor (equal gradients on every rank, the worst case)
and its independent-gradient counterpart. Nothing is measured here: it is the model the docs state.
"""

from __future__ import annotations

import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from lightning_gc.comm.cost_model import allgather_bytes, lowbit_ring_bytes, ring_allreduce_bytes  # noqa: E402
from lightning_gc.compressors import GroupContext, build_compressor  # noqa: E402
from lightning_gc.compressors.lowbit import ring_error_factor  # noqa: E402

NUMEL = 437_760
NS = [2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]


def main(out: str) -> None:
    ctx = GroupContext(step=0, rank=0, world_size=2, segments=(NUMEL,))
    qsgd = sum(t.numel() * t.element_size() for t in build_compressor("qsgd").compress(
        __import__("torch").zeros(NUMEL), ctx).payload)
    series = {
        "DDP fp32 (ring)": [ring_allreduce_bytes(4 * NUMEL, n) for n in NS],
        "fp16 hook (ring)": [ring_allreduce_bytes(2 * NUMEL, n) for n in NS],
        "qsgd (allgather)": [allgather_bytes(qsgd, n) for n in NS],
        "lowbit 8 bits": [lowbit_ring_bytes(NUMEL, n, 8, 128) for n in NS],
        "lowbit 4 bits": [lowbit_ring_bytes(NUMEL, n, 4, 128) for n in NS],
    }
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for label, ys in series.items():
        a.plot(NS, [y / 1e6 for y in ys], marker="o", ms=3, label=label)
    a.set(xscale="log", yscale="log", xlabel="ranks N", ylabel="MB sent per rank per step",
          title="gpt (437,760 elements): bytes per rank")
    a.legend(fontsize=8)
    b.plot(NS, [ring_error_factor(n) for n in NS], marker="o", ms=3, label="equal gradients (worst)")
    b.plot(NS, [(n - 1) / (2 * n) + 1 / n for n in NS], marker="o", ms=3, label="independent gradients")
    b.set(xscale="log", yscale="log", xlabel="ranks N", ylabel="variance / one rank's rounding",
          title="lowbit: error variance of the mean")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "lowbit_bytes.png")
