"""Names a user types — strategy aliases, compressor names — and the refusal for a wrong one.

Lightning checks ``Trainer(strategy="...")`` (and ``Fabric(strategy="...")``) inside the Trainer's
accelerator connector: ``strategy not in StrategyRegistry.available_strategies()``, and raises a
generic "invalid strategy name" error that knows nothing of lightning_gc. Lightning offers no hook
for that message, so :func:`guard_registry` gives the registry instance lightning_gc fills (and
only that instance, not Lightning's classes) an ``available_strategies`` whose list refuses an
unregistered name *in lightning_gc's own namespace* (``gc_`` prefix) with the closest alias and a
pointer to ``lightning-gc list``. Every other name, and every ``in`` test that finds its name,
behaves exactly as before. Should Lightning stop consulting ``available_strategies()``, its own
message comes back (tests/test_strategy_usability.py checks the improved one).
"""

from __future__ import annotations

import difflib
from typing import Any

GC_PREFIX = "gc_"


def closest(name: str, choices: list[str] | tuple[str, ...], cutoff: float = 0.6) -> str | None:
    """The closest of ``choices`` to ``name`` (case-insensitive), or None if none is close."""
    found = difflib.get_close_matches(str(name).lower(), list(choices), n=1, cutoff=cutoff)
    return found[0] if found else None


def unknown_strategy_message(name: str, registered: list[str]) -> str:
    gc = sorted(n for n in registered if n.startswith(GC_PREFIX))
    near = closest(name, gc)
    hint = f" Did you mean strategy={near!r}?" if near else ""
    return (
        f"strategy={name!r} is not a registered strategy: the gc_ names are lightning_gc's aliases "
        f"(gc_<compressor>, gc_<compressor>_osp, gc_<compressor>_find_unused_parameters_true, gc_omgs, gc_osp; "
        f"{len(gc)} in all) and this one is not among them.{hint} `lightning-gc list` prints every alias with "
        "the GCStrategy arguments it stands for; docs/choosing.md says which to pick."
    )


def positional_string_message(value: str, accelerators: list[str], compressors: list[str]) -> str:
    """Refusal for ``GCStrategy("qsgd")``: a string in the ``accelerator`` slot that names no accelerator."""
    if value in compressors:
        fix = f"GCStrategy(compressor={value!r})"
        what = f"{value!r} is a compressor, not an accelerator"
    else:
        near = closest(value, compressors)
        fix = f"GCStrategy(compressor={near!r})" if near else "GCStrategy(compressor='topk')"
        what = (f"{value!r} is neither an accelerator ({', '.join(sorted(accelerators))}) nor a compressor"
                + (f" (closest compressor: {near!r})" if near else ""))
    return (
        f"GCStrategy({value!r}): the first positional argument of GCStrategy is DDPStrategy's `accelerator` "
        f"(GCStrategy keeps DDPStrategy's positional order), and {what}. lightning_gc's own arguments are "
        f"keyword-only: use {fix}, and choose the accelerator with Trainer(accelerator=...)."
    )


class _CheckedNames(list):
    """The registry's names; ``"gc_typo" in names`` raises the lightning_gc refusal instead of False."""

    def __contains__(self, item: object) -> bool:
        found = list.__contains__(self, item)
        if not found and isinstance(item, str) and item.lower().startswith(GC_PREFIX):
            raise ValueError(unknown_strategy_message(item, list(self)))
        return found


def guard_registry(registry: Any) -> None:
    """Make ``registry.available_strategies()`` (this registry instance only) return a
    :class:`_CheckedNames`. Idempotent."""
    if registry.__dict__.get("_lightning_gc_guarded"):
        return
    unbound = type(registry).available_strategies

    def available_strategies() -> list:
        return _CheckedNames(unbound(registry))

    registry.available_strategies = available_strategies
    registry._lightning_gc_guarded = True
