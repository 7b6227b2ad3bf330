"""A decision's history record and its log lines (pure: the decision's figures in, a dict and text out).

The record (``AutoChooser.history``) is replicated and checkpointed; the bench's report and the
monitor read its keys, so they are kept as they are.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

from .config import AutoConfig
from .model import table
from .policy import Decision, Trigger, sentence
from .state import AutoState

#: the parts of a decision's own time the record holds (``decide_parts_s``, each the slowest rank's, so
#: they need not add up to ``decide_s``, which also holds the model, the agreements and the switch)
DECIDE_PARTS = ("latency", "probe", "check", "codecs")


@dataclass(frozen=True)
class Context:
    """What a decision used besides the policy's output: where its network came from (``source``), the
    link check, the warm-up's dense step, the model inputs, the running method's figure, which drift test
    started it, and the switch check (a gain or calibration move to a dense mode that timed the link)."""

    source: str
    link_check: dict | None
    dense_wall_s: float | None
    dense_exposed_s: float | None
    valid: Mapping[str, float]
    settled: list[str]
    shift_s: float
    shift_from: list[str]
    running_figure_s: float | None
    drift_test: str | None
    switch_check: dict | None
    kept_reference: bool


def entry(step: int, trigger: Trigger, d: Decision, ctx: Context, st: AutoState, dense: Collection[str]) -> dict:
    """The history record of a decision (``st`` after it)."""
    assert st.network is not None and st.workload is not None and st.costs is not None
    return {"step": step, "trigger": trigger.value, "chosen": d.chosen, "previous": d.previous,
            "network": [st.network.alpha_s, st.network.beta_s_per_byte], "probe_bytes": st.probe_bytes,
            "beta_scale": st.beta_scale, "link_check": ctx.link_check, "network_source": ctx.source,
            "dense_exposed_s": ctx.dense_exposed_s, "workload": st.workload.as_dict(),
            "costs": [c.as_dict() for c in st.costs], "predictions": {k: v.as_dict() for k, v in d.predictions.items()},
            # a decision that kept its reference was measured by it already
            "dense_wall_s": ctx.dense_wall_s, "measured_step_s": st.reference if ctx.kept_reference else None,
            "kept_reference": ctx.kept_reference, "corrections": dict(ctx.valid), "settled": ctx.settled,
            "shift_s": ctx.shift_s, "shift_from": ctx.shift_from, "explore_left": st.explore_left,
            "link_interval": st.link_interval, "timed_codecs": list(d.timed_codecs),
            "held_by_margin": d.held_by_margin, "running_figure_s": ctx.running_figure_s,
            "drift_test": ctx.drift_test, "switch_check": ctx.switch_check,
            "sentence": sentence(d, st.network, dense)}


def _check_text(check: dict | None, source: str) -> str:
    if check is None:
        return ""
    ref = "modelled after a dense step measured the link" if check["reference"] == "modelled" else "at the last probe"
    verdict = ("unchanged, not re-probed" if check["unchanged"] else
               "changed, β from the check" if source == "check_slope" else "changed, re-probed")
    return f" (link check: {1e3 * check['check_s']:.1f} ms vs {1e3 * check['probe_s']:.1f} ms {ref}, {verdict})"


def log_text(step: int, trigger: Trigger, d: Decision, ctx: Context, st: AutoState, cfg: AutoConfig) -> str:
    """The decision's log line: the network, what it timed or held, and the pick (a table on a switch)."""
    assert st.network is not None
    notes = (f"methods not yet measured predicted {1e3 * -ctx.shift_s:.1f} ms under the raw model (the least "
             f"speed-up of {', '.join(ctx.shift_from)}); ") if ctx.shift_s else ""
    if d.timed_codecs:
        notes += f"timed the codecs of {', '.join(d.timed_codecs)} (their lower bound led); "
    if d.held_by_margin is not None:
        kept_mode = "the mode its trial interrupted comes back" if d.held_by_margin == d.previous else \
            "the running method stays"
        notes += f"{d.held_by_margin!r} leads by less than switch_margin ({100 * cfg.switch_margin:g}%), so {kept_mode}; "
    head = (f"lightning_gc auto ({trigger.value}, step {step}): network α={1e3 * st.network.alpha_s:.3f} ms, "
            f"{st.network.bandwidth_bits_per_s / 1e6:.1f} Mbit/s{_check_text(ctx.link_check, ctx.source)}; {notes}")
    best, preds = d.chosen, d.predictions
    if best == d.previous:
        nxt = (f"; next periodic look at the link in {st.link_interval} steps"
               if trigger == Trigger.PERIODIC and cfg.probe_every else "")
        return head + f"kept {best!r} (predicted {1e3 * preds[best].step_s:.1f} ms/step){nxt}"
    return (head + f"chose {best!r}" + (f" (was {d.previous!r})" if d.previous else "") + "\n"
            + table(preds, best))
