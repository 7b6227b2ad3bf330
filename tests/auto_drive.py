"""Drive ``AutoChooser`` through its public API only, for behaviour tests of ``compressor="auto"``.

* :class:`FakeEngine` implements the engine port the chooser is typed against
  (:class:`lightning_gc.engine.ports.MethodControl`) for one process standing in for ``world_size``
  identical ranks: without a process group every agreement is the identity.
* :class:`Clock` replaces ``time.perf_counter`` (the stdlib function, so whichever auto module reads
  the clock reads this one): a step's wall is what the test says it is.
* :func:`resume_after_warmup` builds the checkpoint a chooser writes right after its warm-up decision
  on given costs, workload and network (the decision itself by the public :func:`policy.decide`) and
  resumes a fresh chooser from it (``load_state_dict``), so later decisions run the chooser's own code
  on exactly the test's numbers.
* :func:`window` runs one drift window of steps through ``after_optimizer_step``.
* :func:`model_inputs` / :func:`redecide`: what the next decision would see and choose, from the
  chooser's public state (``state_dict``, ``history``) and the pure policy.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from dataclasses import replace
from types import SimpleNamespace

import torch

from lightning_gc.auto import policy
from lightning_gc.auto.candidates import candidate
from lightning_gc.auto.chooser import AutoChooser
from lightning_gc.auto.config import AutoConfig
from lightning_gc.auto.model import MethodCost, Workload, calibrate_other, compute_shift
from lightning_gc.auto.policy import DecisionInputs, Trigger
from lightning_gc.comm.cost_model import NetworkModel
from lightning_gc.comm.link import LinkObserver
from lightning_gc.comm.network import NetworkState


class Clock:
    """``time.perf_counter`` under the test's control (install with ``monkeypatch``)."""

    def __init__(self, monkeypatch, start: float = 100.0) -> None:
        self.now = start
        monkeypatch.setattr(time, "perf_counter", lambda: self.now)


class FakeEngine:
    """The members of :class:`~lightning_gc.engine.ports.MethodControl` the chooser uses, for one process
    standing in for ``world_size`` ranks. ``calls`` records every method change the chooser applies.

    ``carry=False``: a wall handed to ``carry_wall`` is lost on the way (``carried_wall_mean_s`` None, as
    after a resume): each window's median is then this rank's own walls, agreed (the identity here), and
    the every-step tests see nothing. ``carry=True``: as GCEngine, the next step's messages carry it (its
    closing report, or a dense step's first bucket once ``enable_dense_carry`` was called)."""

    def __init__(self, network: NetworkModel | None, world_size: int = 4, pinned: bool = True,
                 params: Sequence[torch.Tensor] | None = None, carry: bool = False) -> None:
        self.carry = carry
        #: the other ranks' walls over this rank's: a carried wall is the mean over the ranks (1: alike)
        self.others_factor = 1.0
        if params is None:  # one small tensor: what a gradient sample hooks (the chooser never reads its values here)
            params = [torch.nn.Parameter(torch.zeros(4))]
        self.world_size, self.rank, self.step, self.device = world_size, 0, 0, torch.device("cpu")
        self.process_group = self.exchange_group = None
        self.names = [f"p{i}" for i in range(len(params))]
        self.params = list(params)
        self.network = NetworkState(network, pinned=pinned)
        # the real link observer (its schedule is the clock of auto's periodic look), over the fake's model
        self.link = LinkObserver(world_size=world_size)
        self.link.state = self.network
        numels = tuple(int(p.numel()) for p in params) or (1,)
        self.plan = SimpleNamespace(groups=[SimpleNamespace(gid=0, exact=False, numels=numels,
                                                            param_ids=list(range(len(params))), names=tuple(self.names))])
        self.config = SimpleNamespace(warmup_steps=1, seed=0, min_compress_numel=0)
        self.calls: list = []
        self.sung: list = []
        self.dense_mode: str | None = None
        self.last_step = None
        self.carried: float | None = None
        self.dense_carry = False
        self.plan_sends_every_param = True
        self.keeps_network_model = True
        self.error_feedback, self.gain_ewma = True, None
        self.compressor = self.exchange = self.exact_exchange = None  # never read by the chooser

    # MethodControl
    def step_is_dense(self) -> bool:
        return self.dense_mode is not None

    def set_dense_mode(self, mode: str | None) -> None:
        self.calls.append(("dense", mode))
        self.dense_mode = mode

    def set_group_method(self, gid: int, spec) -> None:
        self.calls.append(("slot", spec.compressor))

    def adopt_network(self, model: NetworkModel) -> None:
        self.network.model = model

    def carry_wall(self, wall_s: float) -> None:
        self.carried = wall_s

    def enable_dense_carry(self) -> None:
        self.dense_carry = True

    def count_local_step(self) -> None:
        """A step that reached no hook (DiLoCo's inner step under auto_diloco): the counter moves on."""
        self.step += 1

    def run_before_step(self, job) -> None:
        """A job before the step about to run (GCEngine runs it on its worker; auto's link canary): recorded,
        with the value it carries."""
        self.sung.append((self.step, job.carry))

    def raise_warmup_steps(self, steps: int) -> None:
        pass

    def shorten_warmup_steps(self, steps: int) -> None:
        self.config.warmup_steps = min(self.config.warmup_steps, steps)

    def synchronize(self) -> None:
        pass

    def set_ratio(self, ratio: float) -> None:
        pass

    def set_group_observer(self, observer) -> None:
        pass

    def add_deferred_traffic(self, bytes_sent: int, bytes_payload: int, bytes_inter_node: int = 0) -> None:
        pass

    def report_nonfinite(self) -> None:
        pass

    def error_memory_by_name(self) -> dict:
        return {}


def step_end(chooser: AutoChooser, step: int, wall: float, clock: Clock, exchange_s: float | None = None) -> None:
    """Step ``step`` ends after ``wall`` seconds: the engine's stats of the step (the wall carried from the
    step before, see :class:`FakeEngine`; a compressed step's agreed exchange time ``exchange_s``), then the
    chooser's ``after_optimizer_step``."""
    engine = chooser.engine
    dense = engine.step_is_dense()
    carried = engine.carried if engine.carry and (not dense or engine.dense_carry) else None
    if carried is not None:  # the mean over the ranks: this rank's wall and the others' (others_factor)
        carried *= (1 + (engine.world_size - 1) * engine.others_factor) / engine.world_size
    engine.last_step = SimpleNamespace(step=step, dense=dense, dense_stopped=False, carried_wall_mean_s=carried,
                                       exchange_comm_mean_s=None if dense else exchange_s,
                                       exchange_comm_mean_step=None)
    engine.carried = None
    engine.step = step + 1
    clock.now += wall
    chooser.after_optimizer_step()


def walls(chooser: AutoChooser, by_step: dict, clock: Clock) -> None:
    """Step ends with these walls (``{step: wall}`` or ``{step: (wall, exchange_s)}``)."""
    for s, w in by_step.items():
        wall, x = w if isinstance(w, tuple) else (w, None)
        step_end(chooser, s, wall, clock, x)


def window(chooser: AutoChooser, step: int, wall: float, clock: Clock) -> None:
    """One drift window ending at ``step`` whose every step took ``wall``."""
    n = chooser.config.window
    for s in range(step - n + 1, step + 1):
        step_end(chooser, s, wall, clock)


def warm_state(config: AutoConfig, workload: Workload, costs: Sequence[MethodCost], network: NetworkModel,
               world_size: int = 4, dense_wall_s: float | None = None, time_codec=None,
               last_gain_step: int | None = None) -> dict:
    """The state a chooser checkpoints right after its warm-up decision at step 0 on a pinned
    ``network`` (no probe), with ``costs`` as measured; ``dense_wall_s``: the profiled DDP step (it
    fits ``other_s`` and makes ``ddp`` measured)."""
    wl, corrections, correction_beta = workload, {}, {}
    ddp = next(c for c in costs if c.name == "ddp")
    if dense_wall_s is not None:
        wl = replace(wl, other_s=calibrate_other(dense_wall_s, wl, ddp, network, world_size))
        corrections, correction_beta = {"ddp": 0.0}, {"ddp": network.beta_s_per_byte}
    d = policy.decide(DecisionInputs(Trigger.WARMUP, tuple(costs), wl, network, world_size, config, dict(corrections),
                                     (), 0.0, None, config.explore),
                      time_codec or (lambda name: (_ for _ in ()).throw(AssertionError(f"timed {name}"))))
    looked = dense_wall_s is not None
    entry = {"step": 0, "trigger": "warmup", "chosen": d.chosen, "previous": None,
             "network": [network.alpha_s, network.beta_s_per_byte], "probe_bytes": 0, "beta_scale": 1.0,
             "link_check": None, "network_source": "pinned", "dense_exposed_s": None, "workload": wl.as_dict(),
             "costs": [c.as_dict() for c in d.costs], "predictions": {k: p.as_dict() for k, p in d.predictions.items()},
             "dense_wall_s": dense_wall_s, "measured_step_s": None, "kept_reference": False,
             "corrections": dict(corrections), "settled": [], "shift_s": 0.0, "shift_from": [],
             "explore_left": d.explore_left, "link_interval": config.probe_every, "timed_codecs": list(d.timed_codecs),
             "held_by_margin": d.held_by_margin, "running_figure_s": None, "drift_test": None, "switch_check": None}
    return {"version": 2, "chosen": d.chosen, "history": [entry], "workload": wl.as_dict(),
            "costs": [c.as_dict() for c in d.costs], "network": [network.alpha_s, network.beta_s_per_byte],
            "reference": None, "drifted": 0, "settling": True, "reference_exchange": None, "run_medians": [],
            "corrections": corrections, "explore_left": d.explore_left, "correction_beta": correction_beta,
            "last_decision_step": 0, "last_link_step": 0 if looked else None, "link_interval": config.probe_every,
            "gain_interval": config.gain_every, "last_gain_step": last_gain_step, "gain_checks": [], "beta_scale": 1.0,
            "sampling": False, "warmup_steps": 1, "probe_bytes": 0, "probe_time_s": 0.0, "probe_time_modelled": False}


def resume(chooser: AutoChooser, state: dict, clock: Clock, step: int | None = None) -> None:
    """Load ``state`` and end its last decision's step (a resumed step has no wall), so that the next
    step's wall counts; the engine runs the mode the state chose (as the engine's own checkpoint would)."""
    chooser.load_state_dict(state)
    engine = chooser.engine
    engine.dense_mode = candidate(chooser.chosen).dense_mode
    at = state["last_decision_step"] if step is None else step
    step_end(chooser, at, 0.0, clock)


def resume_after_warmup(clock: Clock, config: AutoConfig, workload: Workload, costs: Sequence[MethodCost],
                        network: NetworkModel, world_size: int = 4, dense_wall_s: float | None = None,
                        engine: FakeEngine | None = None, carry: bool = False, time_codec=None,
                        last_gain_step: int | None = None) -> tuple[AutoChooser, FakeEngine]:
    """A chooser resumed right after its warm-up decision (:func:`warm_state`), at the end of step 0."""
    engine = engine or FakeEngine(network, world_size, carry=carry)
    chooser = AutoChooser(engine, config, torch.nn.Linear(1, 1), list(zip(engine.names, engine.params)))
    resume(chooser, warm_state(config, workload, costs, network, world_size, dense_wall_s, time_codec,
                               last_gain_step), clock)
    engine.calls.clear()
    return chooser, engine


def model_inputs(chooser: AutoChooser) -> tuple[dict[str, float], list[str], float]:
    """The valid corrections, the methods settled on this link and the compute shift the chooser's next
    decision uses, from its public state and the policy's public rules."""
    st = chooser.state_dict()
    net = chooser.engine.network.model if chooser.engine.network.pinned else chooser.network
    valid = policy.valid_corrections(st["corrections"], st["correction_beta"], net)
    windowed = policy.windowed(chooser.history)
    settled = sorted(windowed & set(valid))
    dense = {c for c in chooser.config.candidates if candidate(c).compressor is None}
    basis = policy.shift_basis(windowed, settled, st["corrections"], dense)
    shift = compute_shift([st["corrections"][m] for m in basis]) if chooser.config.compute_shift else 0.0
    return valid, settled, shift


def redecide(chooser: AutoChooser, trigger: Trigger, costs: Sequence[MethodCost] | None = None,
             network: NetworkModel | None = None, corrections: dict[str, float] | None = None) -> policy.Decision:
    """The decision the policy makes for ``trigger`` on the chooser's state now (``costs``, ``network``,
    ``corrections``: what a re-measurement, a probe or newer windows would have found instead)."""
    valid, settled, shift = model_inputs(chooser)
    valid = {**valid, **(corrections or {})}
    st = chooser.state_dict()
    net = network or chooser.engine.network.model
    return policy.decide(DecisionInputs(trigger, tuple(costs or chooser.costs), chooser.workload, net,
                                        chooser.engine.world_size, chooser.config, valid, tuple(settled), shift,
                                        chooser.chosen, st["explore_left"], None, chooser.in_family_trial,
                                        chooser.history[-1].get("previous")),
                         lambda name: (_ for _ in ()).throw(AssertionError(f"timed {name}")))


def resumed_with(chooser: AutoChooser, clock: Clock, step: int | None = None, edit=None, **cfg) -> AutoChooser:
    """A new chooser on the same engine, resumed from ``chooser``'s checkpoint (changed by ``edit(state)``)
    with options ``cfg`` changed (e.g. a window long enough that only the every-step tests act)."""
    config = replace(chooser.config, **cfg)
    engine = chooser.engine
    state = copy.deepcopy(chooser.state_dict())  # before the new chooser subscribes to the engine's link schedule
    other = AutoChooser(engine, config, torch.nn.Linear(1, 1), list(zip(engine.names, engine.params)))
    if edit is not None:
        edit(state)
    resume(other, state, clock, step)
    return other


def sampling_at(chooser: AutoChooser, step: int, clock: Clock) -> bool:
    """Whether the chooser samples the gradients of the step after ``step`` (its errors' re-measurement is
    due), read from a copy resumed from its checkpoint and ended at ``step``."""
    probe = resumed_with(chooser, clock, step)
    return bool(probe.state_dict()["sampling"])
