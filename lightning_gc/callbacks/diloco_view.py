"""Former name of :class:`~lightning_gc.callbacks.session_hooks.SessionHooks` for DiLoCo (kept for imports)."""

from .session_hooks import SessionHooks as DiLoCoView

__all__ = ["DiLoCoView"]
