"""Callbacks: monitoring (and, later, controllers)."""

from .monitor import GCMonitor

__all__ = ["GCMonitor"]
