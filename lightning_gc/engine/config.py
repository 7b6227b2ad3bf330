"""Typed, validated configuration of the engine (everything except the compressor's own options)."""

from __future__ import annotations

from dataclasses import dataclass

from .._validation import check_bool, check_int
from ..plans import get_planner


@dataclass(frozen=True)
class EngineConfig:
    """How the engine groups, warms up, protects and measures.

    Attributes:
        plan: ``"model"`` (one group: global selection), ``"layer"`` (one group per tensor) or
            ``"threshold"`` (merge consecutive tensors up to ``plan_threshold`` elements).
        plan_threshold: elements per group for the ``"threshold"`` plan (MGS uses 8192).
        min_compress_numel: tensors with fewer elements are sent exactly (compressing a bias of
            64 elements saves nothing and costs accuracy).
        warmup_steps: optimizer steps sent dense before compression starts. The default 1 covers
            DDP's bucket rebuild after the first iteration; DGC-style schedules use a few hundred.
        error_feedback: keep what was not sent and add it to the next step's gradient.
        check_finite: agree across ranks, once per compressed step, whether any rank's gradient
            is non-finite (it travels in the step's closing report). On a non-finite step error
            memory is left untouched and every rank gets a non-finite gradient (or, with
            ``nonfinite="skip"`` in the strategy, the optimizer step is skipped on all ranks).
        seed: seed of all compressor randomness (shared and private streams derive from it).
        gain_ewma_beta: smoothing of the compression gain, ``ewma ← β·ewma + (1−β)·gain``.
        collective: ``"auto"`` (the compressor's natural collective) or an explicit name.
        network_alpha_s, network_beta_s_per_byte: pin the network model (latency per message in
            seconds, transfer time per byte in seconds) instead of probing; both or neither.
        probe_every: re-probe the network every this many optimizer steps (0 = never again). The
            count runs from the last probe of the engine's link observer (``GCEngine.link``,
            :mod:`lightning_gc.comm.link`), whichever client asked for it.
        probe_drift: re-probe when the measured communication time of the model-chosen
            collectives differs from the prediction by more than this fraction ...
        probe_patience: ... for this many consecutive steps.
        overlap: run compressed exchanges on the engine's ordered worker thread so that
            communication overlaps the rest of backward (default). ``False`` runs the same work
            inside the hook, synchronously: bit-identical results, kept as the oracle and for
            debugging.
        check_every: a compressed step opens with the *opening check* (an all-gather of a hash of
            what every rank is about to send) at the first step, after a change no other collective
            compared, and on every step divisible by ``check_every``; every closing report carries
            the same hash, so a rank that sent something else is caught before the step is applied.
            Not every step: the check is a latency-bound collective on the critical path
            (docs/concepts.md, "The opening check"). ``1`` turns a size mismatch into a message
            instead of a failure inside the collective: for debugging a custom controller.
        report_rides: send a compressed step's closing report inside the step's last message where
            that message can take it (``Exchange.carries_report``: ``lowrank``'s second allreduce)
            instead of in an allreduce of its own. The same checks and sums, one latency-bound
            collective per step fewer; the report's exchange time is then the step before's
            (lightning_gc/engine/agreement.py, ``RiddenReport``). ``False`` always sends it alone.
    """

    plan: str = "model"
    plan_threshold: int = 8192
    min_compress_numel: int = 1024
    warmup_steps: int = 1
    error_feedback: bool = True
    check_finite: bool = True
    seed: int = 0
    gain_ewma_beta: float = 0.9
    collective: str = "auto"
    network_alpha_s: float | None = None
    network_beta_s_per_byte: float | None = None
    probe_every: int = 1000
    probe_drift: float = 0.5
    probe_patience: int = 5
    overlap: bool = True
    check_every: int = 50
    report_rides: bool = True

    def __post_init__(self) -> None:
        check_bool("error_feedback", self.error_feedback, "Error feedback keeps what was not sent for the next step.")
        check_bool("check_finite", self.check_finite, "It makes ranks agree on non-finite gradients.")
        pinned = (self.network_alpha_s, self.network_beta_s_per_byte)
        if (pinned[0] is None) != (pinned[1] is None):
            raise ValueError(
                f"network_alpha_s={pinned[0]!r} and network_beta_s_per_byte={pinned[1]!r}: pin both "
                "(e.g. 1e-4 s and 8e-8 s/byte for 100 Mbit/s) or neither (measure them with the probe)."
            )
        for name, v in zip(("network_alpha_s", "network_beta_s_per_byte"), pinned):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0):
                raise ValueError(f"{name}={v!r} must be a number ≥ 0 (seconds per message / per byte).")
        check_int("probe_every", self.probe_every, 0, "Use 0 to probe only once, e.g. 1000 to refresh.")
        check_int("probe_patience", self.probe_patience, 1, "Use e.g. 5 consecutive drifted steps.")
        if not isinstance(self.probe_drift, (int, float)) or not self.probe_drift > 0:
            raise ValueError(f"probe_drift={self.probe_drift!r} must be a fraction > 0, e.g. 0.5 (50%).")
        get_planner(self.plan)  # refuses an unknown plan kind, naming the known ones
        check_bool("overlap", self.overlap, "True runs compressed exchanges on the engine's worker thread, "
                   "overlapped with backward; False runs them inside the hook.")
        check_bool("report_rides", self.report_rides, "True sends the closing report inside the step's last "
                   "message where it can ride; False sends it in an allreduce of its own.")
        check_int("check_every", self.check_every, 1, "Use 1 to check before every compressed step, e.g. 50 to "
             "check every 50 steps (the closing report checks every step either way).")
        check_int("plan_threshold", self.plan_threshold, 1, "Use e.g. 8192 elements per merged group.")
        check_int("min_compress_numel", self.min_compress_numel, 0, "Use 0 to compress every tensor.")
        check_int("warmup_steps", self.warmup_steps, 0, "Use 0 for no dense warm-up.")
        check_int("seed", self.seed, 0, "Use any non-negative integer.")
        if not isinstance(self.gain_ewma_beta, (int, float)) or not (0.0 <= self.gain_ewma_beta < 1.0):
            raise ValueError(f"gain_ewma_beta={self.gain_ewma_beta!r} must lie in [0, 1); use 0.9.")
