"""Small argument checks shared by the strategy, the engine config, compressor configs and callbacks.

Why strict booleans: ``bool("no")`` and ``bool("false")`` are ``True``, so a string that reaches a
boolean option (a hand-written dict, an environment variable, a YAML value quoted by mistake) would
silently turn the option *on*. LightningCLI / jsonargparse already converts YAML ``true``/``false``
to real booleans before they get here, so only genuine mistakes are refused.
"""

from __future__ import annotations


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
