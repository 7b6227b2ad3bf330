"""LGP: local-gradient-based parameter correction (OSP §4.2, Eq. 6–7), exact per optimizer.

At step ``t`` a deferred (ICS) parameter is updated with this rank's *local* gradient ``g_l``
(Eq. 6); when the global mean ``g_g`` arrives — during step ``t+1``, applied before step ``t+1``'s
optimizer step — it is corrected to what the update with ``g_g`` would have given (Eq. 7).

**What the correction is, per optimizer.** The paper writes Eq. 7 for plain SGD
(``p ← p − lr_t·(g_g − g_l)``, ``lr_t`` the learning rate of step ``t``). For the other optimizers
the correction is defined the same way — *the parameter and its optimizer state end as the update
with the global gradient would have left them* — which has a delta form only for the SGD family
(docs/osp.md lists them): with momentum ``μ`` and dampening ``τ`` the buffer moves by
``(1−τ)·(g_g − g_l)`` (``g_g − g_l`` on its first step) and the parameter by ``−lr_t`` times that
(``(1 + μ(1−τ))·`` with Nesterov). Adam and AdamW have none: ``m`` and ``v`` are updated from the
gradient, and ``v`` through its square, so the local step's ``m_l``, ``v_l`` and the parameter
``p_t − lr·m̂_l/(√v̂_l + ε)`` cannot be turned into the global ones by adding anything computed
from ``g_g − g_l`` alone.

**How it is computed: a replay.** Just before step ``t``'s optimizer step :class:`LGPSnapshot`
copies, for the deferred parameters, ``p_t``, every tensor of their optimizer state (SGD: the
momentum buffer; Adam/AdamW: ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq`` with ``amsgrad`` and
the ``step`` count behind the bias correction) and the options in force (``lr_t`` even if a
scheduler changes it later, betas, eps, weight decay coupled (Adam) or decoupled (AdamW),
``amsgrad``, ``maximize``, momentum, dampening, Nesterov). The replay puts those values back,
sets the gradient to ``g_g`` and runs *the optimizer class's own* ``step`` on a temporary
instance holding only the deferred parameters, then copies the result into the live optimizer.
So the result is the update BSP would have made with the same gradient, computed by the same
code, and it depends only on replicated values: ranks agree bit for bit (a delta form
``p_local + c·(g_g − g_l)`` would add rank-local rounding to a value that must be replicated).
Memory: one copy of the deferred parameters and of their optimizer state (SGD with momentum: 2×
the deferred elements; Adam: 3×; with ``amsgrad``: 4×).

**Gradient clipping** (decided here, docs/osp.md "Gradient clipping"): the gradient of step ``t``
was clipped by a transform that every rank applied identically — norm clipping by a factor
``c_t`` computed from replicated values, value clipping element-wise — and the replay applies
the same transform to ``g_g`` (:meth:`LGPSnapshot.clip_like_step`), so the corrected update is the
update with the clipped global gradient.

**Supported:** ``torch.optim.SGD``, ``torch.optim.Adam`` and ``torch.optim.AdamW`` with every
option except ``differentiable=True`` (the replay runs outside autograd). Other optimizers are
refused at setup: the replay is right only for an optimizer whose update of a parameter reads
nothing but that parameter, its gradient and its own state, which is checked here per class
rather than assumed (e.g. LBFGS couples all parameters).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

_SUPPORTED = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


def check_optimizer(optimizer: object) -> None:
    """Refuse optimizers LGP cannot correct exactly (value, reason, fix)."""
    if type(optimizer) not in _SUPPORTED:
        name = type(optimizer).__name__
        raise ValueError(
            f"GCStrategy(sync='osp') cannot train with optimizer {name}: OSP updates deferred layers "
            "with the local gradient and later corrects them to the global one by replaying the "
            "optimizer's update from a snapshot of its state (LGP), and lightning_gc does that only for "
            "optimizers whose update of a parameter reads nothing but that parameter, its gradient and "
            f"its own state, checked per class: torch.optim.SGD, Adam and AdamW. {name} is not among "
            "them, and an approximate correction would silently change the optimizer. Use SGD, Adam or "
            "AdamW with sync='osp', or sync='bsp' (the default) with this optimizer."
        )
    for group in optimizer.param_groups:  # type: ignore[attr-defined]
        if group.get("differentiable"):
            raise ValueError(
                f"GCStrategy(sync='osp') cannot correct a differentiable {type(optimizer).__name__} "
                "(differentiable=True): the replayed update runs outside autograd. Use differentiable=False."
            )


def check_training_setup(optimizers: list[object], fp16_scaler: bool, automatic_optimization: bool) -> None:
    """Refuse, at setup, what OSP cannot keep identical across ranks: an optimizer LGP cannot replay
    (:func:`check_optimizer`), fp16 loss scaling (each rank's scaler decides alone from gradients that are
    partly local under OSP), and manual optimization (the loss steers the schedule)."""
    for optimizer in optimizers:
        check_optimizer(optimizer)
    if fp16_scaler:
        raise ValueError(
            "GCStrategy(sync='osp') with fp16 mixed precision ('16-mixed'): torch's GradScaler decides on each "
            "rank alone, from that rank's gradients, whether to skip a step and how to change the loss scale; "
            "under OSP the deferred layers' gradients are local, so ranks could skip different steps and "
            "scale differently, and the replicas would diverge. Use precision='bf16-mixed' (no scaler) or "
            "'32-true', or sync='bsp'."
        )
    if not automatic_optimization:
        raise ValueError(
            "GCStrategy(sync='osp') needs automatic optimization (the loss steers the S(Gu) schedule and "
            "the correction runs around optimizer.step()). Use sync='bsp' with manual optimization."
        )


def _copy(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, Tensor) else value


@dataclass
class _Entry:
    param: Tensor
    group: int  # index of the parameter's group in the optimizer
    p0: Tensor  # the parameter before the local step
    state0: dict[str, Any]  # its optimizer state before the local step (copies)


class LGPSnapshot:
    """Optimizer state of the deferred parameters just before one optimizer step.

    Built just before ``optimizer.step()`` (the gradients in ``p.grad`` of deferred parameters are
    local); :meth:`replay` once the global gradients have arrived (before the next step).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[Tensor]) -> None:
        # the optimizer's per-parameter state is looked up when the replay runs, not held: a rollback
        # exploration may have replaced it (Optimizer.load_state_dict) in between
        self.optimizer = optimizer
        group_of = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
        # the options of step t (a scheduler may change lr before the replay)
        self.options = [{k: _copy(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        self.scale: float = 1.0  # norm clipping: the factor step t's gradients were multiplied by
        self.clamp: float | None = None  # value clipping: step t's gradients were clamped to ±clamp
        self.entries: list[_Entry | None] = []
        for p in params:
            gi = group_of.get(id(p))
            if gi is None or p.grad is None:  # not optimised, or no gradient: the step leaves it alone
                self.entries.append(None)
                continue
            state = {k: _copy(v) for k, v in optimizer.state[p].items()} if p in optimizer.state else {}
            self.entries.append(_Entry(param=p, group=gi, p0=p.detach().clone(), state0=state))

    def clip_like_step(self, scale: float = 1.0, clamp: float | None = None) -> None:
        """Record how step ``t``'s gradients were clipped, identically on every rank: multiplied by
        ``scale`` (norm clipping) and/or clamped to ``±clamp`` (value clipping). The replay applies
        the same to the global gradient."""
        self.scale, self.clamp = float(scale), None if clamp is None else float(clamp)

    @torch.no_grad()
    def replay(self, global_grads: list[Tensor]) -> float:
        """Set every snapshotted parameter (and its optimizer state) to the update with the global
        gradient; returns ``‖p_corrected − p_local‖₂`` over them (the size of the correction)."""
        live = [(e, g) for e, g in zip(self.entries, global_grads) if e is not None]
        if not live:
            return 0.0
        local, held_grads = [], []
        groups: dict[int, list[Tensor]] = {}
        for e, gg in live:
            local.append(e.param.detach().clone())
            held_grads.append(e.param.grad)  # the next step's gradient: put back afterwards
            d = gg.to(e.p0.dtype, copy=True).view_as(e.p0)  # its own tensor: the caller reads gg afterwards
            if self.clamp is not None:
                d.clamp_(-self.clamp, self.clamp)
            if self.scale != 1.0:
                d.mul_(self.scale)  # what clip_grad_norm_ did to step t's gradients
            e.param.copy_(e.p0)
            e.param.grad = d
            groups.setdefault(e.group, []).append(e.param)
        # the optimizer's own update, on a temporary instance that holds only the deferred parameters
        # with the options and state of step t. Hooks registered on the live optimizer (a scheduler's
        # step counter, a user's step hook) do not see the replay; torch's global optimizer hooks do.
        replay = type(self.optimizer)([dict(self.options[gi], params=ps) for gi, ps in groups.items()])
        for e, _ in live:
            if e.state0:  # a copy: a rollback exploration may restore this snapshot and replay it again
                replay.state[e.param] = {k: _copy(v) for k, v in e.state0.items()}
        try:
            replay.step()
        finally:
            for (e, _), grad in zip(live, held_grads):
                e.param.grad = grad
        sq = 0.0
        for (e, _), before in zip(live, local):
            new_state = replay.state.get(e.param, {})
            held = self.optimizer.state[e.param]  # defaultdict: created if a rollback dropped it
            for k, v in new_state.items():
                old = held.get(k)
                if isinstance(v, Tensor) and isinstance(old, Tensor) and old.shape == v.shape and old.dtype == v.dtype:
                    old.copy_(v)  # keep the live tensors (anything holding them sees the correction)
                else:
                    held[k] = v
            sq += float(torch.linalg.vector_norm((e.param.detach() - before).double())) ** 2
        return sq ** 0.5
