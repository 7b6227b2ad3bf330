"""GradientFidelity: how far the gradient and the update of each optimizer step are from exact DDP's.

A compressed method hands the optimizer an estimate ``ĝ`` of the mean gradient ``ḡ = mean_r g_r``
of the ranks. Whether it trains as well as DDP depends on how far ``ĝ`` is from ``ḡ`` *and* on
what the optimizer makes of the difference: SGD moves along ``ĝ``; Adam divides every coordinate
by the running RMS of what that coordinate received, so a sparse or biased ``ĝ`` can change the
update's direction far more than ``‖ĝ − ḡ‖`` suggests. This callback measures both on the run
itself, so that an accuracy gap can be traced to its cause instead of guessed at.

The ``gc/fidelity/*`` tags (:data:`FIDELITY_KEYS`), per measured step and per ``window`` of steps,
are described in docs/monitoring.md ("Gradient fidelity"), with what the window cosines show.

How it is measured:

* ``g_r``, this rank's own gradient, is copied in each parameter's
  ``register_post_accumulate_grad_hook``: it runs before DDP's reducer and any communication hook,
  so it sees the local gradient whatever the strategy does with it.
* ``ḡ`` is one extra fp32 allreduce of those copies on the default process group, issued in
  ``on_before_optimizer_step`` (after the method's own exchange, before clipping), where ``ĝ`` is
  read from ``p.grad``: a diagnostic, not for timing runs.
* The shadow optimizer (``update=True``) is a second instance of the real optimizer's class over
  private copies of the parameters, started from its state. Each step it is reset to ``θ_before``,
  given ``ḡ`` clipped to ``clip_norm`` and stepped with the real groups' hyperparameters; its
  displacement ``u*`` is what an optimizer that always received ``ḡ`` would do along this run's
  trajectory. Its moments must see every ``ḡ``, which is why ``update=True`` measures every step.

What is compared is what the optimizer receives: with ``sync="osp"`` the deferred layers hold the
local gradient at the step (they are corrected before the next one), and with ``sync="diloco"``
every inner step is local, so both show their local-step error here.

Tuning: ``every_n_steps`` (gradient figures only) spreads the cost. ``clip_norm`` must be the
clipping norm of the run when the module clips inside ``configure_gradient_clipping`` (the
``gpt`` and ``lm`` presets clip at 1.0); by default the Trainer's ``gradient_clip_val`` is used
with ``gradient_clip_algorithm="norm"``, else nothing is clipped. Runs with a ``GradScaler``
(``16-mixed``) are not measured (their local gradients are scaled): a warning says so.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

__all__ = ["FIDELITY_KEYS", "GradientFidelity"]

#: the figures measured per step, logged as ``gc/fidelity/<key>``
FIDELITY_KEYS = ("grad_rel_error", "grad_cos", "grad_norm_ratio", "update_cos", "update_rel_error", "grad_window_cos",
                 "update_window_cos")


def _cos(a: Tensor, b: Tensor) -> float:
    na, nb = float(a.norm()), float(b.norm())
    if na == 0.0 or nb == 0.0:
        return 1.0 if na == nb else 0.0
    return float(torch.dot(a, b)) / (na * nb)


def _rel_error(got: Tensor, ref: Tensor) -> float:
    r2 = float(ref.pow(2).sum())
    d2 = float((got - ref).pow(2).sum())
    if r2 == 0.0:
        return 0.0 if d2 == 0.0 else math.inf
    return d2 / r2


class _OptimizerTrack:
    """One optimizer's trainable parameters (their slices in the callback's buffer and in this
    track's flat vectors) and, with ``update=True``, its shadow optimizer."""

    def __init__(self, optimizer: torch.optim.Optimizer, slots: dict[int, slice], with_shadow: bool) -> None:
        self.params: list[Tensor] = []
        self.slices: list[slice] = []  # in the callback's local-gradient buffer
        self.offsets: dict[int, slice] = {}  # in this track's flat vectors
        n = 0
        for g in optimizer.param_groups:
            for p in g["params"]:
                if id(p) in slots and id(p) not in self.offsets:
                    self.params.append(p)
                    self.slices.append(slots[id(p)])
                    self.offsets[id(p)] = slice(n, n + p.numel())
                    n += p.numel()
        self.pending: dict[str, Any] | None = None
        # running sums over the current window: ĝ, ḡ (grad) and u, u* (update), with their step counts
        self.sums: dict[str, Tensor] = {}
        self.counts: dict[str, int] = {"grad": 0, "update": 0}
        self.shadow: torch.optim.Optimizer | None = None
        self.pairs: list[tuple[Tensor, Tensor]] = []  # (real parameter, shadow copy), in group order
        if with_shadow:
            groups = []
            for g in optimizer.param_groups:
                copies = [p.detach().clone() for p in g["params"]]
                self.pairs.extend(zip(g["params"], copies))
                groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": copies})
            try:
                self.shadow = type(optimizer)(groups)
                # a resumed run's moments carry over; deep-copied, because load_state_dict keeps the very
                # tensors it is given, and the shadow's steps would then move the real optimizer's state
                self.shadow.load_state_dict(copy.deepcopy(optimizer.state_dict()))
            except Exception as exc:  # noqa: BLE001 - re-raised with the reason and the fix
                raise ValueError(
                    f"GradientFidelity(update=True) could not build a shadow {type(optimizer).__name__} from the "
                    f"real optimizer's parameter groups and state ({exc}); use update=False to measure the gradient "
                    "alone."
                ) from exc

    def accumulate(self, kind: str, got: Tensor, ref: Tensor, window: int) -> float | None:
        """Add one step's pair to the ``kind`` window; at its end, the window's cosine (and reset)."""
        if window <= 0:
            return None
        for key, x in ((f"{kind}_got", got), (f"{kind}_ref", ref)):
            if key in self.sums:
                self.sums[key] += x
            else:
                self.sums[key] = x.clone()
        self.counts[kind] += 1
        if self.counts[kind] < window:
            return None
        cos = _cos(self.sums.pop(f"{kind}_got"), self.sums.pop(f"{kind}_ref"))
        self.counts[kind] = 0
        return cos

    def flat(self, tensors: list[Tensor | None]) -> Tensor:
        """``tensors`` (one per tracked parameter, ``None`` = zeros) as one float64 vector."""
        parts = [torch.zeros(p.numel(), dtype=torch.float64) if t is None else t.detach().reshape(-1).double()
                 for p, t in zip(self.params, tensors)]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)


class GradientFidelity(pl.Callback):
    """Measure how far each optimizer step's gradient and update are from exact DDP's (module doc).

    Args:
        every_n_steps: measure the gradient every this many optimizer steps (1 = every step). With
            ``update=True`` it must be 1: the shadow optimizer's moments need the exact gradient of
            every step.
        update: also run the shadow optimizer and compare the updates.
        clip_norm: global L2 norm the shadow clips the exact gradient to; ``None`` takes the
            Trainer's ``gradient_clip_val`` (norm algorithm), or no clipping. Pass the module's own
            norm when it clips in ``configure_gradient_clipping``.
        log: log the values under ``gc/fidelity/*`` each measured step.
        window: measured steps per window of the window cosines (0 = none).
        per_parameter: with ``update=True``, also keep each parameter's mean gradient and update
            cosines and its share of the exact gradient's energy (``summary()["per_parameter"]``),
            to see which tensors a method misrepresents.

    After (or during) the fit, :meth:`summary` gives the means over the measured steps and
    :attr:`history` every step's values.
    """

    def __init__(self, every_n_steps: int = 1, update: bool = True, clip_norm: float | None = None,
                 log: bool = True, window: int = 50, per_parameter: bool = False) -> None:
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"every_n_steps={every_n_steps!r} must be an integer >= 1 (1 = every optimizer step).")
        if update and every_n_steps != 1:
            raise ValueError(
                f"every_n_steps={every_n_steps} with update=True: the shadow optimizer's moments must see the exact "
                "gradient of every step; use every_n_steps=1, or update=False to measure the gradient alone."
            )
        if clip_norm is not None and (isinstance(clip_norm, bool) or not float(clip_norm) > 0):
            raise ValueError(f"clip_norm={clip_norm!r} must be a norm > 0, or None (the Trainer's gradient_clip_val).")
        if per_parameter and not update:
            raise ValueError("per_parameter=True with update=False: the per-parameter figures are taken with the "
                             "update comparison; use update=True, or per_parameter=False.")
        if isinstance(window, bool) or not isinstance(window, int) or window < 0:
            raise ValueError(f"window={window!r} must be an integer >= 0 (measured steps per window; 0 = no window).")
        self.window = window
        self.per_parameter = bool(per_parameter)
        self._per_param: dict[str, dict[str, float]] = {}
        self._names: dict[int, str] = {}
        self.every_n_steps = every_n_steps
        self.update = bool(update)
        self.clip_norm = None if clip_norm is None else float(clip_norm)
        self.log_values = bool(log)
        self.history: list[dict[str, float]] = []
        self.skipped_nonfinite = 0
        self._enabled = False
        self._slots: dict[int, slice] = {}
        self._local: Tensor | None = None
        self._armed = False
        self._zeroed_at = -1
        self._tracks: dict[int, _OptimizerTrack] = {}
        self._handles: list[Any] = []
        self._fresh: dict[str, float] = {}
        self._clip: float | None = None
        self._world = 1

    # ------------------------------------------------------------------ setup
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            rank_zero_warn("GradientFidelity: no process group with 2 or more ranks; nothing is measured "
                           "(with one rank every method is exact).")
            return
        if getattr(trainer.precision_plugin, "scaler", None) is not None:
            rank_zero_warn("GradientFidelity: the run uses a GradScaler (16-mixed): the local gradients the hooks see "
                           "are scaled and the aggregate is not, so nothing is measured; use 32-true or bf16-mixed.")
            return
        self._world = dist.get_world_size()
        self._slots, self._tracks = {}, {}  # a second fit starts afresh (history is kept)
        params: list[Tensor] = []
        self._names = {id(p): n for n, p in pl_module.named_parameters()}
        self._zeroed_at = -1
        seen: set[int] = set()
        offset = 0
        for p in pl_module.parameters():
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            params.append(p)
            self._slots[id(p)] = slice(offset, offset + p.numel())
            offset += p.numel()
        self._local = torch.zeros(offset, dtype=torch.float32)
        for p in params:
            self._handles.append(p.register_post_accumulate_grad_hook(self._capture(self._slots[id(p)])))
        self._clip = self.clip_norm
        if self._clip is None and trainer.gradient_clip_val and str(
                getattr(trainer.gradient_clip_algorithm, "value", trainer.gradient_clip_algorithm)) == "norm":
            self._clip = float(trainer.gradient_clip_val)
        self._enabled = True

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._enabled = False

    def _capture(self, where: slice):
        def hook(p: Tensor) -> None:
            if self._armed and p.grad is not None and self._local is not None:
                self._local[where].copy_(p.grad.detach().reshape(-1))
        return hook

    def _measured(self, trainer: pl.Trainer) -> bool:
        return self.update or trainer.global_step % self.every_n_steps == 0

    # ------------------------------------------------------------------ per step
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._armed = self._enabled and self._measured(trainer)
        if self._armed and self._zeroed_at != trainer.global_step:  # the step's first micro-batch
            self._local.zero_()  # a parameter without a gradient this step contributes zeros
            self._zeroed_at = trainer.global_step

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if not self._enabled or not self._armed:
            return
        track = self._tracks.get(id(optimizer))
        if track is None:  # built at its first step: a resumed run's optimizer state is loaded by then
            track = self._tracks[id(optimizer)] = _OptimizerTrack(optimizer, self._slots, self.update)
            if self.update:
                self._handles.append(optimizer.register_step_post_hook(self._after_step))
        track.pending = None
        local = torch.cat([self._local[s] for s in track.slices]) if track.slices else self._local[:0]
        exact = local.clone()
        dist.all_reduce(exact)  # the default group, on every rank at the same step
        exact = exact.double() / self._world
        got = track.flat([p.grad for p in track.params])
        if not (torch.isfinite(exact).all() and torch.isfinite(got).all()):
            self.skipped_nonfinite += 1
            return
        values = {"grad_rel_error": _rel_error(got, exact), "grad_cos": _cos(got, exact),
                  "grad_norm_ratio": float(got.norm()) / max(float(exact.norm()), 1e-300)}
        window_cos = track.accumulate("grad", got, exact, self.window)
        if window_cos is not None:
            values["grad_window_cos"] = window_cos
        if self.update and track.shadow is not None:
            if self._clip is not None:
                norm = float(exact.norm())
                factor = min(1.0, self._clip / (norm + 1e-6))  # clip_grad_norm_'s rule
                exact = exact * factor
            track.pending = {"values": values, "exact": exact, "got": got, "before": track.flat(list(track.params))}
        else:
            self._record(values)

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        track = self._tracks.get(id(optimizer))
        if track is None or track.pending is None or track.shadow is None:
            return
        pend, track.pending = track.pending, None
        before: Tensor = pend["before"]
        exact: Tensor = pend["exact"]
        with torch.no_grad():
            for real_group, shadow_group in zip(optimizer.param_groups, track.shadow.param_groups):
                for k, v in real_group.items():  # this step's learning rate and every other setting
                    if k != "params":
                        shadow_group[k] = v
            for p, c in track.pairs:
                where = track.offsets.get(id(p))
                if where is None:  # not trainable: the shadow does not move it
                    c.grad = None
                    continue
                c.copy_(before[where].view_as(c))
                c.grad = exact[where].view_as(c).to(c.dtype).clone()
            track.shadow.step()
            real_u = track.flat(list(track.params)) - before
            copies = {id(p): c for p, c in track.pairs}
            shadow_u = track.flat([copies[id(p)] for p in track.params]) - before
        values = dict(pend["values"])
        values["update_cos"] = _cos(real_u, shadow_u)
        values["update_rel_error"] = _rel_error(real_u, shadow_u)
        window_cos = track.accumulate("update", real_u, shadow_u, self.window)
        if window_cos is not None:
            values["update_window_cos"] = window_cos
        if self.per_parameter:
            energy = max(float(pend["exact"].pow(2).sum()), 1e-300)
            for p in track.params:
                where = track.offsets[id(p)]
                acc = self._per_param.setdefault(self._names.get(id(p), f"param{len(self._per_param)}"),
                                                 {"grad_cos": 0.0, "update_cos": 0.0, "energy_share": 0.0, "steps": 0})
                acc["grad_cos"] += _cos(pend["got"][where], pend["exact"][where])
                acc["update_cos"] += _cos(real_u[where], shadow_u[where])
                acc["energy_share"] += float(pend["exact"][where].pow(2).sum()) / energy
                acc["steps"] += 1
        self._record(values)

    def _record(self, values: dict[str, float]) -> None:
        self.history.append(values)
        self._fresh = values

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self._enabled:
            return
        if self._fresh:
            if self.log_values:
                for k, v in self._fresh.items():
                    if math.isfinite(v):
                        pl_module.log(f"gc/fidelity/{k}", v, on_step=True, on_epoch=False)
            self._fresh = {}

    # ------------------------------------------------------------------ results
    def summary(self) -> dict[str, Any]:
        """Means over the measured steps of every figure (over the windows for the window cosines;
        ``None`` for one never measured), the number of steps, and the steps skipped for a
        non-finite gradient."""
        out: dict[str, Any] = {"steps": len(self.history), "skipped_nonfinite": self.skipped_nonfinite}
        for k in FIDELITY_KEYS:
            xs = [h[k] for h in self.history if k in h and math.isfinite(h[k])]
            out[k] = sum(xs) / len(xs) if xs else None
        if self.per_parameter:
            out["per_parameter"] = {name: {k: (v / acc["steps"] if k != "steps" else v) for k, v in acc.items()}
                                    for name, acc in self._per_param.items() if acc["steps"]}
        return out
