"""Former name of :class:`~lightning_gc.callbacks.session_hooks.SessionHooks` for OSP (kept for imports)."""

from .session_hooks import SessionHooks as OSPDrain

__all__ = ["OSPDrain"]
