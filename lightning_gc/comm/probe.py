"""In-band measurement of the alpha-beta network model, and when to repeat it.

The cost model (:mod:`lightning_gc.comm.cost_model`) is only as good as its ``alpha`` and ``beta``.
Data-sheet numbers are wrong for the path the gradients really take (software stack, NIC offloads,
shaping, other jobs on the link), so :func:`probe_network` measures them with the process group
the training uses:

1. **What is timed.** By default a *ring shift*: every rank sends ``B`` bytes to group rank
   ``r + 1`` and receives ``B`` bytes from ``r - 1``, all at once (``batch_isend_irecv``). In the
   alpha-beta model that is one message step, ``t = alpha + beta * B``, so the fitted intercept
   *is* ``alpha`` and the slope *is* ``beta``; no backend algorithm (which ``dist.all_reduce`` would
   choose for itself) has to be guessed. Alternatively ``collective="ring_allreduce"`` times
   :func:`~lightning_gc.comm.p2p_allreduce.ring_allreduce` on ``B`` bytes, whose model is
   ``2(N-1)*alpha + 2(N-1)/N*B*beta``; the fit is inverted through that formula.
2. **How.** For each message size ``warmup`` untimed runs, then ``repeats`` timed runs per size,
   interleaved across sizes so that a burst of load hits every size alike; the per-size median is
   kept, since a descheduled rank produces rare, huge outliers.
3. **Fit.** ``t = a + b * bytes`` by least squares. The default weighting is *relative*
   (minimises the squared relative error): timing noise grows with the time itself, and with
   uniform weights a jitter of a few percent on the largest size would swamp the latency seen by
   the smallest. Use ``weighting="uniform"`` for plain ordinary least squares.
4. **Clamp.** A non-physical fit is clamped, and the result says so (``clamped``):
   a negative intercept (latency below timer resolution) becomes ``a = 0`` with the slope refit
   through the origin (``b = sum(x*t) / sum(x*x)``); a negative slope (sizes too small to see
   bandwidth) becomes ``b = 0`` with ``a = mean(t)`` (weighted). Both cannot happen at once for
   positive times, since the fitted line passes through the weighted mean point.
5. **Agree.** Each rank fits its own timings, then an element-wise ``all_reduce(MAX)`` of
   ``(alpha, beta)`` makes the result identical everywhere (the two maxima may come from different
   ranks: a conservative envelope). MAX rather than rank 0's view because a synchronous collective
   advances at the pace of its slowest link: the most pessimistic rank is the one that predicts it.
   Before any timing, the call's arguments are fingerprinted and compared across ranks (one small
   all-reduce), so a rank called with different sizes fails fast instead of hanging.

How to tune: the sizes should span latency-dominated (``alpha >> beta * B``) to bandwidth-dominated
(``beta * B >> alpha``) messages; on a 1-10 Gbit/s link with ~100 us latency, 64 B .. 4 MiB does.
More ``repeats`` make the medians robust against more outliers, at linear cost; on a
shared or oversubscribed host use 15 or more (the default). A probe costs roughly
``(warmup + repeats) * sum(t(B))``. Re-probe with :class:`ProbePolicy` (the engine and its collaborators share one schedule built on
it: :class:`lightning_gc.comm.link.LinkObserver`), or skip probing altogether with :class:`PinnedNetwork`.

Note that on loopback or veth pairs there is no wire: the measured ``alpha`` is the software
stack's latency (tens of microseconds with gloo), not a network's.
"""

from __future__ import annotations

import math
import statistics
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist

from lightning_gc.comm.cost_model import NetworkModel
from lightning_gc.comm.p2p_allreduce import ring_allreduce

__all__ = [
    "ProbeCollective",
    "ProbeConfig",
    "LinearFit",
    "ProbeResult",
    "PinnedNetwork",
    "ProbePolicy",
    "fit_latency_bandwidth",
    "network_from_fit",
    "probe_network",
    "ensure_replicated",
]

ProbeCollective = Literal["ring_shift", "ring_allreduce"]
Weighting = Literal["relative", "uniform"]


# --------------------------------------------------------------------------------------------
# configuration
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ProbeConfig:
    """How :func:`probe_network` measures.

    Args:
        sizes_bytes: message sizes to time, at least two distinct, each ``>= 1``. Span
            latency-dominated to bandwidth-dominated sizes (see the module docstring).
        warmup: untimed runs per size (connection setup, allocator, caches), ``>= 0``.
        repeats: timed runs per size, ``>= 1``; the median is used. Odd values give a true median;
            the median survives up to ``(repeats - 1) // 2`` outliers per size.
        collective: ``"ring_shift"`` (one message step; fit = alpha, beta directly) or
            ``"ring_allreduce"`` (the P2P ring allreduce; inverted through the Ring-AR formula).
        weighting: ``"relative"`` (default) or ``"uniform"`` least squares.
    """

    sizes_bytes: tuple[int, ...] = (64, 16 * 1024, 256 * 1024, 4 * 1024 * 1024)
    warmup: int = 3
    repeats: int = 15
    collective: ProbeCollective = "ring_shift"
    weighting: Weighting = "relative"

    def __post_init__(self) -> None:
        sizes = tuple(self.sizes_bytes)
        if any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
            raise ValueError(
                f"sizes_bytes={self.sizes_bytes!r} must be integers >= 1 (bytes per message); "
                "pass e.g. (64, 16384, 262144, 4194304)"
            )
        if len(set(sizes)) < 2:
            raise ValueError(
                f"sizes_bytes={self.sizes_bytes!r} has fewer than two distinct sizes, so a line "
                "t = alpha + beta*bytes cannot be fitted; pass at least one small and one large size"
            )
        object.__setattr__(self, "sizes_bytes", sizes)
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"warmup={self.warmup!r} must be an integer >= 0; pass e.g. 2")
        if isinstance(self.repeats, bool) or not isinstance(self.repeats, int) or self.repeats < 1:
            raise ValueError(f"repeats={self.repeats!r} must be an integer >= 1; pass e.g. 5")
        if self.collective not in ("ring_shift", "ring_allreduce"):
            raise ValueError(
                f"collective={self.collective!r} is not a probe collective with a known cost formula; "
                "pass 'ring_shift' or 'ring_allreduce'"
            )
        if self.weighting not in ("relative", "uniform"):
            raise ValueError(f"weighting={self.weighting!r} is unknown; pass 'relative' or 'uniform'")

    def fingerprint(self) -> int:
        """A process-independent 31-bit hash of the settings (Python's ``hash`` is salted per process)."""
        text = repr((self.sizes_bytes, self.warmup, self.repeats, self.collective, self.weighting))
        return zlib.crc32(text.encode()) & 0x7FFFFFFF


@dataclass(frozen=True)
class PinnedNetwork:
    """User-pinned ``alpha``/``beta``: no probing, no communication.

    Use it when the network is known and stable (a benchmark with shaped bandwidth, a dedicated
    cluster), or to make runs reproducible. All ranks must pin the same values -- pass them through
    the same config; :func:`ensure_replicated` checks it with one all-reduce.

    Args:
        alpha_s: seconds per message, ``>= 0``.
        beta_s_per_byte: seconds per byte, ``>= 0`` (``8 / bits_per_s``).
    """

    alpha_s: float
    beta_s_per_byte: float

    def __post_init__(self) -> None:
        NetworkModel(self.alpha_s, self.beta_s_per_byte)  # same validation and messages

    @classmethod
    def from_bandwidth(cls, bits_per_s: float, latency_s: float) -> PinnedNetwork:
        m = NetworkModel.from_bandwidth(bits_per_s, latency_s)
        return cls(m.alpha_s, m.beta_s_per_byte)

    @property
    def network(self) -> NetworkModel:
        return NetworkModel(self.alpha_s, self.beta_s_per_byte)


# --------------------------------------------------------------------------------------------
# fit
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LinearFit:
    """``t = intercept_s + slope_s_per_byte * bytes``, after clamping.

    ``clamped`` is ``None`` for a physical fit, ``"intercept"`` if a negative intercept was set to 0
    (slope refit through the origin), ``"slope"`` if a negative slope was set to 0 (intercept = mean).
    """

    intercept_s: float
    slope_s_per_byte: float
    clamped: Literal["intercept", "slope"] | None = None


def fit_latency_bandwidth(
    sizes_bytes: Sequence[float], times_s: Sequence[float], weighting: Weighting = "relative"
) -> LinearFit:
    """Least-squares fit of ``t = a + b * bytes`` with the clamping rule of the module docstring.

    ``weighting="relative"`` weights each point by ``1/t**2`` (minimises relative error);
    ``"uniform"`` is ordinary least squares. Computed in float64 with plain Python.
    """
    xs = [float(x) for x in sizes_bytes]
    ts = [float(t) for t in times_s]
    if len(xs) != len(ts):
        raise ValueError(
            f"{len(xs)} sizes but {len(ts)} times; pass one median time per message size"
        )
    if len(set(xs)) < 2:
        raise ValueError(
            f"sizes_bytes={list(sizes_bytes)!r} has fewer than two distinct sizes; a line cannot be "
            "fitted, pass at least one small and one large size"
        )
    bad = [t for t in ts if not math.isfinite(t) or t <= 0]
    if bad:
        raise ValueError(
            f"times_s contains {bad!r}: timings must be finite and > 0 seconds; check the timer and "
            "that every size was actually timed"
        )
    if weighting == "relative":
        ws = [1.0 / (t * t) for t in ts]
    elif weighting == "uniform":
        ws = [1.0] * len(ts)
    else:
        raise ValueError(f"weighting={weighting!r} is unknown; pass 'relative' or 'uniform'")
    sw = sum(ws)
    xm = sum(w * x for w, x in zip(ws, xs)) / sw
    tm = sum(w * t for w, t in zip(ws, ts)) / sw
    sxx = sum(w * (x - xm) ** 2 for w, x in zip(ws, xs))
    sxt = sum(w * (x - xm) * (t - tm) for w, x, t in zip(ws, xs, ts))
    b = sxt / sxx
    a = tm - b * xm
    if a < 0:
        b0 = sum(w * x * t for w, x, t in zip(ws, xs, ts)) / sum(w * x * x for w, x in zip(ws, xs))
        return LinearFit(0.0, max(b0, 0.0), "intercept")
    if b < 0:
        return LinearFit(tm, 0.0, "slope")
    return LinearFit(a, b, None)


def network_from_fit(fit: LinearFit, collective: ProbeCollective, world_size: int) -> NetworkModel:
    """Invert the cost formula of the timed collective.

    * ``ring_shift``: ``t = alpha + beta*B`` -> ``alpha = a``, ``beta = b``.
    * ``ring_allreduce``: ``t = 2(N-1)*alpha + 2(N-1)/N*B*beta`` ->
      ``alpha = a / (2(N-1))``, ``beta = b * N / (2(N-1))``.
    """
    if world_size < 2:
        raise ValueError(
            f"world_size={world_size!r}: a probe needs at least 2 ranks to time anything; with one "
            "rank nothing is communicated (every cost is 0), so do not probe"
        )
    if collective == "ring_shift":
        return NetworkModel(fit.intercept_s, fit.slope_s_per_byte)
    if collective == "ring_allreduce":
        k = 2 * (world_size - 1)
        return NetworkModel(fit.intercept_s / k, fit.slope_s_per_byte * world_size / k)
    raise ValueError(f"collective={collective!r} is unknown; pass 'ring_shift' or 'ring_allreduce'")


# --------------------------------------------------------------------------------------------
# probe
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ProbeResult:
    """Outcome of :func:`probe_network`.

    ``network`` is identical on all ranks (agreed by MAX). ``local_fit`` and ``median_times_s`` are
    this rank's own measurements (they differ across ranks; never base a communication decision
    on them). ``world_size == 1`` means nothing was measured and ``network`` is ``(0, 0)``, which
    is exact because every cost is 0 with one rank.
    """

    network: NetworkModel
    collective: ProbeCollective
    world_size: int
    sizes_bytes: tuple[int, ...]
    median_times_s: tuple[float, ...]
    local_fit: LinearFit | None
    #: this rank's fastest timed run per size: a latency estimate that scheduling noise on a busy host
    #: (which only ever adds time) does not inflate unless it hits every repeat
    min_times_s: tuple[float, ...] = ()


def _default_device(group: dist.ProcessGroup | None) -> torch.device:
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _probe_device(group: dist.ProcessGroup | None, device: torch.device | str | None) -> torch.device:
    """Where the probe's messages live: ``device`` (default: :func:`_default_device`), except CUDA on a
    backend other than NCCL, where they live in host memory. gloo has no point-to-point path for CUDA
    tensors (a ring shift of CUDA tensors failed with "writev ... Bad address" on an H200, docs/gpu.md),
    and for its collectives it copies CUDA tensors through host memory anyway, so host buffers measure
    the same link."""
    dev = torch.device(device) if device is not None else _default_device(group)
    if dev.type == "cuda" and "nccl" not in str(dist.get_backend(group)).lower():
        return torch.device("cpu")
    return dev


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _check_same_args(fingerprint: int, group: dist.ProcessGroup | None, device: torch.device) -> None:
    t = torch.tensor([fingerprint, -fingerprint], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    if int(t[0]) != fingerprint or int(-t[1]) != fingerprint:
        raise ValueError(
            f"probe_network was called with different arguments on different ranks (this rank's "
            f"fingerprint {fingerprint}, max {int(t[0])}, min {int(-t[1])}); it is a collective: "
            "call it on every rank with the same ProbeConfig"
        )


def probe_network(
    group: dist.ProcessGroup | None = None,
    config: ProbeConfig | None = None,
    device: torch.device | str | None = None,
) -> ProbeResult:
    """Measure ``alpha`` and ``beta`` over ``group``; a collective every rank must call identically.

    Args:
        group: process group to probe (default: the world group).
        config: sizes, repeats and collective; see :class:`ProbeConfig`.
        device: where the message buffers live. Default: the current CUDA device for NCCL, CPU
            otherwise.

    Returns:
        A :class:`ProbeResult` whose ``network`` is identical on every rank of ``group``.
    """
    config = config or ProbeConfig()
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "probe_network: torch.distributed is not initialized; call init_process_group first, "
            "or use PinnedNetwork when running on one process"
        )
    if dist.get_rank(group) < 0:
        raise ValueError(
            f"probe_network: this process (global rank {dist.get_rank()}) is not a member of "
            f"group={group!r}; call the probe only on ranks that belong to the group"
        )
    n = dist.get_world_size(group)
    dev = _probe_device(group, device)
    if n == 1:
        return ProbeResult(NetworkModel(0.0, 0.0), config.collective, 1, config.sizes_bytes, (), None)
    _check_same_args(config.fingerprint(), group, dev)

    rank = dist.get_rank(group)

    def glob(r: int) -> int:
        return dist.get_global_rank(group, r) if group is not None else r

    right, left = glob((rank + 1) % n), glob((rank - 1) % n)

    runners: list[Callable[[], None]] = []
    sizes: list[int] = []
    for nbytes in config.sizes_bytes:
        if config.collective == "ring_shift":
            send = torch.ones(nbytes, dtype=torch.uint8, device=dev)
            recv = torch.empty(nbytes, dtype=torch.uint8, device=dev)

            def shift(send: torch.Tensor = send, recv: torch.Tensor = recv) -> None:
                ops = [dist.P2POp(dist.isend, send, right, group), dist.P2POp(dist.irecv, recv, left, group)]
                for w in dist.batch_isend_irecv(ops):
                    w.wait()

            runners.append(shift)
            sizes.append(nbytes)
        else:
            numel = max(1, -(-nbytes // 4))
            buf = torch.zeros(numel, dtype=torch.float32, device=dev)

            def allreduce(buf: torch.Tensor = buf) -> None:
                ring_allreduce(buf, group)

            runners.append(allreduce)
            sizes.append(numel * 4)

    for run in runners:
        for _ in range(config.warmup):
            run()
    _sync(dev)
    # Sizes are interleaved (one run of every size per repeat) so that a burst of load on the
    # host lands on all sizes alike instead of inflating one size's median and tilting the fit.
    samples: list[list[float]] = [[] for _ in runners]
    for _ in range(config.repeats):
        for i, run in enumerate(runners):
            t0 = time.perf_counter()
            run()
            _sync(dev)
            samples[i].append(time.perf_counter() - t0)
    medians = [max(statistics.median(ts), 1e-9) for ts in samples]

    fit = fit_latency_bandwidth(sizes, medians, config.weighting)
    local = network_from_fit(fit, config.collective, n)
    agreed = torch.tensor([local.alpha_s, local.beta_s_per_byte], dtype=torch.float64, device=dev)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
    network = NetworkModel(float(agreed[0]), float(agreed[1]))
    mins = tuple(max(min(ts), 1e-9) for ts in samples)
    return ProbeResult(network, config.collective, n, tuple(sizes), tuple(medians), fit, mins)


def ensure_replicated(network: NetworkModel, group: dist.ProcessGroup | None = None) -> None:
    """Raise on every rank if ``network`` differs across the ranks of ``group`` (one all-reduce).

    Use it on pinned values, or on anything derived outside :func:`probe_network`, before a
    communication decision is made from them. A no-op without an initialised process group.
    """
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    dev = _default_device(group)
    v = torch.tensor(
        [network.alpha_s, network.beta_s_per_byte, -network.alpha_s, -network.beta_s_per_byte],
        dtype=torch.float64,
        device=dev,
    )
    dist.all_reduce(v, op=dist.ReduceOp.MAX, group=group)
    hi = (float(v[0]), float(v[1]))
    lo = (-float(v[2]), -float(v[3]))
    if hi != lo:
        raise ValueError(
            f"network model differs across ranks: alpha in [{lo[0]}, {hi[0]}] s, beta in "
            f"[{lo[1]}, {hi[1]}] s/byte; every rank must use the same values (pin them through the "
            "same config, or probe with probe_network, which agrees by MAX)"
        )


# --------------------------------------------------------------------------------------------
# policy
# --------------------------------------------------------------------------------------------
@dataclass
class ProbePolicy:
    """When to re-probe the network: periodically, and when the model stops predicting reality.

    Args:
        refresh_every: re-probe every this many optimizer steps since the last probe; ``0`` turns
            the periodic refresh off. Networks shared with other jobs drift over minutes: a few
            hundred to a few thousand steps is typical.
        drift_threshold: relative error ``|measured - predicted| / predicted`` above which a step
            counts as drifted, e.g. ``0.5`` for 50%. Too small and normal jitter triggers probes.
        drift_patience: re-probe after this many *consecutive* drifted steps (``>= 1``); one slow
            step (a straggler, a checkpoint) should not trigger a probe.
        probe_at_start: the first :meth:`update` returns True (no measurement yet). Set False when
            the network was pinned or probed at setup; the periodic refresh then counts from step 0.

    **Replicated inputs only.** :meth:`update` changes communication (a probe is a collective), so
    every rank must reach the same decision: pass values that are already identical across ranks,
    e.g. the measured communication time all-reduced with MAX, and the model prediction from an
    agreed :class:`NetworkModel`. The policy's state is a pure function of those inputs, so it
    stays replicated too. ``measured_s=None`` (no measurement this step) leaves the drift counter
    unchanged.
    """

    refresh_every: int = 1000
    drift_threshold: float = 0.5
    drift_patience: int = 5
    probe_at_start: bool = True
    last_probe_step: int | None = field(default=None, init=False)
    consecutive_drift: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if isinstance(self.refresh_every, bool) or not isinstance(self.refresh_every, int) or self.refresh_every < 0:
            raise ValueError(
                f"refresh_every={self.refresh_every!r} must be an integer >= 0 (optimizer steps; "
                "0 disables the periodic refresh); pass e.g. 1000"
            )
        if not isinstance(self.drift_threshold, (int, float)) or not (
            math.isfinite(self.drift_threshold) and self.drift_threshold > 0
        ):
            raise ValueError(
                f"drift_threshold={self.drift_threshold!r} must be a finite fraction > 0 (0.5 = 50% "
                "relative error); pass e.g. 0.5"
            )
        if isinstance(self.drift_patience, bool) or not isinstance(self.drift_patience, int) or self.drift_patience < 1:
            raise ValueError(
                f"drift_patience={self.drift_patience!r} must be an integer >= 1 (consecutive drifted "
                "steps before re-probing); pass e.g. 5"
            )

    @staticmethod
    def relative_drift(measured_s: float, predicted_s: float) -> float:
        """``|measured - predicted| / predicted``; ``inf`` if the model predicts 0 and time was measured."""
        if predicted_s == 0:
            return 0.0 if measured_s == 0 else math.inf
        return abs(measured_s - predicted_s) / predicted_s

    def update(self, step: int, measured_s: float | None = None, predicted_s: float | None = None) -> bool:
        """Record one optimizer step and say whether to probe now (all inputs replicated).

        Returns True when (a) no probe happened yet and ``probe_at_start``, (b) ``refresh_every``
        steps passed since the last probe, or (c) the drift counter reached ``drift_patience``.
        A True answer is taken as "the caller probes at this step": the counter resets and
        ``last_probe_step`` becomes ``step``. The same as :meth:`observe`, then :meth:`due`, then
        :meth:`probed` when due.
        """
        _check_step(step)
        self.observe(measured_s, predicted_s)
        probe = self.due(step)
        if probe:
            self.probed(step)
        return probe

    def observe(self, measured_s: float | None = None, predicted_s: float | None = None) -> None:
        """Count one step's drift: ``measured_s`` against ``predicted_s`` (both replicated), or
        nothing when ``measured_s`` is None (the counter is left as it is)."""
        if measured_s is None:
            return
        if predicted_s is None:
            raise ValueError(
                f"measured_s={measured_s!r} was given without predicted_s; pass the model's "
                "prediction for the same communication (or neither)"
            )
        for name, v in (("measured_s", measured_s), ("predicted_s", predicted_s)):
            if not math.isfinite(v) or v < 0:
                raise ValueError(
                    f"{name}={v!r} must be a finite number of seconds >= 0; skip the step "
                    "(pass None) when no valid timing exists"
                )
        if self.relative_drift(measured_s, predicted_s) > self.drift_threshold:
            self.consecutive_drift += 1
        else:
            self.consecutive_drift = 0

    def due(self, step: int) -> bool:
        """Whether a probe is due at ``step`` (reads the state, changes nothing)."""
        _check_step(step)
        if self.last_probe_step is None and self.probe_at_start:
            return True
        if self.consecutive_drift >= self.drift_patience:
            return True
        if not self.refresh_every:
            return False
        # Without a start probe the periodic refresh counts from step 0.
        since = step - (self.last_probe_step if self.last_probe_step is not None else 0)
        return since >= self.refresh_every

    def probed(self, step: int) -> None:
        """A probe was made at ``step``: the periodic refresh counts from it, the drift counter restarts."""
        _check_step(step)
        self.last_probe_step = step
        self.consecutive_drift = 0

    def state_dict(self) -> dict[str, Any]:
        return {"last_probe_step": self.last_probe_step, "consecutive_drift": self.consecutive_drift}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_probe_step = state["last_probe_step"]
        self.consecutive_drift = int(state["consecutive_drift"])


def _check_step(step: int) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step={step!r} must be an integer >= 0 (the optimizer step)")
