"""The one owner of "what is the link now": the alpha-beta model in force, how it is measured, and
when it is measured again.

Three pieces, from the purest up:

* **Sizing and comparison** (plain functions): the probe's message sizes grown to the link
  (:func:`probe_start_bytes`, :func:`next_probe_bytes`, :func:`probe_bandwidth`), the cheap link
  check that spares a full probe (:func:`check_bytes`, :func:`modelled_check_s`,
  :func:`link_unchanged`), the severe-drift tests on step times (:func:`factor_apart`,
  :func:`steps_apart`), and β from a step's exposed communication time (:func:`solve_beta`).
* **The schedule** (:class:`LinkSchedule`, pure): *when* to look again, from replicated values only
  (the optimizer-step counter and measurements already agreed across ranks), with the periodic,
  start and drift/patience rules of :class:`~lightning_gc.comm.probe.ProbePolicy`. Several clients
  may ask for their own interval; the schedule keeps one clock for all of them.
* **The observer** (:class:`LinkObserver`): holds the model in force (a
  :class:`~lightning_gc.comm.network.NetworkState`, pinned or measured), probes when asked or when
  due, and hands the agreed result to every reader. The engine owns one
  (``GCEngine.link``, declared by :class:`~lightning_gc.engine.ports.LinkPort`); the engine's
  tracker, ``AdaptiveRatio`` and OSP read and refresh it there instead of keeping probes of their own.

Why one owner: a probe is a collective. Two clients with clocks of their own probe twice for one
question, and each probe's messages queue behind the other's on a slow link. One clock, one
measurement, read by all.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .cost_model import NetworkModel
from .direct import allreduce_chosen
from .network import NetworkState
from .probe import ProbeConfig, ProbePolicy, ProbeResult, probe_network

# --------------------------------------------------------------------------------------------
# probe sizing and link checks
# --------------------------------------------------------------------------------------------
#: the latency round of a probe sized to the link: small messages alone, timed first (a small message
#: timed after a large one waits behind the large one's bytes in a shaper's queue). The fastest of the
#: timed runs is the latency: raise ``repeats`` on an oversubscribed host, lower it where probes are frequent
PROBE_LATENCY = ProbeConfig(sizes_bytes=(64, 256), warmup=1, repeats=7)
#: the bandwidth probe's large message starts at this size (or half the model's gradient, if smaller:
#: :func:`probe_start_bytes`); its small one is a quarter of it. Both stay above a shaper's token
#: bucket (a bucket's worth of bytes leaves at line rate), so the slope between them is the link's β
PROBE_START_BYTES = 256 * 1024
#: ... and the small one is never below this, or it would sit inside a token bucket and tilt the slope
#: towards a faster link. Raise it if your shapers' buckets are larger than 64 KiB
PROBE_SMALL_MIN_BYTES = 80 * 1024


def probe_small_bytes(size: int) -> int:
    """The bandwidth probe's small message for a large one of ``size`` bytes (see above)."""
    return max(size // 4, PROBE_SMALL_MIN_BYTES)


#: the large message is grown until it takes at least a quarter of this (bandwidth-bound wherever α
#: is well under 5 ms), by the factor that would make it take this long
PROBE_TARGET_S = 0.02


#: the bandwidth probe's largest message, on any model
PROBE_MAX_BYTES = 1024 * 1024


def probe_start_bytes(model_bytes: int) -> int:
    """The bandwidth probe's first large message: :data:`PROBE_START_BYTES`, or half the model's fp32
    gradient if smaller (at least 128 KiB), so the first round is never several dense steps' worth of
    traffic on a slow link; on a fast link the probe grows it (:func:`next_probe_bytes`)."""
    return int(min(max(model_bytes // 2, 128 * 1024), PROBE_START_BYTES))


def next_probe_bytes(size: int, large_s: float, cap: int) -> int | None:
    """The next large-message size of the bandwidth probe, or ``None`` when ``size`` was enough.

    ``large_s``: the (agreed) median time of the ``size``-byte message. It was enough when it took at
    least ``PROBE_TARGET_S / 4`` (then ``size·β`` dominates α) or ``size`` is already ``cap``; else the
    probe grows it by ``PROBE_TARGET_S / large_s`` (so more than 4×), at most to ``cap``. Not always the
    cap: on a slow link the largest message costs seconds at every probe, for no better answer."""
    if size >= cap or large_s >= PROBE_TARGET_S / 4:
        return None
    grow = size * PROBE_TARGET_S / max(large_s, 1e-9)
    return int(min(cap, round(grow)))  # > 4x size: large_s < PROBE_TARGET_S / 4


def probe_bandwidth(measure: Callable[[int], tuple[float, float]], start: int) -> tuple[float, int, float]:
    """β (s/byte) from the slope between ``S/4``- and ``S``-byte messages, ``S`` grown from ``start``
    (:func:`probe_start_bytes`) by :func:`next_probe_bytes` up to :data:`PROBE_MAX_BYTES`; returns β,
    the last ``S`` and that ``S``-byte message's time (the reference of :func:`link_unchanged`).

    ``measure(S)`` returns that slope and the ``S``-byte message's time, both agreed across ranks (the
    loop's decisions must be identical on every rank)."""
    size = start
    while True:
        beta, large_s = measure(size)
        nxt = next_probe_bytes(size, large_s, PROBE_MAX_BYTES)
        if nxt is None:
            return beta, size, large_s
        size = nxt


def check_bytes(network: NetworkModel, start: int) -> int:
    """The link check's message size where no probe chose one (β from a dense step): what the bandwidth
    probe would have settled on for this network, ``start`` (:func:`probe_start_bytes`) grown until
    the message takes :data:`PROBE_TARGET_S` / 4, at most :data:`PROBE_MAX_BYTES`."""
    size = start
    beta = network.beta_s_per_byte
    if beta > 0 and network.alpha_s + size * beta < PROBE_TARGET_S / 4:
        size = min(PROBE_MAX_BYTES, max(size, math.ceil((PROBE_TARGET_S / 4 - network.alpha_s) / beta)))
    return size


def modelled_check_s(network: NetworkModel, size: int) -> float:
    """The link check's reference where no probe timed one (β from a dense step): the model's time
    for one ``size``-byte ring shift, ``α + size·β``, the relation the probe's two sizes fit
    (:func:`probe_bandwidth`). Not a timed message: on a link that just fell that message would be the
    slowest part of the decision; a misjudged reference costs one more check message."""
    return float(network.alpha_s) + int(size) * float(network.beta_s_per_byte)


def factor_apart(a: float, b: float, factor: float) -> bool:
    """Whether two positive times are ``factor`` or more apart, either way (a severe drift)."""
    return a > 0 and b > 0 and max(a / b, b / a) >= factor


def steps_apart(times: Sequence[float], reference: float, factor: float) -> bool:
    """The every-step severe test (``severe_steps``) on the last few step times: every one of them
    ``factor`` or more off ``reference`` the same way, or their median twice that far (a large fall is
    seen as soon as most steps show it). Not the median at ``factor``: two slow steps of three are
    scheduling noise often enough on a busy host."""
    if reference <= 0 or factor <= 0 or not times:
        return False
    slow, fast, med = min(times), max(times), statistics.median(times)
    return (slow >= factor * reference or fast * factor <= reference
            or med >= 2 * factor * reference or med * 2 * factor <= reference)


def link_unchanged(check_s: float, probe_s: float, factor: float) -> bool:
    """Whether a link check's message time ``check_s`` says the link is the one last probed, whose
    same-size message took ``probe_s``: within ``factor`` of it either way (``factor`` > 1).

    The check spares the full probe on a link that did not change. The changes that matter are large,
    so a coarse factor keeps one message's noise from forcing a probe; lower it to re-probe on smaller
    changes."""
    if probe_s <= 0 or check_s <= 0:
        return False
    return 1.0 / factor <= check_s / probe_s <= factor


# --------------------------------------------------------------------------------------------
# the probe sized to the link, and the link check (collectives)
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SizedProbe:
    """What :func:`probe_sized` measured, identical on every rank: the model, and the last large
    message's size and agreed time (the reference a later :func:`check_link` is compared with by
    :func:`link_unchanged`)."""

    network: NetworkModel
    probe_bytes: int
    probe_time_s: float


def agree_max(values: Sequence[float], group: Any, device: Any) -> list[float]:
    """Element-wise MAX over the ranks (one float64 all-reduce, on ``device`` when it is CUDA), as
    ``lightning_gc.engine.agreement.agree_values(..., "max")`` does it; the values themselves without a
    process group or on one rank."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return [float(v) for v in values]
    t = torch.tensor([float(v) for v in values], dtype=torch.float64)
    if device is not None and torch.device(device).type == "cuda":
        t = t.to(device)
    allreduce_chosen(t, group, op="max")
    return [float(x) for x in t.cpu().tolist()]


def probe_latency(group: Any, device: Any) -> ProbeResult:
    """The latency round (:data:`PROBE_LATENCY`), timed before any large message; ``min_times_s[0]``
    is this rank's fastest 64-byte shift (not agreed: :func:`probe_sized` agrees what it derives)."""
    return probe_network(group, PROBE_LATENCY, device=device)


def probe_sized(group: Any, device: Any, model_bytes: int, latency: ProbeResult | None = None) -> SizedProbe:
    """α from 64-byte ring shifts timed before any large message, β from the slope between two larger
    shifts, ``S/4`` and ``S`` bytes (each rank's medians, then the MAX), ``S`` grown from
    :func:`probe_start_bytes` of ``model_bytes`` until its message is bandwidth-bound
    (:func:`probe_bandwidth`). A collective: every rank calls it alike.

    Not one least-squares line over interleaved sizes: on token-bucket-shaped links a small message
    timed after a large one waits behind its bytes, and α comes out far too high. α is each rank's
    *fastest* 64-byte shift (scheduling noise only adds time), then the MAX. ``latency``: a latency
    round already run (:func:`probe_latency`), else one is run first. A :class:`LinkObserver` client
    measures with it through :func:`sized_measure`."""
    small = latency if latency is not None else probe_latency(group, device)
    rounds: list[int] = []

    def measure(size: int) -> tuple[float, float]:
        # a warm-up run in the first round only: a grown round reuses the connections it warmed
        cfg = ProbeConfig(sizes_bytes=(probe_small_bytes(size), size), warmup=0 if rounds else 1, repeats=3)
        large = probe_network(group, cfg, device=device)
        rounds.append(size)
        (s0, s1), (t0, t1) = large.sizes_bytes, large.median_times_s
        beta, t_large = agree_max([max((t1 - t0) / (s1 - s0), 0.0), t1], group, device)
        return beta, t_large

    beta, size, large_s = probe_bandwidth(measure, probe_start_bytes(model_bytes))
    alpha = max(small.min_times_s[0] - beta * small.sizes_bytes[0], 0.0)
    a = agree_max([alpha], group, device)[0]
    return SizedProbe(NetworkModel(a, beta), size, large_s)


def sized_measure(model_bytes: int) -> Callable[[Any, ProbeConfig, Any], NetworkModel]:
    """A :class:`LinkObserver` ``measure`` that probes with :func:`probe_sized` (the config is unused)."""

    def measure(group: Any, config: ProbeConfig, device: Any) -> NetworkModel:
        return probe_sized(group, device, model_bytes).network

    return measure


def check_link(group: Any, device: Any, size: int) -> tuple[float, float]:
    """The cheap link check: one ``size``-byte message after its small partner (the order
    :func:`probe_sized` times them in), once, on every rank. Returns that message's time (compare it
    with the probe's by :func:`link_unchanged`) and the slope between the two messages (β, as one
    round of the probe gives it), both agreed (MAX). About a quarter of a full probe's traffic."""
    small = probe_small_bytes(size)
    r = probe_network(group, ProbeConfig(sizes_bytes=(small, size), warmup=0, repeats=1), device=device)
    t0, t1 = r.median_times_s
    slope = max((t1 - t0) / (size - small), 0.0) if size > small else 0.0
    t1, slope = agree_max([t1, slope], group, device)
    return t1, slope


# --------------------------------------------------------------------------------------------
# β from a step's exposed communication time
# --------------------------------------------------------------------------------------------
def solve_beta(step_s: Callable[[NetworkModel], float], measured_s: float, latency_s: float,
               latency_bytes: int = 0) -> float | None:
    """The β (s/byte) at which a modelled step, ``step_s(NetworkModel(α, β))``, equals ``measured_s``;
    ``None`` when no β does (the step is shorter than the model gives at the fastest link).

    α is ``latency_s − latency_bytes·β`` (a small message's measured time), at least 0, so the two
    are solved together. ``step_s`` must not decrease with β (more time per byte never shortens a
    step). Bisection on ``log β`` over ``[1e-13, 1e-3]`` s/byte (80 Tbit/s to 8 kbit/s), 100 rounds.

    A step that waited long on the network measures the link with its own bytes, at no extra cost
    (``lightning_gc.auto.model.beta_from_dense_step``); everything beyond compute is charged to the
    link, so β comes out slightly high by the step's framework time."""

    def step(beta: float) -> float:
        return step_s(NetworkModel(max(latency_s - latency_bytes * beta, 0.0), beta))

    lo, hi, measured = math.log(1e-13), math.log(1e-3), float(measured_s)
    if step(math.exp(lo)) >= measured:
        return None
    if step(math.exp(hi)) <= measured:
        return math.exp(hi)
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        if step(math.exp(mid)) > measured:
            hi = mid
        else:
            lo = mid
    return math.exp(0.5 * (lo + hi))


# --------------------------------------------------------------------------------------------
# when to look again
# --------------------------------------------------------------------------------------------
class LinkSchedule:
    """When to measure the link again: one clock for every client, from replicated values only.

    Each client subscribes with its own interval (:meth:`subscribe`). The rule is
    :class:`~lightning_gc.comm.probe.ProbePolicy`'s, with one clock shared by all clients:

    * **start**: due while nothing was probed yet, if any client asked for a start probe;
    * **every**: due when ``step − last probe ≥ every``, where ``every`` is the *smallest* positive
      interval any client asked for (``0`` = no periodic refresh for that client): one probe serves
      every client, and every client's clock restarts from it;
    * **drift**: due after ``drift_patience`` consecutive steps whose measured communication time was
      more than ``drift_threshold`` (relative) off the model's prediction (:meth:`observe`).

    Every probe, whoever asked for it, restarts the clock and the drift counter (:meth:`probed`).

    **Replicated inputs only.** :meth:`due` decides a collective (the probe): pass the optimizer-step
    counter and measurements agreed across ranks, and subscribe alike on every rank.
    """

    def __init__(self, drift_threshold: float = 0.5, drift_patience: int = 5) -> None:
        self._policy = ProbePolicy(0, drift_threshold, drift_patience, probe_at_start=False)
        self._clients: dict[str, tuple[int, bool]] = {}

    @property
    def clients(self) -> dict[str, tuple[int, bool]]:
        """Each client's ``(every, at_start)``."""
        return dict(self._clients)

    @property
    def every(self) -> int:
        """The interval in force: the smallest positive one asked for, or 0 (no periodic refresh)."""
        return self._policy.refresh_every

    @property
    def last_probe_step(self) -> int | None:
        return self._policy.last_probe_step

    @property
    def consecutive_drift(self) -> int:
        return self._policy.consecutive_drift

    def subscribe(self, client: str, every: int, at_start: bool = True) -> None:
        """Ask for a probe every ``every`` optimizer steps (0: never periodically) and, with
        ``at_start``, one before the first read. Subscribing again replaces the client's wish."""
        ProbePolicy(every)  # the same validation and message as the policy's refresh_every
        if not isinstance(at_start, bool):
            raise ValueError(f"at_start={at_start!r} must be True or False (probe before the first read).")
        self._clients[str(client)] = (every, at_start)
        self._rules()

    def unsubscribe(self, client: str) -> None:
        """Drop a client's wish (its interval no longer counts)."""
        self._clients.pop(str(client), None)
        self._rules()

    def _rules(self) -> None:
        intervals = [e for e, _ in self._clients.values() if e > 0]
        self._policy.refresh_every = min(intervals) if intervals else 0
        self._policy.probe_at_start = any(s for _, s in self._clients.values())

    def observe(self, measured_s: float | None = None, predicted_s: float | None = None) -> None:
        """Count one step's drift (agreed measured and predicted communication time; None: no
        measurement this step, the counter stays)."""
        self._policy.observe(measured_s, predicted_s)

    def due(self, step: int) -> bool:
        """Whether a probe is due at ``step`` for any client (changes nothing). False with no client."""
        return bool(self._clients) and self._policy.due(step)

    def probed(self, step: int) -> None:
        """A probe was made at ``step`` (for whichever client): the clock and the drift count restart."""
        self._policy.probed(step)

    def state_dict(self) -> dict[str, Any]:
        """The clock (the same keys as ``ProbePolicy.state_dict``); subscriptions come from configuration."""
        return self._policy.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._policy.load_state_dict(state)


# --------------------------------------------------------------------------------------------
# the observer
# --------------------------------------------------------------------------------------------
class LinkObserver:
    """The network model in force, its measurement and its schedule (see the module docstring).

    Args:
        model: a pinned model (with ``pinned=True``), or None until the first probe.
        pinned: the user fixed α and β: nothing is ever probed and :meth:`due` is always False.
        probe: the :class:`~lightning_gc.comm.probe.ProbeConfig` of a refresh that does not bring its own.
        drift_threshold, drift_patience: the drift rule of :class:`LinkSchedule`.
        world_size: ranks that share the link; with one there is nothing to measure (never due).
        measure: how a refresh measures: ``measure(group, config, device) -> NetworkModel`` agreed
            across ranks (default: :func:`~lightning_gc.comm.probe.probe_network`'s MAX-agreed model;
            :func:`sized_measure` for the probe sized to the link).
        publish: write measured models into :attr:`state`, which the engine's exchanges read (the
            engine publishes when its exchange chooses by the model); otherwise a measurement serves
            only the clients that asked for it (:attr:`model`).

    Reading: :attr:`model` (the model in force, or the clients' last measurement when not published).
    Refreshing: :meth:`refresh` probes now, :meth:`maybe_refresh` probes when :meth:`due`. Both are
    collectives: call them at the same point of the collective sequence on every rank, between steps
    or on the engine's ordered worker, never from a Future callback.
    """

    def __init__(self, model: NetworkModel | None = None, pinned: bool = False,
                 probe: ProbeConfig | None = None, drift_threshold: float = 0.5, drift_patience: int = 5,
                 world_size: int = 2, publish: bool = True,
                 measure: Callable[[Any, ProbeConfig, Any], NetworkModel] | None = None) -> None:
        if pinned and model is None:
            raise ValueError("LinkObserver(pinned=True) needs the pinned model: pass model=NetworkModel(alpha, beta).")
        self.state = NetworkState(model, pinned)
        self.schedule = LinkSchedule(drift_threshold, drift_patience)
        self.probe_config = probe if probe is not None else ProbeConfig()
        self.world_size = int(world_size)
        self.publish = bool(publish)
        self.measure = measure if measure is not None else _probe_model
        self._unpublished: NetworkModel | None = None
        #: every probe this observer made (published or not); ``state.probes`` counts the published ones
        self.probes = 0

    @property
    def model(self) -> NetworkModel | None:
        """The agreed model to read: the one in force (pinned, probed and published, or adopted), else
        the last unpublished measurement; None before any."""
        return self.state.model if self.state.model is not None else self._unpublished

    @property
    def pinned(self) -> bool:
        return self.state.pinned

    def subscribe(self, client: str, every: int, at_start: bool = True) -> None:
        """A client's interval (see :class:`LinkSchedule`); ignored for the clock when pinned."""
        self.schedule.subscribe(client, every, at_start)

    def unsubscribe(self, client: str) -> None:
        self.schedule.unsubscribe(client)

    def observe(self, measured_s: float | None = None, predicted_s: float | None = None) -> None:
        """Feed one step's agreed measured and predicted communication time to the drift rule."""
        self.schedule.observe(measured_s, predicted_s)

    def due(self, step: int) -> bool:
        """Whether a probe is due at ``step`` (never when pinned or on one rank)."""
        return not self.state.pinned and self.world_size > 1 and self.schedule.due(step)

    def refresh(self, step: int, group: Any, device: torch.device | str | None,
                config: ProbeConfig | None = None) -> float:
        """Probe now over ``group`` (a collective every rank calls alike), install the agreed model and
        restart the schedule's clock. Returns the seconds spent. ``config`` defaults to
        :attr:`probe_config`; a client with a reason for other sizes (a slow link where the default's
        largest message would take seconds) passes its own."""
        t0 = time.perf_counter()
        self._install(self.measure(group, config or self.probe_config, device))
        self.schedule.probed(step)
        self.probes += 1
        return time.perf_counter() - t0

    def maybe_refresh(self, step: int, group: Any, device: torch.device | str | None,
                      config: ProbeConfig | None = None) -> float:
        """:meth:`refresh` if :meth:`due`; returns the seconds spent (0.0 when not due)."""
        return self.refresh(step, group, device, config) if self.due(step) else 0.0

    def adopt(self, model: NetworkModel) -> None:
        """Put ``model`` (agreed across ranks by the caller, e.g. auto's sized probe) in force."""
        self.state.model = model

    def _install(self, model: NetworkModel) -> None:
        if self.publish:
            self.state.model = model
            self.state.probes += 1
        else:
            self._unpublished = model


def _probe_model(group: Any, config: ProbeConfig, device: Any) -> NetworkModel:
    return probe_network(group, config, device=device).network
