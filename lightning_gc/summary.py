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
        bytes_inter_node: ``topology="nodes"``: of ``bytes_sent``, the modelled bytes this rank sent
            between nodes (``None`` on a flat topology, which does not tell them apart).
        compress_time_s: seconds in compression, decompression and aggregation.
        comm_time_s: seconds inside collectives.
        nonfinite_steps: steps whose gradient was non-finite on some rank.
        skipped_steps: optimizer steps the strategy skipped because of that (``nonfinite="skip"``).
        outer_steps: ``sync="diloco"``: outer steps taken (``None`` otherwise). Then ``steps`` counts
            the inner optimizer steps, none of which sent a gradient, and ``bytes_dense`` is what
            DDP's fp32 ring allreduce would have sent for all of them.
        auto_decisions: ``compressor="auto"``: every decision (step, trigger, chosen method, its
            predicted step and the step measured in the first window after it, and the best *other*
            method with its predicted step; ``None`` otherwise): :func:`auto_decisions`.
        diloco_steps: ``compressor="auto"`` with ``auto_diloco``: ``{"inner": steps DiLoCo ran (part of
            ``steps``, sending nothing; ``bytes_dense`` counts DDP's bytes for them too), "outer": its
            outer steps}``; ``None`` otherwise.
        osp: ``sync="osp"``: ``steps``, ``deferred_fraction`` (mean over those steps of the fraction of
            the model's elements whose synchronisation was deferred to overlap the next step) and
            ``deferred_bytes`` (bytes this rank sent for them, part of ``bytes_sent``); ``None`` otherwise.
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
    diloco_steps: dict | None = None
    auto_decisions: list[dict[str, Any]] | None = None
    osp: dict[str, Any] | None = None
    bytes_inter_node: int | None = None

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
             + ("inner steps send nothing)" if self.bytes_inter_node is None else
                "nodes are the workers: inner steps average gradients inside the node)")
             if self.outer_steps is not None else
             f"  optimizer steps: {self.steps} ({self.compressed_steps} compressed, "
             + (f"{self.sample_steps} sample, " if self.sample_steps else "")
             + f"{self.dense_steps} dense"
             + (f", {self.diloco_steps['inner']} DiLoCo inner steps with {self.diloco_steps['outer']} outer steps"
                if self.diloco_steps else "") + ")"),
            f"  bytes: {traffic}",
            *([f"  between nodes: {_fmt_bytes(self.bytes_inter_node)} of the bytes sent "
               f"({self.bytes_inter_node / self.bytes_sent:.0%}; topology=nodes)"]
              if self.bytes_inter_node is not None and self.bytes_sent > 0 else []),
            f"  time: compression {self.compress_time_s:.3f} s, communication {self.comm_time_s:.3f} s"
            + (" (the outer exchanges)" if self.outer_steps is not None else ""),
            *([_osp_line(self.osp, self.bytes_sent)] if self.osp is not None else []),
            f"  non-finite gradient steps: {self.nonfinite_steps} (optimizer steps skipped: {self.skipped_steps})",
            *[_auto_line(d) for d in self.auto_decisions or ()],
        ])


#: ``compressor="auto"``'s decision triggers in plain words (the chooser's names in brackets)
AUTO_TRIGGERS = {
    "warmup": "first choice, from the dense warm-up's measurements",
    "periodic": "periodic look at the link",
    "drift": "the step time drifted",
    "gain": "the compressors' errors were measured again",
    "calibration": "re-decided after measuring the method's real step",
    "family": "trial of a dense sibling (ddp, fp16 and bf16 share one path, so one's measurement predicts the others)",
}


def _auto_line(d: dict[str, Any]) -> str:
    measured = d.get("measured_step_s")
    seen = f", measured {1e3 * measured:.1f} ms" if measured is not None else ""
    why = AUTO_TRIGGERS.get(d["trigger"], d["trigger"])
    line = (f"  auto, step {d['step']} ({why}): chose {d['chosen']!r}, predicted "
            f"{1e3 * d['predicted_step_s']:.1f} ms/step{seen}")
    other = d.get("runner_up")
    if other is None:
        return line
    step = d.get("runner_up_step_s")
    return (line + f"; best other method {other!r}" + (f", predicted {1e3 * step:.1f} ms/step" if step is not None else "")
            + (" (a lower bound: its codec was not timed)" if d.get("runner_up_bound") else ""))


def _osp_line(osp: dict[str, Any], bytes_sent: int) -> str:
    share = f" ({osp['deferred_bytes'] / bytes_sent:.0%} of the bytes sent)" if bytes_sent > 0 else ""
    return (f"  OSP (sync='osp'): {osp['deferred_fraction']:.1%} of the model's elements deferred per step on average "
            f"(synchronised while the next step computes, over {osp['steps']} steps); the deferred stage sent "
            f"{_fmt_bytes(osp['deferred_bytes'])}{share}")


def auto_decisions(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every decision of ``compressor="auto"``'s history in brief: step, trigger, the choice, its
    predicted step, the step measured in the first window after it (``None`` until then), and the
    best method other than the choice by predicted time per unit of progress (the choice need not be
    the model's minimum: a margin can hold the running method, a trial installs a sibling)."""
    out = []
    for h in history:
        preds = h["predictions"]
        others = sorted((kv for kv in preds.items() if kv[0] != h["chosen"]),
                        key=lambda kv: kv[1]["time_per_progress_s"])
        runner = others[0] if others else None
        out.append({"step": h["step"], "trigger": h["trigger"], "chosen": h["chosen"],
                    "predicted_step_s": preds[h["chosen"]]["step_s"],
                    "measured_step_s": h.get("measured_step_s"),
                    "runner_up": runner[0] if runner else None,
                    "runner_up_step_s": runner[1]["step_s"] if runner else None,
                    # ranked by a lower bound: its codec was not timed (time_codecs="on_demand")
                    "runner_up_bound": bool(runner and runner[1].get("details", {}).get("lower_bound"))})
    return out


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"  # pragma: no cover


def summarize(engine: Any, compressor: str, skipped_steps: int, diloco: Any = None, auto: Any = None,
              osp: Any = None) -> GCSummary:
    """Build the summary from ``engine.totals()``, the engine's exchange and the skipped steps
    (with ``sync="diloco"``, from the DiLoCo synchroniser's step counts and exchange times: the
    engine sees no step; with ``sync="osp"``, the OSP synchroniser's deferred share)."""
    t = engine.totals()
    steps, compressed, sample = int(t["steps"]), int(t["compressed_steps"]), int(t.get("sample_steps", 0))
    sent, dense = int(t["bytes_sent"]), int(t["bytes_dense"])
    comm_s = float(t["comm_time_s"])
    collective = str(engine.exchange.name)
    outer, local = None, None
    if diloco is not None and diloco.switch is not None:  # auto's: some steps per-step, some DiLoCo's
        local = {"inner": int(diloco.steps_run), "outer": int(diloco.outer_steps_run)}
        steps += local["inner"]
        dense += local["inner"] * int(diloco.dense_bytes_per_step)
        comm_s += float(diloco.comm_s_total)
    elif diloco is not None:
        steps, compressed, sample = int(diloco.inner_step), 0, 0
        dense = steps * int(diloco.dense_bytes_per_step)
        collective = diloco.exchange.name if diloco.exchange is not None else "allreduce (dense Δ)"
        outer = int(diloco.outer_steps)
        comm_s += float(diloco.comm_s_total)  # the engine's hook never runs: no step time of its own
    osp_facts = None
    if osp is not None:
        n = int(osp.summary_steps)
        osp_facts = {"steps": n, "deferred_fraction": osp.deferred_fraction_sum / n if n else 0.0,
                     "deferred_bytes": int(osp.deferred_bytes_sent)}
    return GCSummary(
        compressor=compressor,
        collective=collective,
        world_size=int(engine.world_size),
        rank=int(engine.rank),
        steps=steps,
        compressed_steps=compressed,
        sample_steps=sample,
        dense_steps=steps - compressed - sample - (local["inner"] if local else 0),
        bytes_sent=sent,
        bytes_dense=dense,
        bytes_ratio=sent / dense if dense > 0 else 1.0,
        compress_time_s=float(t["compress_time_s"]),
        comm_time_s=comm_s,
        nonfinite_steps=int(t["nonfinite_steps"]),
        skipped_steps=int(skipped_steps),
        outer_steps=outer,
        diloco_steps=local,
        auto_decisions=None if auto is None else auto_decisions(auto.history),
        osp=osp_facts,
        bytes_inter_node=int(t.get("bytes_inter_node", 0)) or None,  # only topology="nodes" counts them
    )
