"""Network tracking: the engine's side of the :class:`~lightning_gc.comm.link.LinkObserver`.

The engine owns one observer (``GCEngine.link``): the model in force, pinned by the user
(``network_alpha_s`` / ``network_beta_s_per_byte``) or measured in-band by the probe on the engine's
exchange group. Collaborators (``AdaptiveRatio``, OSP) read and refresh the same observer through the
engine's :class:`~lightning_gc.engine.ports.LinkPort`.

Only engines whose exchange declares ``needs_network`` subscribe to the observer's schedule (client
``"engine"``: ``probe_every``, ``probe_drift``, ``probe_patience`` of :class:`EngineConfig`, a
probe before the first compressed step) and publish what it measures to their exchanges. The
schedule decides from replicated values only — the step counter and the previous step's exchange
time averaged over ranks (it travels in the step's closing report) — at the start of a compressed
step, on the worker, before that step's first exchange, so every rank probes at the same point of
its collective sequence.
"""

from __future__ import annotations

import torch

from ..comm.cost_model import NetworkModel
from ..comm.link import LinkObserver, LinkSchedule
from ..comm.network import NetworkState
from ..comm.probe import ProbeConfig
from .config import EngineConfig

#: the engine's own probe: up to 4 MiB messages, so that a fast link's bandwidth is seen
ENGINE_PROBE = ProbeConfig(sizes_bytes=(64, 65536, 1048576, 4194304), warmup=2, repeats=7)
#: the engine's name among the observer's clients
ENGINE = "engine"


class NetworkTracker:
    def __init__(self, config: EngineConfig, needs_network: bool, world_size: int) -> None:
        pinned = config.network_alpha_s is not None
        model = NetworkModel(config.network_alpha_s, config.network_beta_s_per_byte) if pinned else None
        self.observer = LinkObserver(model, pinned, ENGINE_PROBE, config.probe_drift, config.probe_patience,
                                     world_size, publish=needs_network)
        if needs_network and not pinned and world_size > 1:
            self.observer.subscribe(ENGINE, config.probe_every, at_start=True)
        # (measured exchange s, predicted s) of the last compressed step, both averaged over ranks
        self.last_measurement: tuple[float, float] | None = None

    @property
    def state(self) -> NetworkState:
        return self.observer.state

    @property
    def probe_config(self) -> ProbeConfig:
        return self.observer.probe_config

    @property
    def policy(self) -> LinkSchedule | None:
        """The schedule the engine probes on, or None when the engine does not (pinned, one rank, an
        exchange that needs no model, or a caller that took re-probing over: ``adopt_network``)."""
        return self.observer.schedule if ENGINE in self.observer.schedule.clients else None

    @policy.setter
    def policy(self, value: None) -> None:
        if value is not None:
            raise ValueError("NetworkTracker.policy can only be set to None (stop the engine's own probing).")
        self.observer.unsubscribe(ENGINE)

    def describe(self) -> str:
        m = self.state.model
        return "none" if m is None else f"{m.alpha_s!r},{m.beta_s_per_byte!r}"

    def maybe_probe(self, step: int, group, device: torch.device) -> float:
        """Probe if the schedule says so (a collective: all ranks decide alike). Returns seconds spent."""
        if self.policy is None:
            return 0.0
        meas = self.last_measurement
        self.last_measurement = None
        if meas is not None:
            self.observer.observe(*meas)
        return self.observer.maybe_refresh(step, group, device)

    def state_dict(self) -> dict:
        m = self.state.model
        return {
            "network": None if m is None or self.state.pinned else (m.alpha_s, m.beta_s_per_byte),
            "probe_policy": self.policy.state_dict() if self.policy is not None else None,
            "last_measurement": self.last_measurement,
            "probes": self.state.probes,
        }

    def load_state_dict(self, state: dict) -> None:
        net = state.get("network")
        if net is not None and not self.state.pinned:
            self.state.model = NetworkModel(*net)
        if self.policy is not None and state.get("probe_policy") is not None:
            self.policy.load_state_dict(state["probe_policy"])
        meas = state.get("last_measurement")
        self.last_measurement = tuple(meas) if meas is not None else None  # type: ignore[assignment]
