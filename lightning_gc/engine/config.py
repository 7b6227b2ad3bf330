"""Typed, validated configuration of the engine (everything except the compressor's own options)."""

from __future__ import annotations

from dataclasses import dataclass

from .plans import PLAN_KINDS


def _int(name: str, value: object, minimum: int, hint: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} is invalid: it must be an integer ≥ {minimum}. {hint}")


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
        check_finite: agree across ranks, per group and step, whether any rank's gradient is
            non-finite (one 3-float allreduce per compressed group). On a non-finite step error
            memory is left untouched and every rank gets a non-finite gradient (or, with
            ``nonfinite="skip"`` in the strategy, the optimizer step is skipped on all ranks).
        seed: seed of all compressor randomness (shared and private streams derive from it).
        gain_ewma_beta: smoothing of the compression gain, ``ewma ← β·ewma + (1−β)·gain``.
        collective: ``"auto"`` (the compressor's natural collective) or an explicit name.
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

    def __post_init__(self) -> None:
        if self.plan not in PLAN_KINDS:
            raise ValueError(
                f"plan={self.plan!r} is not a plan kind: use one of {list(PLAN_KINDS)} "
                "('model' = whole model in one group)."
            )
        _int("plan_threshold", self.plan_threshold, 1, "Use e.g. 8192 elements per merged group.")
        _int("min_compress_numel", self.min_compress_numel, 0, "Use 0 to compress every tensor.")
        _int("warmup_steps", self.warmup_steps, 0, "Use 0 for no dense warm-up.")
        _int("seed", self.seed, 0, "Use any non-negative integer.")
        if not isinstance(self.gain_ewma_beta, (int, float)) or not (0.0 <= self.gain_ewma_beta < 1.0):
            raise ValueError(f"gain_ewma_beta={self.gain_ewma_beta!r} must lie in [0, 1); use 0.9.")
