"""Optimizer updates written out by hand, for the oracles of the OSP tests (never torch's code).

``sgd_update`` is torch.optim.SGD's rule, ``adam_update`` torch.optim.Adam's and AdamW's (Kingma &
Ba, Algorithm 1 with torch's ε placement; decoupled weight decay as Loshchilov & Hutter), each for
one tensor. State: SGD the momentum buffer (``None`` before the first step); Adam the tuple
``(step, m, v, v_max)`` (``None`` before the first step).
"""

from __future__ import annotations

import torch


def sgd_update(p, buf, g, h):
    """Returns (new p, new buf) for options ``h`` (lr, momentum, dampening, nesterov, weight_decay,
    maximize)."""
    d = (-g if h.get("maximize") else g) + h["weight_decay"] * p
    if h["momentum"]:
        buf = d.clone() if buf is None else h["momentum"] * buf + (1 - h["dampening"]) * d
        d = d + h["momentum"] * buf if h["nesterov"] else buf
    return p - h["lr"] * d, buf


def adam_update(p, st, g, h, decoupled):
    """Returns (new p, new state) for options ``h`` (lr, betas, eps, weight_decay, amsgrad,
    maximize); ``decoupled``: AdamW's weight decay ``p ← p·(1 − lr·wd)`` instead of ``g + wd·p``."""
    step, m, v, vmax = st if st is not None else (0, torch.zeros_like(p), torch.zeros_like(p), torch.zeros_like(p))
    b1, b2 = h["betas"]
    lr = h["lr"]
    g = -g if h["maximize"] else g
    if h["weight_decay"]:
        if decoupled:
            p = p * (1 - lr * h["weight_decay"])
        else:
            g = g + h["weight_decay"] * p
    step += 1
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    vmax = torch.maximum(vmax, v) if h["amsgrad"] else vmax
    bc1, bc2 = 1 - b1 ** step, 1 - b2 ** step
    denom = (vmax if h["amsgrad"] else v).sqrt() / bc2 ** 0.5 + h["eps"]
    return p - lr / bc1 * m / denom, (step, m, v, vmax)


def update_for(opt_name: str):
    """The hand-written update ``(p, state, g, h) -> (p, state)`` of a torch.optim class name."""
    if opt_name == "SGD":
        return sgd_update
    if opt_name in ("Adam", "AdamW"):
        return lambda p, st, g, h: adam_update(p, st, g, h, decoupled=opt_name == "AdamW")
    raise ValueError(opt_name)
