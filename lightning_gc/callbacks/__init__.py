"""Callbacks: monitoring and the end-of-fit summary."""

from .monitor import GCMonitor

__all__ = ["GCMonitor"]
