"""The order in which ``StepSession.load_state_dict`` restores a checkpoint, engine included.

Participants first (replicated ones, then shared parts, then rank-scoped ones), the engine last:
a plan owner (OMGS, OSP) restores the plan that the engine's error memory is keyed by, so an engine
loaded before it would map its memory onto the wrong groups. Oracle: one call log shared by
recording participants and a spy around the engine's own ``load_state_dict``; the order expected is
written out by hand.
"""

from __future__ import annotations

import pytest
import torch

from lightning_gc.compressors import build_compressor
from lightning_gc.engine import EngineConfig, GCEngine
from lightning_gc.engine.session import StepParticipant, StepSession


class _SpyEngine(GCEngine):
    """A real engine whose own load is written into the shared log (with what it was asked)."""

    log: list

    def load_state_dict(self, state, restore_memory=True, check_next=True):
        self.log.append(("engine", "load", restore_memory))
        return super().load_state_dict(state, restore_memory=restore_memory, check_next=check_next)


class _Loader(StepParticipant):
    def __init__(self, name: str, log: list, scope: str, shared: bool = False) -> None:
        self.name = name  # type: ignore[misc]
        self.state_scope = scope  # type: ignore[misc]
        self.log, self.shared = log, shared

    def state_dict(self):
        return {"who": self.name}

    def load_state_dict(self, state):
        self.log.append((self.name, "load", state["who"]))

    def shared_state_dict(self):
        return {"who": f"{self.name}/shared"} if self.shared else None

    def load_shared_state_dict(self, state):
        self.log.append((self.name, "load_shared", state["who"]))


def _session(log: list) -> tuple[StepSession, GCEngine]:
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    engine = _SpyEngine(build_compressor("topk", ratio=0.1), EngineConfig(), list(model.named_parameters()))
    engine.log = log
    parts = [_Loader("perrank", log, "rank", shared=True), _Loader("replicated", log, "replicated")]
    return StepSession(engine, parts), engine


def test_participants_load_before_the_engine():
    log: list = []
    session, engine = _session(log)
    engine.step = 5
    state = session.state_dict()
    log.clear()
    engine.step = 0
    session.load_state_dict(state)
    assert engine.step == 5
    assert log == [
        ("perrank", "load_shared", "perrank/shared"),
        ("replicated", "load", "replicated"),
        ("perrank", "load", "perrank"),
        ("engine", "load", True),
    ]


def test_on_a_world_size_change_the_engine_still_loads_last_without_memory():
    log: list = []
    session, engine = _session(log)
    state = session.state_dict()
    state = dict(state, world_size=2, ranks=[state["ranks"][0], state["ranks"][0]])
    log.clear()
    with pytest.warns(UserWarning, match="world size 2, this run has 1"):
        session.load_state_dict(state)
    # the rank-scoped part cannot be mapped to a rank: not loaded; the engine keeps its replicated parts
    assert log == [
        ("perrank", "load_shared", "perrank/shared"),
        ("replicated", "load", "replicated"),
        ("engine", "load", False),
    ]
