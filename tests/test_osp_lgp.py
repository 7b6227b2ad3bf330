"""LGP's replay (lightning_gc.sync.lgp) for every torch.optim.SGD option it claims, single process.

A parameter is updated by ``optimizer.step()`` with a *local* gradient, then corrected by
:meth:`LGPSnapshot.replay` with the *global* one. Two oracles, neither of them the replay:

* the update written out by hand (``p − lr·d`` with ``d`` from the gradient, weight decay,
  maximize, momentum, dampening, Nesterov; the buffer's first step is a copy of ``d``), and the
  delta forms of docs/osp.md (``p_local − lr_t·k·(g_g − g_l)``, ``buf_local + c·(g_g − g_l)``);
* ``torch.optim.SGD`` itself stepped from the same state with the global gradient: the replay
  must equal it bit for bit (it is the BSP update with that gradient).

Every option combination runs with and without an existing momentum buffer (the buffer does not
exist yet when a layer is deferred at its first optimizer step), with a learning rate changed
between the step and the replay (a scheduler), with a parameter that has no gradient, and with
two parameter groups of different options.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from optim_oracles import adam_update, sgd_update

from lightning_gc.sync import LGPSnapshot

OPTIONS = [
    dict(momentum=0.0, dampening=0.0, nesterov=False, weight_decay=0.0, maximize=False),
    dict(momentum=0.0, dampening=0.0, nesterov=False, weight_decay=0.05, maximize=False),
    dict(momentum=0.0, dampening=0.0, nesterov=False, weight_decay=0.05, maximize=True),
    dict(momentum=0.9, dampening=0.0, nesterov=False, weight_decay=0.0, maximize=False),
    dict(momentum=0.8, dampening=0.3, nesterov=False, weight_decay=0.02, maximize=False),
    dict(momentum=0.8, dampening=0.3, nesterov=False, weight_decay=0.0, maximize=True),
    dict(momentum=0.9, dampening=0.0, nesterov=True, weight_decay=0.0, maximize=False),
    dict(momentum=0.9, dampening=0.0, nesterov=True, weight_decay=0.01, maximize=True),
]
LR = 0.07


def _ids(o: dict) -> str:
    parts = [f"mom{o['momentum']}"]
    parts += [f"damp{o['dampening']}"] * bool(o["dampening"]) + ["nesterov"] * o["nesterov"]
    parts += [f"wd{o['weight_decay']}"] * bool(o["weight_decay"]) + ["maximize"] * o["maximize"]
    return "-".join(parts)


def _hand_update(p, buf, g, o, lr):
    """torch.optim.SGD's update written out: returns (p_new, buf_new)."""
    return sgd_update(p, buf, g, dict(o, lr=lr))


def _reference_step(reference_opt, g_global):
    """torch's own step from the copy made before the local step, with the global gradient (the
    last parameter, ``frozen``, has none); returns the copy's parameters."""
    ref_params = reference_opt.param_groups[0]["params"]
    for rp, g in zip(ref_params, g_global):
        rp.grad = g.clone()
    ref_params[-1].grad = None
    reference_opt.step()
    return ref_params


def _tensors(seed: int):
    g = torch.Generator().manual_seed(seed)
    shapes = [(4, 3), (5,)]
    return ([torch.randn(s, generator=g) for s in shapes],  # parameters
            [torch.randn(s, generator=g) for s in shapes],  # an earlier gradient (builds the buffer)
            [torch.randn(s, generator=g) * 0.7 for s in shapes],  # local gradients
            [torch.randn(s, generator=g) * 1.3 for s in shapes])  # global gradients


@pytest.mark.parametrize("with_buffer", [True, False], ids=["buffer", "no-buffer-yet"])
@pytest.mark.parametrize("o", OPTIONS, ids=_ids)
def test_replay_equals_the_update_with_the_global_gradient(o, with_buffer):
    p0, g_prev, g_local, g_global = _tensors(7)
    params = [torch.nn.Parameter(t.clone()) for t in p0]
    frozen = torch.nn.Parameter(torch.ones(3))  # optimised but no gradient at this step
    opt = torch.optim.SGD(params + [frozen], lr=LR, **o)
    if with_buffer:  # one earlier step: the buffer exists and the parameters moved
        for p, g in zip(params, g_prev):
            p.grad = g.clone()
        opt.step()
    before = [p.detach().clone() for p in params]
    buf_before = [opt.state[p].get("momentum_buffer") for p in params]
    buf_before = [None if b is None else b.clone() for b in buf_before]
    assert all(b is None for b in buf_before) != with_buffer or not o["momentum"]
    reference_opt = copy.deepcopy(opt)  # torch's SGD, to be stepped with the global gradient

    for p, g in zip(params, g_local):
        p.grad = g.clone()
    frozen.grad = None
    snap = LGPSnapshot(opt, params + [frozen])
    opt.step()  # the local update (OSP Eq. 6)
    local = [p.detach().clone() for p in params]
    local_buf = [opt.state[p].get("momentum_buffer") for p in params]
    local_buf = [None if b is None else b.clone() for b in local_buf]
    for group in opt.param_groups:  # a scheduler changes lr before the correction: lr_t is kept
        group["lr"] = 123.0
    norm = snap.replay(g_global + [torch.full((3,), float("nan"))])  # no entry for `frozen`: not read

    ref_params = _reference_step(reference_opt, g_global)
    for i, p in enumerate(params):
        want_p, want_buf = _hand_update(before[i], buf_before[i], g_global[i], o, LR)
        torch.testing.assert_close(p.detach(), want_p, rtol=1e-6, atol=1e-7)
        assert torch.equal(p.detach(), ref_params[i].detach()), "replay differs from torch's SGD step"
        buf = opt.state[p].get("momentum_buffer")
        if o["momentum"]:
            torch.testing.assert_close(buf, want_buf, rtol=1e-6, atol=1e-7)
            assert torch.equal(buf, reference_opt.state[ref_params[i]]["momentum_buffer"])
            # docs/osp.md's delta forms: the buffer moves by c·Δ, the parameter by −lr·k·Δ
            sign = -1.0 if o["maximize"] else 1.0
            delta = sign * (g_global[i] - g_local[i])
            first = buf_before[i] is None
            c = 1.0 if first else 1 - o["dampening"]
            k = (1 + o["momentum"] * c) if o["nesterov"] else c
            torch.testing.assert_close(buf, local_buf[i] + c * delta, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(p.detach(), local[i] - LR * k * delta, rtol=1e-5, atol=1e-6)
        else:
            assert buf is None
            sign = -1.0 if o["maximize"] else 1.0
            torch.testing.assert_close(p.detach(), local[i] - LR * sign * (g_global[i] - g_local[i]),
                                       rtol=1e-5, atol=1e-6)
    assert torch.equal(frozen.detach(), torch.ones(3))  # no gradient: left alone
    want_norm = torch.sqrt(sum(((p.detach().double() - q.double()) ** 2).sum() for p, q in zip(params, local)))
    assert norm == pytest.approx(float(want_norm), rel=1e-6)
    assert norm > 0


def test_replay_creates_the_buffer_when_the_optimizer_holds_none():
    """The momentum buffer was dropped between the step and the replay (an optimizer state restored
    from before it existed): the replay creates it, and the next torch step uses it."""
    o = OPTIONS[4]
    p0, _, g_local, g_global = _tensors(11)
    p = torch.nn.Parameter(p0[0].clone())
    opt = torch.optim.SGD([p], lr=LR, **o)
    p.grad = g_local[0].clone()
    snap = LGPSnapshot(opt, [p])
    opt.step()
    opt.state[p].pop("momentum_buffer")
    snap.replay([g_global[0]])
    want_p, want_buf = _hand_update(p0[0], None, g_global[0], o, LR)
    assert torch.equal(opt.state[p]["momentum_buffer"], want_buf)
    torch.testing.assert_close(p.detach(), want_p, rtol=1e-6, atol=1e-7)
    g_next = torch.ones_like(p)
    p.grad = g_next
    opt.step()  # torch continues from the created buffer
    want_p2, _ = _hand_update(want_p, want_buf, g_next, o, LR)
    torch.testing.assert_close(p.detach(), want_p2, rtol=1e-6, atol=1e-7)


def test_replay_uses_each_parameter_groups_own_options():
    """Two groups with different options (the snapshot reads them per parameter)."""
    (a0, b0), (ga_prev, gb_prev), (ga, gb), (Ga, Gb) = (list(t) for t in _tensors(3))
    a, b = torch.nn.Parameter(a0.clone()), torch.nn.Parameter(b0.clone())
    oa, ob = OPTIONS[6], OPTIONS[5]
    opt = torch.optim.SGD([dict(params=[a], lr=0.05, **oa), dict(params=[b], lr=0.2, **ob)], lr=1.0)
    a.grad, b.grad = ga_prev.clone(), gb_prev.clone()
    opt.step()
    before = {"a": (a.detach().clone(), opt.state[a]["momentum_buffer"].clone()),
              "b": (b.detach().clone(), opt.state[b]["momentum_buffer"].clone())}
    a.grad, b.grad = ga.clone(), gb.clone()
    snap = LGPSnapshot(opt, [a, b])
    opt.step()
    snap.replay([Ga, Gb])
    for name, p, g, o, lr in (("a", a, Ga, oa, 0.05), ("b", b, Gb, ob, 0.2)):
        want_p, want_buf = _hand_update(*before[name], g, o, lr)
        torch.testing.assert_close(p.detach(), want_p, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(opt.state[p]["momentum_buffer"], want_buf, rtol=1e-6, atol=1e-7)


def test_every_option_combination_of_the_docs_is_covered():
    """The options LGP claims (module docstring, docs/osp.md): each appears on and off above."""
    for key in ("momentum", "dampening", "nesterov", "weight_decay", "maximize"):
        assert {bool(o[key]) for o in OPTIONS} == {True, False}, key
    for o1, o2 in itertools.combinations(("nesterov", "maximize", "weight_decay"), 2):
        assert any(o[o1] and o[o2] for o in OPTIONS), (o1, o2)


# ---------------------------------------------------------------- Adam and AdamW
ADAM_OPTIONS = [
    ("Adam", dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, maximize=False)),
    ("Adam", dict(betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05, amsgrad=False, maximize=False)),
    ("Adam", dict(betas=(0.9, 0.99), eps=1e-8, weight_decay=0.02, amsgrad=True, maximize=True)),
    ("AdamW", dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, amsgrad=False, maximize=False)),
    ("AdamW", dict(betas=(0.85, 0.98), eps=1e-7, weight_decay=0.1, amsgrad=True, maximize=False)),
    ("AdamW", dict(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, amsgrad=False, maximize=True)),
]


def _hand_adam(p, st, g, o, lr, decoupled):
    return adam_update(p, st, g, dict(o, lr=lr), decoupled)


def _adam_state(opt, p, o):
    s = opt.state[p]
    return (int(s["step"]), s["exp_avg"].clone(), s["exp_avg_sq"].clone(),
            s["max_exp_avg_sq"].clone() if o["amsgrad"] else torch.zeros_like(p))


@pytest.mark.parametrize("with_state", [True, False], ids=["state", "first-step"])
@pytest.mark.parametrize("cls, o", ADAM_OPTIONS, ids=[f"{c}-{i}" for i, (c, _) in enumerate(ADAM_OPTIONS)])
def test_adam_replay_equals_the_update_with_the_global_gradient(cls, o, with_state):
    """Moments, step count, bias correction, coupled (Adam) or decoupled (AdamW) weight decay,
    amsgrad and maximize: after the replay the parameter and the whole state are the update with
    the global gradient (by hand, and bit for bit torch's own step from the same state)."""
    p0, g_prev, g_local, g_global = _tensors(5)
    params = [torch.nn.Parameter(t.clone()) for t in p0]
    frozen = torch.nn.Parameter(torch.ones(3))
    opt = getattr(torch.optim, cls)(params + [frozen], lr=LR, **o)
    if with_state:  # two earlier steps: step = 2 and the moments are not zero
        for _ in range(2):
            for p, g in zip(params, g_prev):
                p.grad = g.clone()
            opt.step()
    before = [p.detach().clone() for p in params]
    st_before = [_adam_state(opt, p, o) if with_state else None for p in params]
    reference_opt = copy.deepcopy(opt)
    for p, g in zip(params, g_local):
        p.grad = g.clone()
    frozen.grad = None
    snap = LGPSnapshot(opt, params + [frozen])
    opt.step()  # the local update
    local = [p.detach().clone() for p in params]
    assert int(opt.state[params[0]]["step"]) == (3 if with_state else 1)
    next_grads = [torch.full_like(p, 7.0) for p in params]  # the next step's gradients sit in p.grad
    for p, g in zip(params, next_grads):
        p.grad = g
    for group in opt.param_groups:  # a scheduler changes lr before the correction: lr_t is kept
        group["lr"] = 123.0
    norm = snap.replay(g_global + [torch.full((3,), float("nan"))])

    ref_params = _reference_step(reference_opt, g_global)
    for i, p in enumerate(params):
        want_p, want_st = _hand_adam(before[i], st_before[i], g_global[i], o, LR, decoupled=cls == "AdamW")
        torch.testing.assert_close(p.detach(), want_p, rtol=1e-5, atol=1e-6)
        got_st = _adam_state(opt, p, o)
        assert got_st[0] == want_st[0]  # step counted once, not twice
        for got, want in zip(got_st[1:], want_st[1:]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
        assert torch.equal(p.detach(), ref_params[i].detach()), "replay differs from torch's own step"
        for k, v in reference_opt.state[ref_params[i]].items():
            assert torch.equal(opt.state[p][k], v), k
        assert p.grad is next_grads[i]  # the next step's gradient is left where it was
    assert torch.equal(frozen.detach(), torch.ones(3)) and frozen not in opt.state or not opt.state[frozen]
    want_norm = torch.sqrt(sum(((p.detach().double() - q.double()) ** 2).sum() for p, q in zip(params, local)))
    assert norm == pytest.approx(float(want_norm), rel=1e-6) and norm > 0


@pytest.mark.parametrize("cls", ["SGD", "AdamW"])
def test_replay_clips_the_global_gradient_like_the_step(cls):
    """Step t's gradient was clipped (norm: multiplied by a factor every rank computed alike;
    value: clamped): the replay is the update with the global gradient clipped the same way."""
    p0, _, g_local, g_global = _tensors(9)
    kw = dict(momentum=0.9) if cls == "SGD" else dict(weight_decay=0.1)
    for scale, clamp in ((0.37, None), (1.0, 0.4), (0.5, 0.3)):
        params = [torch.nn.Parameter(t.clone()) for t in p0]
        opt = getattr(torch.optim, cls)(params, lr=LR, **kw)
        reference_opt = copy.deepcopy(opt)
        for p, g in zip(params, g_local):
            p.grad = g.clone()
        snap = LGPSnapshot(opt, params)
        opt.step()
        snap.clip_like_step(scale, clamp)
        snap.replay(g_global)
        for rp, g in zip(reference_opt.param_groups[0]["params"], g_global):  # clip by hand, then step
            rp.grad = (g.clamp(-clamp, clamp) if clamp is not None else g.clone()) * scale
        reference_opt.step()
        for p, rp in zip(params, reference_opt.param_groups[0]["params"]):
            torch.testing.assert_close(p.detach(), rp.detach(), rtol=1e-6, atol=1e-7)
        assert all(torch.equal(a, b) for a, b in zip(g_global, _tensors(9)[3]))  # the caller's gradients untouched


def test_replay_of_two_adam_groups_uses_each_groups_options():
    (a0, b0), _, (ga, gb), (Ga, Gb) = (list(t) for t in _tensors(4))
    a, b = torch.nn.Parameter(a0.clone()), torch.nn.Parameter(b0.clone())
    oa, ob = ADAM_OPTIONS[3][1], ADAM_OPTIONS[4][1]
    opt = torch.optim.AdamW([dict(params=[a], lr=0.05, **oa), dict(params=[b], lr=0.2, **ob)], lr=1.0)
    a.grad, b.grad = ga.clone(), gb.clone()
    snap = LGPSnapshot(opt, [a, b])
    opt.step()
    snap.replay([Ga, Gb])
    for p, p_0, g, o, lr in ((a, a0, Ga, oa, 0.05), (b, b0, Gb, ob, 0.2)):
        want_p, _ = _hand_adam(p_0, None, g, o, lr, decoupled=True)
        torch.testing.assert_close(p.detach(), want_p, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cls", ["SGD", "AdamW"])
def test_a_snapshot_replayed_twice_gives_the_same_result(cls):
    """A rollback exploration restores OSP's state, the deferred exchange in flight and its
    snapshot included, and the same snapshot is replayed again: the replay must not consume it."""
    p0, g_prev, g_local, g_global = _tensors(13)
    params = [torch.nn.Parameter(t.clone()) for t in p0]
    kw = dict(momentum=0.9) if cls == "SGD" else dict(weight_decay=0.1)
    opt = getattr(torch.optim, cls)(params, lr=LR, **kw)
    for p, g in zip(params, g_prev):  # state exists before the snapshot
        p.grad = g.clone()
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    for p, g in zip(params, g_local):
        p.grad = g.clone()
    before = [p.detach().clone() for p in params]
    snap = LGPSnapshot(opt, params)
    opt.step()
    snap.replay(g_global)
    first = [p.detach().clone() for p in params]
    first_state = copy.deepcopy(opt.state_dict()["state"])
    with torch.no_grad():  # the exploration is rolled back: parameters and optimizer as before the step
        for p, b in zip(params, before):
            p.copy_(b)
    opt.load_state_dict(saved)
    opt.step()  # the local step again
    snap.replay(g_global)
    for a, b in zip(first, params):
        assert torch.equal(a, b.detach())
    for i, st in first_state.items():
        for k, v in st.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(opt.state_dict()["state"][i][k])), (i, k)
