"""What the engine's collaborators may read and change: typed interfaces (Protocols).

The step session's participants (OSP, OMGS, later synchronisation models) and the adaptive ratio
controller depend on these Protocols, never on :class:`~lightning_gc.engine.GCEngine` itself nor
on its private members, so that the coupling is visible to readers and type checkers, and an
engine double in a unit test needs only what a participant really uses.

* :class:`EngineView` — replicated facts and per-step results (read only);
* :class:`EngineControl` — the view plus the changes a collaborator may make between steps
  (ratio, warm-up length, group observer, extra traffic to count);
* :class:`PlanControl` — replacing the merge plan. The step session hands it to exactly one
  participant, the plan owner (:class:`~lightning_gc.engine.session.StepSession`);
* :class:`MethodControl` — the control plus what a method chooser (``compressor="auto"``) changes:
  the method of each group or a dense bucket mode and the network model it measured, with two generic
  step riders: a value carried in the next step's messages, and a job run before the next step that
  may stop a dense step (auto's link canary is one).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import Tensor

if TYPE_CHECKING:
    from ..comm.cost_model import NetworkModel
    from ..comm.exchange import Exchange
    from ..comm.link import LinkObserver
    from ..comm.network import NetworkState
    from ..compressors.base import Compressor, GroupContext
    from ..plans import Plan
    from .config import EngineConfig
    from .dense_stop import StopVerdict
    from .slots import MethodSpec
    from .stats import StepStats

GroupObserver = Callable[[int, Tensor, "GroupContext"], None]


@runtime_checkable
class EngineView(Protocol):
    """Read-only facts of the engine: identical on every rank unless noted."""

    names: list[str]
    params: list[Tensor]
    world_size: int
    rank: int  # this rank (differs per rank)
    device: torch.device
    process_group: Any
    exchange_group: Any
    config: EngineConfig
    compressor: Compressor
    exchange: Exchange
    exact_exchange: Exchange
    error_feedback: bool
    step: int
    plan: Plan
    gain_ewma: float | None

    @property
    def network(self) -> NetworkState: ...

    @property
    def keeps_network_model(self) -> bool: ...

    @property
    def last_step(self) -> StepStats | None: ...

    def step_is_dense(self) -> bool: ...

    def error_memory_by_name(self) -> dict[str, Tensor]: ...

    def synchronize(self) -> None: ...


@runtime_checkable
class EngineControl(EngineView, Protocol):
    """What a collaborator may change on the engine, between steps and identically on every rank."""

    def set_ratio(self, ratio: float) -> None: ...

    def raise_warmup_steps(self, steps: int) -> None: ...

    def shorten_warmup_steps(self, steps: int) -> None: ...

    def set_group_observer(self, observer: GroupObserver | None) -> None: ...

    def add_deferred_traffic(self, bytes_sent: int, bytes_payload: int, bytes_inter_node: int = 0) -> None: ...

    def report_nonfinite(self) -> None: ...


class PlanControl(Protocol):
    """Replacing the engine's merge plan (only the session's plan owner holds one)."""

    def replace_plan(self, plan: Plan, verify: bool = True) -> list[str]: ...



@runtime_checkable
class MethodControl(EngineControl, Protocol):
    """What a method chooser (``compressor="auto"``) uses beyond :class:`EngineControl`: every member is
    called between steps, with the same values on every rank (the chooser decides from agreed figures).
    Its periodic look at the link runs on the link observer's one schedule (``link``, as in
    :class:`LinkPort`)."""

    @property
    def link(self) -> LinkObserver: ...

    params: list[Tensor]

    @property
    def plan_sends_every_param(self) -> bool: ...

    def set_dense_mode(self, mode: str | None) -> None: ...

    def set_group_method(self, gid: int, spec: MethodSpec | None) -> None: ...

    def adopt_network(self, model: NetworkModel) -> None: ...

    def carry_wall(self, wall_s: float) -> None: ...

    def enable_dense_carry(self) -> None: ...

    def run_before_step(self, job: Callable[[], StopVerdict]) -> None: ...

    def count_local_step(self) -> None: ...


# ---------------------------------------------------------------- switching synchronisation families
class FamilySwitch(Protocol):
    """What a synchronisation model that a chooser enters and leaves (DiLoCo under ``compressor="auto"``)
    is given by the assembly: its configurations by name, and DDP's gradient synchronisation."""

    def resolve(self, choice: str) -> tuple[Any, Any, str, bool]:
        """``choice`` → (its config, its Δ compressor or None, the collective, error feedback)."""
        ...

    def set_gradient_sync(self, on: bool) -> None:
        """Turn DDP's per-step gradient synchronisation on or off (``require_backward_grad_sync``)."""
        ...


@runtime_checkable
class SyncFamilyControl(Protocol):
    """The two verbs a chooser switches families with, and what it reads back (DiLoCoSync)."""

    active: bool
    choice: str | None
    last_stats: Any  # the last outer step's DiLoCoStats (None before one)

    def enter(self, choice: str, first_round: int | None = None) -> None: ...

    def leave(self) -> int: ...


# ---------------------------------------------------------------- the link observer
@runtime_checkable
class LinkPort(Protocol):
    """The engine's link observer (:class:`~lightning_gc.comm.link.LinkObserver`), the one owner of
    "what is the link now". Collaborators read ``link.model`` and, where they need a fresh look, call
    ``link.refresh`` / ``link.maybe_refresh`` between steps on every rank alike; a collaborator with
    an interval of its own subscribes it (``link.subscribe``), so one probe serves every client."""

    @property
    def link(self) -> LinkObserver: ...
