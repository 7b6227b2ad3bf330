"""Small argument checks shared by the strategy, the engine config, compressor configs and callbacks.

Why strict booleans: ``bool("no")`` and ``bool("false")`` are ``True``, so a string that reaches a
boolean option (a hand-written dict, an environment variable, a YAML value quoted by mistake) would
silently turn the option *on*. LightningCLI / jsonargparse already converts YAML ``true``/``false``
to real booleans before they get here, so only genuine mistakes are refused.
"""

from __future__ import annotations

import math


def check_bool(name: str, value: object, hint: str = "", allow_none: bool = False) -> None:
    """Refuse anything but ``True`` / ``False`` (and ``None`` where ``allow_none``).

    The message gives the value, the reason and the fix; ``hint`` adds what the option does.
    """
    if isinstance(value, bool) or (allow_none and value is None):
        return
    allowed = "True, False or None" if allow_none else "True or False"
    reason = (
        f" A string is not read as a boolean here (bool({value!r}) would be True)."
        if isinstance(value, str) else ""
    )
    raise ValueError(
        f"{name}={value!r} is invalid: it must be {allowed} (got {type(value).__name__}).{reason} "
        f"Pass {name}=True or {name}=False (in YAML: {name}: true / false).{(' ' + hint) if hint else ''}"
    )


def check_int(name: str, value: object, minimum: int, fix: str = "", *, error: type[Exception] = ValueError,
              phrasing: str = "invalid") -> int:
    """Refuse anything but an integer ``>= minimum`` (a bool is refused: ``True`` is not a count).

    The message gives the value, the reason (``must be an integer >= minimum``) and ``fix``.
    ``phrasing``: ``"invalid"`` (``name=value is invalid: it must be an integer ≥ minimum.``, the
    configs' wording) or ``"must"`` (``name=value must be an integer >= minimum.``, the wording of
    auto's and the bench's options); both are matched by scripts and tests, so each keeps its own.
    ``error``: the exception class raised (the bench raises its own). Returns ``value``.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        if phrasing == "must":
            reason = f"{name}={value!r} must be an integer >= {minimum}"
        else:
            reason = f"{name}={value!r} is invalid: it must be an integer ≥ {minimum}"
        raise error(f"{reason}. {fix}" if fix else f"{reason}.")
    return value


def check_number(name: str, value: object, requirement: str, *, at_least: float | None = None,
                 above: float | None = None, below: float | None = None, or_zero: bool = False,
                 finite: bool = True) -> float:
    """Refuse anything but a real number (not a bool, not NaN; finite unless ``finite=False``) within
    the bounds: ``>= at_least``, ``> above``, ``< below``; ``or_zero`` also accepts exactly 0 (an
    option that 0 turns off). The message is ``name=value must be <requirement>``, so ``requirement``
    gives the reason and the fix (e.g. ``"a finite number >= 0 (0: off; e.g. 0.1)."``). Returns the
    value as a float.
    """
    ok = not isinstance(value, bool) and isinstance(value, (int, float))
    if ok:
        v = float(value)  # type: ignore[arg-type]
        ok = not math.isnan(v) and (not finite or math.isfinite(v))
        if ok and not (or_zero and v == 0):
            ok = ((at_least is None or v >= at_least) and (above is None or v > above)
                  and (below is None or v < below))
    if not ok:
        raise ValueError(f"{name}={value!r} must be {requirement}")
    return float(value)  # type: ignore[arg-type]
