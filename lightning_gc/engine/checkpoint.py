"""What of the engine goes into a checkpoint, per rank, and how it comes back.

Per-rank state (error memory keyed by parameter name, the step counter, statistics, the network
tracker, exchange state such as smoothed VAR energies) is gathered from every rank by the strategy
into ``checkpoint["lightning_gc"]``. On resume each rank takes its own entry; on a world-size
change the strategy keeps the replicated parts and resets memory (see strategy.py).
"""

from __future__ import annotations

from typing import Any, Protocol

from torch import Tensor

from .stats import Totals

STATE_VERSION = 2


class CheckpointedEngine(Protocol):
    """The members of the engine (:class:`~lightning_gc.engine.hook.GCEngine`) that its checkpoint
    state reads and writes. Declared here, so this module does not import the engine that imports it."""

    world_size: int
    rank: int
    step: int
    gain_ewma: float | None
    plan: Any
    compressor: Any
    config: Any
    tracker: Any
    exchange: Any
    dense_mode: Any
    dense_flush_pending: bool

    def error_memory_by_name(self) -> dict[str, Tensor]: ...

    def totals(self) -> dict: ...

    def set_totals(self, totals: Totals) -> None: ...

    def slot_specs(self) -> list: ...

    def load_slot_specs(self, specs: list) -> None: ...

    def restore_dense_mode(self, mode: Any, flush: bool) -> None: ...

    def clear_error_memory(self) -> None: ...

    def load_error_memory(self, memory: dict) -> list[str]: ...


def engine_state(engine: CheckpointedEngine) -> dict:
    return {
        "version": STATE_VERSION,
        "world_size": engine.world_size,
        "rank": engine.rank,
        "step": engine.step,
        "memory": engine.error_memory_by_name(),
        "gain_ewma": engine.gain_ewma,
        "totals": engine.totals(),
        "plan": engine.plan.signature(),
        "ratio": float(engine.compressor.ratio),
        "seed": engine.config.seed,
        "network": engine.tracker.state_dict(),
        "exchange": engine.exchange.state_dict(),
        "slots": engine.slot_specs(),
        "dense_mode": engine.dense_mode,
        "dense_flush": engine.dense_flush_pending,
    }


def load_engine_state(engine: CheckpointedEngine, state: dict, restore_memory: bool = True) -> list[str]:
    """Restore ``engine`` from :func:`engine_state`. Returns names whose memory was missing."""
    version = state.get("version")
    if version == 1:  # lightning_gc 0.1: same memory layout, network state in flat keys
        state = dict(state, version=STATE_VERSION, exchange={},
                     network={"network": state.get("network"), "probe_policy": state.get("probe_policy"),
                              "last_measurement": state.get("meas_carry")})
        version = STATE_VERSION
    if version != STATE_VERSION:
        raise ValueError(
            f"unsupported lightning_gc state version {version!r} (this version reads {STATE_VERSION}); "
            "resume with the lightning_gc version that wrote the checkpoint, or start without it."
        )
    engine.step = int(state["step"])
    engine.gain_ewma = state.get("gain_ewma")
    engine.set_totals(Totals(**state.get("totals", {})))
    ratio = state.get("ratio")
    if ratio is not None and engine.compressor.has_ratio:
        engine.compressor.set_ratio(ratio)  # replicated: every rank's saved state holds the same ratio
    engine.tracker.load_state_dict(state.get("network") or {})
    engine.exchange.load_state_dict(state.get("exchange") or {}, world_size=engine.world_size)
    engine.load_slot_specs(state.get("slots") or [])
    engine.restore_dense_mode(state.get("dense_mode"), bool(state.get("dense_flush", False)))
    if not restore_memory:
        engine.clear_error_memory()
        return []
    return engine.load_error_memory(state.get("memory", {}))
