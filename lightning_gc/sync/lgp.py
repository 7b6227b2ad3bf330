"""LGP: local-gradient-based parameter correction (OSP §4.2, Eq. 6–7), exact per optimizer.

At step ``t`` a deferred (ICS) parameter is updated with this rank's *local* gradient ``g_l``
(Eq. 6); when the global mean ``g_g`` arrives — during step ``t+1``, applied before step ``t+1``'s
optimizer step — it is corrected to what the update with ``g_g`` would have given (Eq. 7).

**Plain SGD** (``p ← p − lr·(g + wd·p)``): Eq. 7 is ``p ← p − lr_t·(g_g − g_l)`` with ``lr_t`` the
learning rate used at step ``t`` (a scheduler may have changed it since); weight decay cancels
because it acts on the same ``p_t``.

**SGD with momentum** ``μ``, dampening ``τ``: the local step set ``buf ← μ·buf_t + (1−τ)·d_l``
(``buf ← d_l`` on the first step), ``d = g + wd·p_t``. Correcting the buffer too:
``buf += (1−τ)·(g_g − g_l)`` (``+= g_g − g_l`` on the first step), and the parameter by
``−lr_t·Δbuf``; with **Nesterov** the step direction is ``d + μ·buf``, so the parameter moves by
``−lr_t·(1 + μ(1−τ))·(g_g − g_l)`` (``(1+μ)`` on the first step) while the buffer moves as above.
``maximize=True`` flips the sign of ``g``.

**How it is computed.** Those deltas are algebraically what we apply, but not in delta form:
``p_local − lr·(g_g − g_l)`` adds rank-local rounding to a value that must be identical on every
rank, and the replicas would drift apart by a few ulps per step. Instead the optimizer state of
the deferred parameters (``p_t``, ``buf_t``, the hyper-parameters in force) is snapshotted just
before the step and the step is *replayed* from it with ``g_g``: the result depends only on
replicated values, so ranks agree bit for bit, and it equals the update BSP would have made with
the same gradient. Memory: one copy of the deferred parameters (and their momentum buffers).

**Adam / AdamW and every other optimizer are refused at setup**: replaying them needs snapshots
of ``m``, ``v`` and ``step`` and a replay of their exact update, which this module does not
implement; an approximate correction would silently change the optimizer. Use ``torch.optim.SGD``
or ``sync="bsp"``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

_SUPPORTED = (torch.optim.SGD,)


def check_optimizer(optimizer: object) -> None:
    """Refuse optimizers LGP cannot correct exactly (value, reason, fix)."""
    if type(optimizer) not in _SUPPORTED:
        name = type(optimizer).__name__
        raise ValueError(
            f"GCStrategy(sync='osp') cannot train with optimizer {name}: OSP updates deferred layers "
            "with the local gradient and later corrects them to the global one (LGP), and lightning_gc "
            f"implements that correction exactly only for torch.optim.SGD (plain, momentum, Nesterov, "
            f"weight decay). For {name} the correction would need a replay of its update from "
            "snapshots of its state (Adam: m, v, step), which is not implemented, and an approximate "
            "correction would silently change the optimizer. Use torch.optim.SGD with sync='osp', or "
            "sync='bsp' (the default) with this optimizer."
        )
    for group in optimizer.param_groups:  # type: ignore[attr-defined]
        if group.get("differentiable"):
            raise ValueError(
                "GCStrategy(sync='osp') cannot correct a differentiable SGD (differentiable=True): the "
                "replayed update would not be part of the graph. Use differentiable=False."
            )


@dataclass
class _Entry:
    param: Tensor
    p0: Tensor
    buf0: Tensor | None
    lr: float
    momentum: float
    dampening: float
    nesterov: bool
    weight_decay: float
    maximize: bool


class LGPSnapshot:
    """Optimizer state of the deferred parameters just before one optimizer step.

    :meth:`take` before ``optimizer.step()`` (the gradients in ``p.grad`` of deferred parameters
    are local); :meth:`replay` once the global gradients have arrived (before the next step).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[Tensor]) -> None:
        # the optimizer's per-parameter state is looked up when the replay runs, not held: a rollback
        # exploration may have replaced it (Optimizer.load_state_dict) in between
        self.optimizer = optimizer
        group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
        self.entries: list[_Entry] = []
        for p in params:
            g = group_of.get(id(p))
            if g is None or p.grad is None:  # not optimised, or no gradient: the step leaves it alone
                self.entries.append(None)  # type: ignore[arg-type]
                continue
            buf = optimizer.state[p].get("momentum_buffer")
            self.entries.append(_Entry(
                param=p, p0=p.detach().clone(), buf0=None if buf is None else buf.detach().clone(),
                lr=float(g["lr"]), momentum=float(g["momentum"]), dampening=float(g["dampening"]),
                nesterov=bool(g["nesterov"]), weight_decay=float(g["weight_decay"]),
                maximize=bool(g.get("maximize", False)),
            ))

    @torch.no_grad()
    def replay(self, global_grads: list[Tensor]) -> float:
        """Set every snapshotted parameter (and momentum buffer) to the update with the global
        gradient; returns ``‖p_corrected − p_local‖₂`` over them (the size of the correction)."""
        sq = 0.0
        for e, gg in zip(self.entries, global_grads):
            if e is None:
                continue
            d = gg.to(e.p0.dtype).view_as(e.p0)
            if e.maximize:
                d = -d
            if e.weight_decay != 0:
                d = d.add(e.p0, alpha=e.weight_decay)
            if e.momentum != 0:
                if e.buf0 is None:
                    buf = torch.clone(d).detach()
                else:
                    buf = e.buf0.clone().mul_(e.momentum).add_(d, alpha=1 - e.dampening)
                d = d.add(buf, alpha=e.momentum) if e.nesterov else buf
                state = self.optimizer.state[e.param]
                held = state.get("momentum_buffer")
                if held is None:
                    state["momentum_buffer"] = buf
                else:
                    held.copy_(buf)
            new = e.p0.add(d, alpha=-e.lr)
            sq += float(torch.linalg.vector_norm((new - e.param).double())) ** 2
            e.param.copy_(new)
        return sq ** 0.5
