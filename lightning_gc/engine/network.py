"""Network tracking: the alpha-beta model in force, and when to measure it again.

Only engines whose exchange declares ``needs_network`` track the network. The model is pinned by
the user (``network_alpha_s`` / ``network_beta_s_per_byte``) or measured in-band by the probe
(:func:`lightning_gc.comm.probe.probe_network`) on the engine's exchange group. When to probe is
decided by :class:`~lightning_gc.comm.probe.ProbePolicy` from replicated values only — the step
counter and the previous step's exchange time averaged over ranks (it travels in the step's
closing report) — at the start of a compressed step, on the worker, before that step's first
exchange, so every rank probes at the same point of its collective sequence.
"""

from __future__ import annotations

import time

import torch

from ..comm.cost_model import NetworkModel
from ..comm.network import NetworkState
from ..comm.probe import ProbeConfig, ProbePolicy, probe_network
from .config import EngineConfig


class NetworkTracker:
    def __init__(self, config: EngineConfig, needs_network: bool, world_size: int) -> None:
        pinned = config.network_alpha_s is not None
        self.state = NetworkState(
            NetworkModel(config.network_alpha_s, config.network_beta_s_per_byte) if pinned else None, pinned
        )
        self.policy = (
            ProbePolicy(config.probe_every, config.probe_drift, config.probe_patience, probe_at_start=True)
            if needs_network and not pinned and world_size > 1 else None
        )
        self.probe_config = ProbeConfig(sizes_bytes=(64, 65536, 1048576, 4194304), warmup=2, repeats=7)
        # (measured exchange s, predicted s) of the last compressed step, both averaged over ranks
        self.last_measurement: tuple[float, float] | None = None

    def describe(self) -> str:
        m = self.state.model
        return "none" if m is None else f"{m.alpha_s!r},{m.beta_s_per_byte!r}"

    def maybe_probe(self, step: int, group, device: torch.device) -> float:
        """Probe if the policy says so (a collective: all ranks decide alike). Returns seconds spent."""
        if self.policy is None:
            return 0.0
        meas = self.last_measurement
        self.last_measurement = None
        if not self.policy.update(step, *(meas if meas is not None else (None, None))):
            return 0.0
        t0 = time.perf_counter()
        result = probe_network(group, self.probe_config, device=device)
        self.state.model = result.network
        self.state.probes += 1
        return time.perf_counter() - t0

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
