"""auto's replicated state: what a checkpoint carries, and the keys it is saved under.

Every field is identical on every rank (it comes from agreed figures), so a resumed run decides as the
one that saved it. :meth:`AutoState.state_dict` writes the keys auto has always written (version 2);
:meth:`AutoState.load` reads them, with the defaults older checkpoints need.

The periodic look's clock is not auto's own: it is the engine's link schedule
(:class:`~lightning_gc.comm.link.LinkSchedule`, client ``"auto"``), where one probe by any client
restarts every client's clock. Auto saves that clock under its own keys (``last_link_step``,
``link_interval``), since the engine saves it only while it probes on its own schedule.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from ..comm.cost_model import NetworkModel
from ..comm.link import LinkSchedule
from .model import MethodCost, Prediction, Workload

VERSION = 2
#: auto's name among the link schedule's clients
LINK_CLIENT = "auto"


def state_attr(name: str, doc: str | None = None) -> Any:
    """A property that reads and writes ``self.state.<name>`` (the participant's public view of its state)."""
    return property(lambda self: getattr(self.state, name), lambda self, v: setattr(self.state, name, v), doc=doc)


@dataclass
class AutoState:
    """The chooser's replicated bookkeeping (see the module docstring)."""

    probe_every: int
    gain_every: int
    explore: int
    chosen: str | None = None
    #: every decision: step, trigger, inputs, predictions, choice
    history: list[dict] = field(default_factory=list)
    workload: Workload | None = None
    costs: list[MethodCost] | None = None
    network: NetworkModel | None = None
    predictions: dict[str, Prediction] = field(default_factory=dict)
    #: the running method's drift reference (the median of its reference window), None before it
    reference: float | None = None
    drifted: int = 0  # windows in a row that drifted (patience)
    settling: bool = True  # the first window after a decision holds the switch itself
    reference_exchange: float | None = None  # the reference window's fastest exchange (compressed methods)
    run_medians: list[float] = field(default_factory=list)  # the running method's window medians since its reference
    #: measured step minus raw prediction per method, and the network's β when it was measured
    corrections: dict[str, float] = field(default_factory=dict)
    correction_beta: dict[str, float] = field(default_factory=dict)
    explore_left: int = 0
    last_decision_step: int | None = None
    #: the link's one schedule (the engine's); auto's periodic look is its client LINK_CLIENT
    schedule: LinkSchedule = field(default_factory=LinkSchedule, repr=False)
    gain_interval: int = 0  # the errors' re-measurement interval now (gain_every_max)
    last_gain_step: int | None = None
    gain_checks: list[dict] = field(default_factory=list)  # every re-measurement of the errors
    #: every probe's β is multiplied by this: the warm-up's DDP step over the model's, when shorter
    beta_scale: float = 1.0
    probe_bytes: int = 0  # the last bandwidth probe's large message (0: none, or a pinned network)
    probe_time_s: float = 0.0  # that message's agreed time: the link check's reference
    probe_time_modelled: bool = False  # whether probe_time_s is the model's, not a measured one
    #: the synchronisation family (auto_diloco, auto/sync_switch.py): the trial in progress, the last one,
    #: the DiLoCo configuration running (None: per-step), its first outer exchange's time per fragment
    #: (``{"0": s, ...}``), every event
    sync: dict = field(default_factory=lambda: {"trial": None, "last_trial": None, "running": None,
                                                "reference_exchange_s": None, "events": []})

    def __post_init__(self) -> None:
        self.explore_left = self.explore
        self.schedule.subscribe(LINK_CLIENT, self.probe_every, at_start=False)
        self.gain_interval = self.gain_every

    @property
    def last_link_step(self) -> int | None:
        """The last look at the link: auto's (a decision that looked) or any other client's probe."""
        return self.schedule.last_probe_step

    @property
    def link_interval(self) -> int:
        """The periodic look's interval now (doubled up to ``probe_every_max`` while the link holds)."""
        return self.schedule.clients[LINK_CLIENT][0]

    def looked_at_link(self, step: int, interval: int) -> None:
        """A decision looked at the link at ``step``: the schedule's clock restarts, and the next periodic
        look comes ``interval`` steps later (0: none)."""
        self.schedule.probed(step)
        self.schedule.subscribe(LINK_CLIENT, interval, at_start=False)

    def periodic_due(self, step: int) -> bool:
        """Whether the periodic look at the link is due at ``step`` (on the shared clock)."""
        return bool(self.probe_every) and self.schedule.due(step)

    def forget_references(self) -> None:
        """A decision that did not keep the running method's references (policy.keeps_reference)."""
        self.reference, self.drifted, self.settling = None, 0, True
        self.run_medians, self.reference_exchange = [], None

    def state_dict(self, sampling: bool, warmup_steps: int) -> dict:
        n = self.network
        return {
            # copies: the state of this moment, not lists that later decisions append to
            "version": VERSION, "chosen": self.chosen, "history": copy.deepcopy(self.history),
            "workload": self.workload.as_dict() if self.workload is not None else None,
            "costs": [c.as_dict() for c in self.costs] if self.costs is not None else None,
            "network": [n.alpha_s, n.beta_s_per_byte] if n is not None else None,
            "reference": self.reference, "drifted": self.drifted, "settling": self.settling,
            "reference_exchange": self.reference_exchange, "run_medians": list(self.run_medians),
            "corrections": dict(self.corrections), "explore_left": self.explore_left,
            "correction_beta": dict(self.correction_beta),
            "last_decision_step": self.last_decision_step, "last_link_step": self.last_link_step,
            "link_interval": self.link_interval, "gain_interval": self.gain_interval,
            "last_gain_step": self.last_gain_step, "gain_checks": copy.deepcopy(self.gain_checks),
            "beta_scale": self.beta_scale, "sampling": sampling, "warmup_steps": warmup_steps,
            "probe_bytes": self.probe_bytes, "probe_time_s": self.probe_time_s,
            "probe_time_modelled": self.probe_time_modelled, "sync": copy.deepcopy(self.sync),
        }

    def load(self, state: dict) -> None:
        """Read :meth:`state_dict`'s keys; a key an older checkpoint lacks takes the value it stood for."""
        if state.get("version") != VERSION:
            raise ValueError(f"unsupported auto chooser state version {state.get('version')!r}: this version reads 2 "
                             "(version 1, per-family corrections, was written before the per-method ones); resume "
                             "with the lightning_gc that wrote the checkpoint, or start the run anew.")
        self.chosen, self.history = state["chosen"], list(state["history"])
        wl = state.get("workload")
        self.workload = None if wl is None else Workload(wl["forward_s"], tuple(wl["backward_s"]), tuple(wl["numels"]),
                                                         wl["optimizer_s"], wl["other_s"])
        costs = state.get("costs")
        self.costs = None if costs is None else [MethodCost(**c) for c in costs]
        net = state.get("network")
        self.network = None if net is None else NetworkModel(*net)
        self.reference, self.drifted = state.get("reference"), int(state.get("drifted", 0))
        self.settling = bool(state.get("settling", True))
        self.reference_exchange = state.get("reference_exchange")
        self.run_medians = [float(v) for v in state.get("run_medians", [])]
        self.corrections = {str(k): float(v) for k, v in state.get("corrections", {}).items()}
        # before corrections were tagged with their network: every correction counts as current
        self.correction_beta = {str(k): float(v) for k, v in state.get("correction_beta", {}).items()}
        self.explore_left = int(state.get("explore_left", self.explore))
        self.last_decision_step = state.get("last_decision_step")
        # older checkpoints: the last decision stands for the last look at the link and the last measurement
        last_link = state.get("last_link_step", self.last_decision_step)
        self.schedule.load_state_dict({"last_probe_step": last_link, "consecutive_drift": 0})
        self.schedule.subscribe(LINK_CLIENT, int(state.get("link_interval", self.probe_every)), at_start=False)
        self.gain_interval = int(state.get("gain_interval", self.gain_every))
        self.last_gain_step = state.get("last_gain_step", self.last_decision_step)
        self.gain_checks = list(state.get("gain_checks", []))
        self.beta_scale = float(state.get("beta_scale", 1.0))
        # before the link check: no reference, so the next re-decision probes in full
        self.probe_bytes, self.probe_time_s = int(state.get("probe_bytes", 0)), float(state.get("probe_time_s", 0.0))
        self.probe_time_modelled = bool(state.get("probe_time_modelled", False))
        if state.get("sync") is not None:  # older checkpoints: per-step only
            self.sync = copy.deepcopy(state["sync"])
        if self.chosen is not None and self.history:
            self.predictions = {k: Prediction(**v) for k, v in self.history[-1]["predictions"].items()}
