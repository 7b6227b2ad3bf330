"""What auto measures between steps, and the check that what a decision uses is the same on every rank.

Every figure a decision uses is agreed across ranks (MAX of times, MEAN of errors) before the policy
(:mod:`lightning_gc.auto.policy`) sees it, so every rank takes the same branch. A figure that is not
(a bug: a local value where an agreed one belongs) would make the ranks choose differently and then
issue different collectives: a gloo abort or a hang far from the cause. :func:`check_agreed` turns
that into a clear error on every rank, naming each rank's value.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist


class InputsDisagree(RuntimeError):
    """A decision's inputs differ across ranks (raised on every rank alike)."""


def check_agreed(named: Sequence[tuple[str, float]], what: str, group: object = None,
                 device: torch.device | None = None) -> None:
    """Raise :class:`InputsDisagree` on every rank if any of ``named`` (name, value) differs across the
    ranks of ``group``, naming the value on each rank; ``what`` says which decision. One all-gather of
    the values (float64, compared bit for bit, so NaN equals NaN and -0.0 differs from 0.0: a decision
    can branch on either). Nothing to check without an initialised process group or on one rank."""
    if not named or not (dist.is_available() and dist.is_initialized()):
        return
    ws = dist.get_world_size(group)
    if ws < 2:
        return
    mine = torch.tensor([float(v) for _, v in named], dtype=torch.float64, device=device)
    every = [torch.empty_like(mine) for _ in range(ws)]
    dist.all_gather(every, mine, group=group)
    bits = torch.stack([t.cpu() for t in every]).view(torch.int64)
    differ = (bits != bits[0]).any(dim=0).nonzero().flatten().tolist()
    if not differ:
        return
    rows = torch.stack([t.cpu() for t in every])
    detail = "; ".join(f"{named[k][0]}: " + ", ".join(f"rank {r} = {float(rows[r, k])!r}" for r in range(ws))
                       for k in differ[:8])
    more = f" (and {len(differ) - 8} more)" if len(differ) > 8 else ""
    raise InputsDisagree(
        f"lightning_gc auto: the inputs of {what} differ across ranks, so the ranks would choose differently and "
        f"then deadlock: {detail}{more}. Every figure a decision uses must be agreed across ranks (MAX or MEAN) "
        "before the decision; a value measured on one rank only reached it. Please report this with the lines above.")
