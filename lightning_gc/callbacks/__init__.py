"""Callbacks: monitoring, the end-of-fit summary, and the gradient-fidelity diagnostic."""

from .fidelity import GradientFidelity
from .monitor import GCMonitor

__all__ = ["GCMonitor", "GradientFidelity"]
