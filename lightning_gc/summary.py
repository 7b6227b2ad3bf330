"""End-of-fit summary: what compression did, in one short block.

:func:`summarize` turns the engine's cumulative counters (:meth:`GCEngine.totals`, this rank's
view) and the strategy's count of skipped optimizer steps into a :class:`GCSummary`;
``GCStrategy.summary()`` returns it and :class:`~lightning_gc.callbacks.GCMonitor` prints
:meth:`GCSummary.format` on rank zero at the end of ``fit``.

Bytes are *modelled* bytes this rank sends with the collectives' algorithms (e.g. a ring allreduce
of M bytes sends 2(N−1)/N·M); the dense equivalent is what the same steps would have sent with a
dense fp32 ring allreduce of every gradient, so ``bytes_ratio`` is the fraction of that traffic
compression left (0.03 = 33× less).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class GCSummary:
    """Cumulative facts of one process's communication since the start of training.

    Attributes:
        compressor: compressor name (``topk``, ``qsgd``, ...).
        collective: the exchange compressed groups travel by (``allgather``, ``art_ring``, ...).
        world_size: ranks in the process group.
        rank: this process's rank (the figures are this rank's).
        steps: optimizer steps the engine saw.
        compressed_steps: steps the compressor compressed.
        sample_steps: steps a compressor sent in another form to learn from (GradiVeQ's PCA sample
            steps, QSGD-quantised); 0 for every other compressor.
        dense_steps: steps sent exactly: the engine's warm-up, a compressor's own exact warm-up
            (GradiVeQ's ``warmup``), Marsit's full-precision rounds, and every step of a lossless
            or all-exact configuration (every tensor below ``min_compress_numel``).
        bytes_sent: modelled bytes this rank sent (payloads and the small stats allreduce).
        bytes_dense: bytes a dense fp32 ring allreduce of the same steps would have sent.
        bytes_ratio: ``bytes_sent / bytes_dense`` (1.0 when nothing was communicated).
        compress_time_s: seconds in compression, decompression and aggregation.
        comm_time_s: seconds inside collectives.
        nonfinite_steps: steps whose gradient was non-finite on some rank.
        skipped_steps: optimizer steps the strategy skipped because of that (``nonfinite="skip"``).
        outer_steps: ``sync="diloco"``: outer steps taken (``None`` otherwise). Then ``steps`` counts
            the inner optimizer steps, none of which sent a gradient, and ``bytes_dense`` is what
            DDP's fp32 ring allreduce would have sent for all of them.
        auto_decisions: ``compressor="auto"``: every decision (step, trigger, chosen method, its
            predicted step and the step measured in the first window after it; ``None`` otherwise).
    """

    compressor: str
    collective: str
    world_size: int
    rank: int
    steps: int
    compressed_steps: int
    sample_steps: int
    dense_steps: int
    bytes_sent: int
    bytes_dense: int
    bytes_ratio: float
    compress_time_s: float
    comm_time_s: float
    nonfinite_steps: int
    skipped_steps: int
    outer_steps: int | None = None
    auto_decisions: list[dict[str, Any]] | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def format(self) -> str:
        """A few lines for the console."""
        if self.world_size <= 1:
            traffic = "nothing communicated (world size 1)"
        else:
            saving = (f"{1 / self.bytes_ratio:.1f}x less" if 0 < self.bytes_ratio < 1
                      else "nothing sent" if self.bytes_ratio <= 0 else "no saving")
            traffic = (f"{_fmt_bytes(self.bytes_sent)} sent vs {_fmt_bytes(self.bytes_dense)} dense fp32 ring "
                       f"allreduce (ratio {self.bytes_ratio:.4f}, {saving})")
        return "\n".join([
            f"lightning_gc summary (rank {self.rank} of {self.world_size}): compressor={self.compressor} "
            f"collective={self.collective}",
            (f"  optimizer steps: {self.steps} (DiLoCo: {self.outer_steps} outer steps on the pseudo-gradient; "
             "inner steps send nothing)" if self.outer_steps is not None else
             f"  optimizer steps: {self.steps} ({self.compressed_steps} compressed, "
             + (f"{self.sample_steps} sample, " if self.sample_steps else "")
             + f"{self.dense_steps} dense)"),
            f"  bytes: {traffic}",
            f"  time: compression {self.compress_time_s:.3f} s, communication {self.comm_time_s:.3f} s",
            f"  non-finite gradient steps: {self.nonfinite_steps} (optimizer steps skipped: {self.skipped_steps})",
            *[_auto_line(d) for d in self.auto_decisions or ()],
        ])


def _auto_line(d: dict[str, Any]) -> str:
    measured = d.get("measured_step_s")
    seen = f", measured {1e3 * measured:.1f} ms" if measured is not None else ""
    return (f"  auto: step {d['step']} ({d['trigger']}): chose {d['chosen']!r}, predicted "
            f"{1e3 * d['predicted_step_s']:.1f} ms/step{seen} (runner-up {d['runner_up']!r}"
            + (", by a lower bound: its codec was not timed)" if d.get("runner_up_bound") else ")"))


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"  # pragma: no cover


def summarize(engine: Any, compressor: str, skipped_steps: int, diloco: Any = None, auto: Any = None) -> GCSummary:
    """Build the summary from ``engine.totals()``, the engine's exchange and the skipped steps
    (with ``sync="diloco"``, from the DiLoCo synchroniser's step counts: the engine sees no step)."""
    t = engine.totals()
    steps, compressed, sample = int(t["steps"]), int(t["compressed_steps"]), int(t.get("sample_steps", 0))
    sent, dense = int(t["bytes_sent"]), int(t["bytes_dense"])
    collective = str(engine.exchange.name)
    outer = None
    if diloco is not None:
        steps, compressed, sample = int(diloco.inner_step), 0, 0
        dense = steps * int(diloco.dense_bytes_per_step)
        collective = diloco.exchange.name if diloco.exchange is not None else "allreduce (dense Δ)"
        outer = int(diloco.outer_steps)
    return GCSummary(
        compressor=compressor,
        collective=collective,
        world_size=int(engine.world_size),
        rank=int(engine.rank),
        steps=steps,
        compressed_steps=compressed,
        sample_steps=sample,
        dense_steps=steps - compressed - sample,
        bytes_sent=sent,
        bytes_dense=dense,
        bytes_ratio=sent / dense if dense > 0 else 1.0,
        compress_time_s=float(t["compress_time_s"]),
        comm_time_s=float(t["comm_time_s"]),
        nonfinite_steps=int(t["nonfinite_steps"]),
        skipped_steps=int(skipped_steps),
        outer_steps=outer,
        auto_decisions=None if auto is None else auto.decisions(),
    )
