"""How one auto decision looks at the link, through the one link owner (:mod:`lightning_gc.comm.link`).

In order of cost, a decision's network comes from:

* ``pinned``: the user's α and β (never probed, never recalibrated);
* ``kept``: the stored network (a calibration, a trial, a gain re-decision);
* ``canary``: β from a link canary's message that saw a fall (α kept): it timed the link at the size a
  probe ends at, and a probe that starts small and grows is slow on a fallen link;
* ``dense_step``: β solved from a dense step that waited at least ``dense_probe_s`` on the network
  (:func:`~lightning_gc.auto.model.beta_from_dense_step`): its own bytes measured the link;
* ``check``: one message of the last probe's size (:func:`~lightning_gc.comm.link.check_link`) found the
  link unchanged (``probe_check``); ``check_slope``: it found the link moved and was bandwidth-bound,
  so its slope is β;
* ``probe``: the full probe sized to the link (:func:`~lightning_gc.comm.link.probe_sized`).

:func:`dense_measurement` and :func:`check_outcome` are pure; :func:`look` runs the collectives.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..comm import link
from ..comm.cost_model import NetworkModel
from ..comm.probe import ProbeResult
from ..engine.agreement import agree_values
from .config import AutoConfig
from .model import MethodCost, Workload, beta_from_dense_step, calibrate_beta, predict
from .state import AutoState

#: times a part of a decision (``decide_parts_s``): timed(part, fn, *args) -> fn(*args)
Timed = Callable[..., Any]


@dataclass(frozen=True)
class LookRequest:
    """What a decision asks of the link: ``probe`` a look at it at all (else the stored network),
    ``check_link`` try the cheap check first; the measurements it brings: the warm-up's profiled DDP
    step (``dense_wall_s``, ``dense_exposed_s``), a dense mode's drifted wall (``drift_wall_s``), a
    canary's message time on the fastest rank (``canary_s``)."""

    probe: bool
    check_link: bool = True
    dense_wall_s: float | None = None
    dense_exposed_s: float | None = None
    drift_wall_s: float | None = None
    canary_s: float | None = None


@dataclass(frozen=True)
class LinkIO:
    """The collectives a look may run, over one process group (every rank alike)."""

    group: Any
    device: Any
    world_size: int
    model_bytes: int  # the model's fp32 gradient: sizes the probe's first message

    def latency(self) -> ProbeResult:
        return link.probe_latency(self.group, self.device)

    def probe(self, latency: ProbeResult | None) -> link.SizedProbe:
        return link.probe_sized(self.group, self.device, self.model_bytes, latency)

    def check(self, size: int) -> tuple[float, float]:
        return link.check_link(self.group, self.device, size)

    def agree_max(self, values: Sequence[float]) -> list[float]:
        return agree_values(values, "max", self.group, self.device)


def dense_measurement(req: LookRequest, running: MethodCost | None, ddp: MethodCost, workload: Workload,
                      world_size: int) -> tuple[float, float, MethodCost] | None:
    """The dense step that may measure the link: (its wall, its wait on the network, its method). The
    warm-up's profiled DDP step, or a dense mode's drifted window (``running``: the dense mode's cost;
    its wait is its wall less the step the model gives it on a free network)."""
    if req.dense_wall_s is not None and req.dense_exposed_s is not None:
        return req.dense_wall_s, req.dense_exposed_s, ddp
    if req.drift_wall_s is not None and running is not None:
        free = predict(running, workload, NetworkModel(0.0, 0.0), world_size).step_s
        return req.drift_wall_s, req.drift_wall_s - free, running
    return None


def check_outcome(check_s: float, check_beta: float, st: AutoState, probe_check: float) -> tuple[str, dict]:
    """The source a link check gives (``check``, ``check_slope`` or ``probe``) and its history record;
    updates the check's reference in ``st``. A moved check whose message is bandwidth-bound (where a
    probe would stop growing it) was one round of the probe: β from its slope, α kept."""
    unchanged = link.link_unchanged(check_s, st.probe_time_s, probe_check)
    record = {"check_s": check_s, "probe_s": st.probe_time_s, "bytes": st.probe_bytes, "unchanged": unchanged,
              "reference": "modelled" if st.probe_time_modelled else "measured"}
    if unchanged:
        if st.probe_time_modelled:  # measured on the same link: the reference from now on
            st.probe_time_s, st.probe_time_modelled = check_s, False
        return "check", record
    if check_s >= link.PROBE_TARGET_S / 4 and check_beta > 0 and st.network is not None:
        st.network = NetworkModel(st.network.alpha_s, check_beta * st.beta_scale)
        st.probe_time_s, st.probe_time_modelled = check_s, False
        record["beta_s_per_byte"] = check_beta
        return "check_slope", record
    return "probe", record


def look(st: AutoState, req: LookRequest, io: LinkIO, cfg: AutoConfig, workload: Workload, costs: Sequence[MethodCost],
         running: MethodCost | None, pinned: NetworkModel | None, fall_bytes: int | None,
         timed: Timed) -> tuple[str, dict | None]:
    """Set ``st.network`` for a decision (see the module docstring); returns (its source, the link
    check's record or None). ``running``: the running method's cost if a dense mode runs;
    ``fall_bytes``: the canary's message size when one can have seen a fall."""
    if pinned is not None:  # network_alpha_s/beta given: no probe, and the user's figures are not recalibrated
        st.network = pinned
        return "pinned", None
    ddp = next(c for c in costs if c.name == "ddp")
    dense = dense_measurement(req, running, ddp, workload, io.world_size)
    beta = latency = None
    if req.canary_s is not None and st.network is not None and fall_bytes is not None:
        # never faster than the model that gave the message far less time
        alpha0, latency_bytes = st.network.alpha_s, 0
        beta = max((req.canary_s - alpha0) / ((io.world_size - 1) * fall_bytes), st.network.beta_s_per_byte)
    elif req.probe and dense is not None and cfg.dense_probe_s and dense[1] >= cfg.dense_probe_s:
        if req.dense_wall_s is None and st.network is not None:
            # a dense mode's drifted window: α from the last look (a latency round right after a fall waits
            # behind queued bytes, and β solved from a long wait barely depends on α)
            alpha0, latency_bytes = st.network.alpha_s, 0
        else:
            latency = timed("latency", io.latency)
            alpha0 = io.agree_max([latency.min_times_s[0]])[0]  # agreed: every rank solves the same equation
            latency_bytes = latency.sizes_bytes[0]
        # what the model charges to other_s already is not the link's
        beta = beta_from_dense_step(dense[0] - workload.other_s, workload, dense[2], alpha0, io.world_size,
                                    latency_bytes=latency_bytes)
    if beta is not None:
        st.network, st.beta_scale = NetworkModel(max(alpha0 - beta * latency_bytes, 0.0), beta), 1.0
        # the link check's reference: the model's time for the message a probe would have settled on (a timed
        # one would be the slowest part of a decision on a link that just fell); the first check replaces it
        st.probe_bytes = link.check_bytes(st.network, link.probe_start_bytes(io.model_bytes))
        st.probe_time_s, st.probe_time_modelled = link.modelled_check_s(st.network, st.probe_bytes), True
        return ("canary" if req.canary_s is not None else "dense_step"), None
    if not req.probe and st.network is not None:
        return "kept", None
    source, record = "probe", None
    if (req.check_link and req.probe and req.dense_wall_s is None and st.network is not None and cfg.probe_check
            and st.probe_bytes > 0 and st.probe_time_s > 0):
        check_s, check_beta = timed("check", io.check, st.probe_bytes)
        retimed = not link.link_unchanged(check_s, st.probe_time_s, cfg.probe_check)
        if retimed:  # timed once more and the faster kept: a host's scheduling only adds time
            check_s, check_beta = min((check_s, check_beta), timed("check", io.check, st.probe_bytes))
        source, record = check_outcome(check_s, check_beta, st, cfg.probe_check)
        record["retimed"] = retimed
    if source == "probe":
        probed = timed("probe", io.probe, latency)
        st.probe_bytes, st.probe_time_s, st.probe_time_modelled = probed.probe_bytes, probed.probe_time_s, False
        net = probed.network
        if req.dense_wall_s is not None:  # the profiled DDP step bounds the link's β from above
            beta = calibrate_beta(req.dense_wall_s, workload, ddp, net, io.world_size)
            st.beta_scale = beta / net.beta_s_per_byte if net.beta_s_per_byte > 0 else 1.0
        st.network = NetworkModel(net.alpha_s, net.beta_s_per_byte * st.beta_scale)
    return source, record
