"""The front door that owns an engine session, as the callbacks built for it see it.

Callbacks such as :class:`~lightning_gc.adaptive.AdaptiveRatio` need "the Trainer's strategy is a
lightning_gc strategy, and here is its session". They check ``isinstance(strategy, SessionOwner)``
against this class, which sits below them, instead of importing the strategy that sits above them
(and imports them). :class:`~lightning_gc.strategy.GCStrategy` is one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any


class SessionOwner(ABC):
    """A strategy that assembles and drives the engine's step session."""

    @property
    @abstractmethod
    def session(self) -> Any:
        """The :class:`~lightning_gc.engine.session.StepSession` (None before setup)."""

    @property
    @abstractmethod
    def engine(self) -> Any:
        """The :class:`~lightning_gc.engine.GCEngine` (None before setup, or when no engine runs)."""

    @property
    @abstractmethod
    def compressor_name(self) -> str:
        """The compressor the user asked for (``"auto"`` included)."""

    @property
    @abstractmethod
    def config(self) -> Any:
        """The :class:`~lightning_gc.config.GCConfig` the strategy was built from."""
