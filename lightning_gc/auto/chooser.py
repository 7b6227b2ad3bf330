"""``compressor="auto"``: choose, at run time, the method that reaches the target soonest.

A :class:`~lightning_gc.engine.session.StepParticipant` (name ``"auto"``) that the strategy adds
when ``compressor="auto"``. Its life, on every rank at the same step boundaries:

1. **Profile** (dense warm-up steps, which the engine runs anyway: DDP's own fp32 bucket path).
   For ``profile_steps`` steps after ``skip_steps`` it times forward, each gradient tensor's
   readiness in backward (post-accumulate-grad hooks), the optimizer step and the step's wall time
   (end of the previous step to the end of this one, as the bench counts it).
2. **Measure** (once, between steps): every candidate's codec cost, payload and error on the live
   averaged gradient (:func:`~lightning_gc.auto.candidates.measure_method`), and the network by an
   in-band probe. Every number is agreed across ranks (MAX for times, so the slowest rank counts,
   as it does in synchronous training).
3. **Decide** with :func:`~lightning_gc.auto.model.choose` (identical inputs on every rank → the
   same choice) and **apply**: a bucket mode with ``GCEngine.set_dense_mode``, an engine method with
   ``GCEngine.set_group_method`` on every compressed group (error memory follows the slot rule; a
   dense mode flushes it into its next step).
4. **Watch**: the median step of every ``window`` steps (agreed, MAX) is compared with a reference:
   the second window after the decision (the first holds the switch itself). A drift of more than
   ``drift`` (relative) for ``patience`` windows in a row (one window if the step moved by
   ``severe_drift``× or more), at least ``min_interval`` steps after the
   last decision (a severe one: after the last severe one), re-probes the network and decides again from the stored compute and codec
   measurements (trigger ``"drift"``); the method is switched only if the choice changed (every
   re-decision is in the history either way). The ``severe_drift`` test is also made every step,
   on the last ``severe_steps`` agreed step walls (every one of them off, or their median twice as far;
   an all-reduce issued at each
   step's end and read at the next: ``_check_severe_steps``), so that a link that fell is seen
   within a few steps rather than at the end of the window it fell in.
5. **Calibrate**: the first reference window of a method sets *that method's* correction
   (measured − predicted step), and the choice is made again at once (trigger ``"calibration"``,
   no probe) by :func:`~lightning_gc.auto.model.choose_measured`: measured methods with their
   corrections, unmeasured ones by the raw (optimistic) model. So a method whose real step the model
   misses (the engine's worker and agreements, Python per step, its own collective) is judged by
   what it did, and an unmeasured one that the model still favours is measured next, at most
   ``explore`` of them after each probed decision. Unmeasured ones are predicted by the raw model
   lowered by the least speed-up every measured method showed against it (``compute_shift``: the
   warm-up's profiled compute is slower than a settled step's, for every method alike), taken from
   the dense modes measured in a window (on any link) when there are any (``_shift_basis``). The dense
   warm-up measured ``ddp`` (``other`` is fitted to it), so ``ddp`` starts measured.
6. **Try the dense sibling**: the dense modes (``ddp``, ``fp16``, ``bf16``) run the same path on
   DDP's buckets and differ only in the bytes and the cast, so the first window of one of them also
   tells what the model misses for the others. A sibling not yet measured in a window on this link,
   whose raw prediction plus the measured one's correction lies within ``family_margin`` of the
   measured step (time per unit of progress), runs the next window (trigger ``"family"``), and the
   choice is then made among the measured methods, the mode the trial interrupted holding unless
   the sibling leads it by ``switch_margin`` (:meth:`AutoChooser._hold_or_switch`). Measured on
   ``gpt`` at 1 Gbit/s (4 ranks, 2 cores): auto picked ``fp16`` (136 ms) from a warm-up whose DDP
   step had taken 206 ms, while DDP ran 126 ms in steady state, so auto's step was 1.09x the
   faster of the two (docs/auto.md).

Everything a decision used is in :attr:`AutoChooser.history` (checkpointed, replicated) and logged
(see :mod:`lightning_gc.callbacks.monitor`, ``auto/*``); the end-of-fit summary names the choice.
"""

from __future__ import annotations

import copy
import logging
import math
import statistics
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor

from ..comm.cost_model import NetworkModel
from ..comm.direct import DIRECT_MAX_RANKS, backend_allows
from ..comm.probe import ProbeConfig, probe_network
from ..compressors import GroupContext
from ..engine import dense_stop
from ..engine.agreement import agree_values
from ..engine.dense_stop import LinkCanary
from ..engine.session import StepParticipant
from .candidates import (
    DEFAULT_CANDIDATES,
    AutoCandidate,
    candidate,
    measure_error,
    measure_method,
    squared_norm,
    time_method_codec,
)
from .model import (
    DEFAULT_PROGRESS_WEIGHT,
    MethodCost,
    Prediction,
    Workload,
    beta_from_dense_step,
    calibrate_beta,
    calibrate_other,
    choose_measured,
    compute_shift,
    efficiency,
    overhead_used,
    predict,
    table,
)

log = logging.getLogger(__name__)

#: the exchange test (``_check_severe_steps``) re-decides only on a change of the exchange time of at
#: least this share of the reference step: an exchange of a few hundred microseconds on a fast link
#: moves by 2x with the host's scheduling alone, and a change that small would not change the pick
EXCHANGE_SHARE = 0.1

#: the one-step test (``_check_severe_steps``, test ``step``): while a dense mode runs, one agreed step
#: this many times ``severe_drift`` slower than the reference re-decides at once (8x at the defaults),
#: unless that step's wall may hold time that is not a training step's (:meth:`AutoChooser.mark_wall`).
#: Why: a dense mode on a fallen link pays every step the whole exchange at the new rate (the
#: quickstart MLP: fp16 ~22 ms → 206-234 ms at 10 Mbit/s, DDP 17 → 406-466 ms; ``mlp``: ~60 ms → ~3 s),
#: and the test of the last ``severe_steps`` needed two such steps beside the one the read lags.
#: How safe: over 41 156 steps of static methods on steady links in the bench runs kept on the
#: development machine, none took 3x the median of the 5 before it (docs/auto-measurements.md)
ONE_STEP_FACTOR = 4.0

#: values of ``AutoConfig.time_codecs``
TIME_CODECS = ("on_demand", "upfront")
#: the tests of ``severe_drift`` as a decision's history records them (``drift_test``)
SEVERE_TESTS = ("severe_window", "steps", "step", "exchange", "reference_window")

#: the decisions made without a fresh look at the link (no probe, no dense step, no canary) that, moving from a
#: compressed method to a dense mode, first time the link with the canary's message (AutoChooser._switch_check)
SWITCH_CHECK_TRIGGERS = ("gain", "calibration")

#: the parts of a decision's own time its history records (``decide_parts_s``, slowest rank each): the
#: latency round, the bandwidth probe, the link check (both messages, a retimed one included) and the
#: codecs timed on demand (a link check's reference where β came from a dense step is modelled, not
#: timed: :func:`modelled_check_s`). Each is the slowest rank's, so they need not add up to ``decide_s`` (the slowest rank's
#: whole decision), which also holds the model, the agreements and the switch itself
DECIDE_PARTS = ("latency", "probe", "check", "codecs")

#: the fewest windows (the reference one included) whose median replaces the running method's figure
#: at a gain or periodic re-decision (AutoChooser._running_figure)
RUN_FIGURE_MIN_WINDOWS = 3

#: the chooser's network probes: latency from small messages alone, first (a large message leaves bytes
#: in the shaper's queue after its send completed, and a small one timed after it waits for them),
#: then bandwidth from two larger ones sized to the link (:func:`next_probe_bytes`)
#: one warm-up and 7 timed runs of each size (16 shifts; 2 + 9 before, 22): on 4 shaped namespaces, 12
#: rounds each at 1 Gbit/s and 20 Mbit/s, the fastest 64-byte shift read 0.22-0.60 ms against
#: 0.21-0.62 ms, in 24-32 ms per round against 39-44 ms; 1 + 5 read 2.3 ms once (docs/auto.md)
PROBE_LATENCY = ProbeConfig(sizes_bytes=(64, 256), warmup=1, repeats=7)
#: the bandwidth probe's large message starts at this size (or half the model's gradient, if smaller:
#: :func:`probe_start_bytes`); its small one is
#: a quarter of it. Both stay above a shaper's token bucket (64 KiB on the bench's links,
#: lightning_gc.bench.netns.tc_burst_bytes): a bucket's worth of bytes goes out at line rate, and the
#: slope between two messages that both exceed it is the link's β, unbiased
PROBE_START_BYTES = 256 * 1024
#: ... except that the small one is never below this: a quarter of a small model's first message (the
#: quickstart MLP's 168 kB gives 42 kB) would sit inside the 64 KiB bucket, leave at line rate, and
#: tilt the slope: on a simulated 20 Mbit/s shaped link that probe read 24.6 Mbit/s
#: (tests/test_auto_model.py). The start's floor (128 KiB) keeps the large one above it.
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
    gradient if smaller (at least 128 KiB), so that the first round is never several dense steps'
    worth of traffic on a slow link (a fixed 256 KiB + 1 MiB probe took 4.4 s at 20 Mbit/s on the
    84k-parameter quickstart MLP, whose dense step is 0.22 s). Where that message is too short to be
    bandwidth-bound (a fast link), the probe grows it up to :data:`PROBE_MAX_BYTES` whatever the
    model's size (:func:`next_probe_bytes`). Before, half the model's gradient also capped the growth:
    on the quickstart MLP at 1 Gbit/s the probe then timed 168 kB messages (1.2-4 ms, in scheduling
    noise on 4 ranks sharing 2 cores) and read the link at 205-14 000 Mbit/s in four runs; at 1 MiB,
    ten probes read 610-835 Mbit/s (docs/auto.md)."""
    return int(min(max(model_bytes // 2, 128 * 1024), PROBE_START_BYTES))


def next_probe_bytes(size: int, large_s: float, cap: int) -> int | None:
    """The next large-message size of the bandwidth probe, or ``None`` when ``size`` was enough.

    ``large_s``: the (agreed) median time of the ``size``-byte message. It was enough when it took at
    least ``PROBE_TARGET_S / 4`` (then ``size·β`` dominates α) or ``size`` is already ``cap``; else the
    probe grows it by ``PROBE_TARGET_S / large_s`` (so more than 4×), at most to ``cap``. Why not always
    the cap: on ``cnn`` or ``gpt`` at 20 Mbit/s a 1 MiB probe (with its 256 KiB partner, a warm-up
    and three timed runs) sends ~5 MiB per rank, about 2 s, at the first decision and at every
    periodic or drift re-probe; 256 KiB messages already take 0.1 s each there. On a fast link the
    first, small round costs a few milliseconds before the cap is measured, as before."""
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
    the message takes :data:`PROBE_TARGET_S` / 4, at most :data:`PROBE_MAX_BYTES`. Not the largest:
    on ``cnn`` width 16 at 20 Mbit/s a 1 MiB check with its 256 KiB partner took 0.52 s, where
    256 KiB (the probe's size there) takes 0.13 s."""
    size = start
    beta = network.beta_s_per_byte
    if beta > 0 and network.alpha_s + size * beta < PROBE_TARGET_S / 4:
        size = min(PROBE_MAX_BYTES, max(size, math.ceil((PROBE_TARGET_S / 4 - network.alpha_s) / beta)))
    return size


def modelled_check_s(network: NetworkModel, size: int) -> float:
    """The link check's reference where no probe timed one (β from a dense step, see
    :meth:`AutoChooser._decide`): the model's time for one ``size``-byte ring shift, ``α + size·β``,
    the relation the probe's two sizes fit (:func:`probe_bandwidth`).

    Why a model and not a timed message: the decision that measured β from a dense step does not
    need the message, and on a link that just fell it was the slowest part of that decision
    (0.27-0.37 s of 0.46 s on the quickstart MLP at 10 Mbit/s). How close: over 32 link checks of
    earlier bench runs at 10-20 Mbit/s (links that had not changed), the check's time was 0.68-1.66x
    this figure for its network (median 1.21x, 3 outside 1.5x), and 0.60-1.50x the timed reference it
    was compared with (median 1.02x, 2 outside) (docs/auto-measurements.md). A check outside
    ``probe_check`` of it is timed again and, where its message is bandwidth-bound (a slow link),
    sets β from its own slope, no full probe: a misjudged reference costs one more message."""
    return float(network.alpha_s) + int(size) * float(network.beta_s_per_byte)


def factor_apart(a: float, b: float, factor: float) -> bool:
    """Whether two positive times are ``factor`` or more apart, either way (a severe drift)."""
    return a > 0 and b > 0 and max(a / b, b / a) >= factor


def steps_apart(times: Sequence[float], reference: float, factor: float) -> bool:
    """The every-step severe test (``severe_steps``) on the last few step times: every one of them
    ``factor`` or more off ``reference`` the same way, or their median twice that far (a link that
    fell tenfold makes a dense step 10-20x longer: seen as soon as most of the steps are, without
    waiting for all of them). Not the median at ``factor`` alone: two slow steps of three are
    scheduling noise often enough on a busy host (see ``AutoConfig.severe_steps``)."""
    if reference <= 0 or factor <= 0 or not times:
        return False
    slow, fast, med = min(times), max(times), statistics.median(times)
    return (slow >= factor * reference or fast * factor <= reference
            or med >= 2 * factor * reference or med * 2 * factor <= reference)


def link_unchanged(check_s: float, probe_s: float, factor: float) -> bool:
    """Whether a link check's message time ``check_s`` says the link is the one last probed, whose
    same-size message took ``probe_s``: within ``factor`` of it either way (``factor`` > 1).

    The check exists to spare the full probe (latency, then two message sizes, each timed three times
    after a warm-up) at a periodic or drift re-decision on a link that did not change: on the quickstart
    MLP at 20 Mbit/s each full re-probe cost 0.47-0.52 s of a 6 s run to the target (docs/auto.md).
    The changes that matter are large (a correction is not carried over a 2x change of β, and a
    link that fell from 1 Gbit/s to 10 Mbit/s moves this time by more than 10x), so a coarse factor
    (1.5 by default) keeps one message's noise from forcing a probe."""
    if probe_s <= 0 or check_s <= 0:
        return False
    return 1.0 / factor <= check_s / probe_s <= factor


def _int(name: str, value: Any, lo: int, hint: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"auto_{name}={value!r} must be an integer >= {lo}. {hint}")


@dataclass(frozen=True)
class AutoConfig:
    """Options of ``compressor="auto"`` (flat names ``auto_<field>``; docs/auto.md).

    Attributes:
        candidates: methods to choose among, in tie-break order (``lightning_gc.auto.CANDIDATES``).
            ``ddp`` must be among them: the dense warm-up measures it, and it is the safe fallback.
        progress_weight: ``w`` of the progress proxy ``1/(1 + w·delta2)``; 0 ranks by step time only.
            2 by default (``model.DEFAULT_PROGRESS_WEIGHT``, fitted to steps to the target measured on
            the bench). Raise it if compressed picks need many more steps than they save, lower it
            if they converge as well as dense (docs/auto.md).
        skip_steps: dense steps not profiled first (allocator and thread warm-up).
        profile_steps: dense steps profiled; the engine's warm-up is raised to
            ``skip_steps + profile_steps``. One by default: on a slow link every dense step costs the
            full exchange (2.2 s on ``cnn`` width 16 at 20 Mbit/s, 4 ranks), and what one step gets
            wrong the per-method calibration corrects (docs/auto.md). Raise it for a steadier first
            decision on a fast link.
        repeats: timed runs per candidate when measuring codec costs (median).
        window: steps per drift window (median of the step walls). A drift is acted on after
            ``patience`` windows: with 10-step windows a 10 Mbit/s drop under the 16-bit hook's
            numerics cost 20 steps of 0.24 s before auto moved (quickstart MLP, 4 ranks).
        drift: relative change of a window's median step against the reference that counts as drift.
        patience: drifted windows in a row before re-deciding.
        severe_drift: a window whose median step is at least this many times the reference, or at
            most its inverse, re-decides at once, without waiting for ``patience`` or for
            ``min_interval`` after another kind of decision (only after the last severe one: see
            ``min_interval``); 0 turns it off. A link that fell tenfold makes the step of a dense mode
            several times longer, and every step spent waiting for a second window costs that much
            (on the quickstart MLP a 16-bit step at 10 Mbit/s is ~0.2 s against Top-k's ~0.05 s;
            docs/auto-measurements.md, "A changing link"). A median of ``window`` steps moves by 2x only if most
            of the window moved, so a single slow step (a validation, a pause) does not trigger it;
            a false trigger costs one probe and usually keeps the method.
        severe_steps: the same severe test, also made every step on the last this many steps: every
            one of them ``severe_drift`` off the same way, or their median twice that far
            (``steps_apart``) (each step's wall agreed across ranks by an all-reduce issued at its end and read
            at the next step's end, so the step never waits for it; the step right after a decision
            is left out). Compared with the reference, or, before the reference window, with the
            running method's prediction when that carries its own correction measured on this link
            (the test of a reference window, ``_link_moved_under``). 0: windows only. Why: a window
            check sees a fall only at the window's end, and with 5-step windows a dense mode ran 7
            steps of ~220 ms on a link fallen to 10 Mbit/s before auto moved (quickstart MLP), where
            Top-k runs ~37 ms; a fall that makes the step 4x or more is seen 2 steps after it (the
            median), a smaller one 3 steps after (every step), plus the one step the read lags; under
            a dense mode one step :data:`ONE_STEP_FACTOR` times ``severe_drift`` slower (8x) is
            enough (test ``step``; not an epoch's first step nor the step after a checkpoint, see
            :meth:`AutoChooser.mark_wall`); otherwise one slow step (a validation, a checkpoint)
            never sets it off, and two of three only beyond 4x. Until this version the test was the median of the 3 at 2x, which fired on any two
            slow steps of three: on 2 unshaped ranks of the quickstart MLP (7.8 ms median step,
            4.1-16.1 ms from the 5th to the 95th percentile) 6 times in 615 steps, each a full probe,
            against once now (replayed on the recorded walls; docs/auto.md). While a
            compressed method runs, its exchange time (the step's closing report, agreed already) is
            tested the same way against its reference window's, when it moved by at least
            :data:`EXCHANGE_SHARE` of the reference step: a link that came back shows there where the
            step barely moves (``lowrank`` 53 → 43 ms on the quickstart MLP). At least 2.
        min_interval: steps between a decision and a drift re-decision at least; a severe one
            (``severe_drift``, any of its tests) waits this long only after the last severe one.
            Why: the interval keeps moderate noise from switching methods back and forth, but a step
            2x off is a moved link, and each step spent waiting costs that much: on the quickstart
            MLP a moderate drift re-decision at step 80 kept DDP, the link fell at step 90, and the
            interval held DDP at ~440 ms per step until step 110, where Top-k runs ~37 ms (1.56x the
            best static method's mean step that round; docs/auto.md). Each severe re-decision costs
            one probe, so the interval between severe ones still bounds the probes.
        probe_every: re-probe and decide again this many steps after the last decision that looked at
            the link (a probe or a link check: warm-up, drift, periodic; not a calibration, a trial or a
            ``gain`` re-decision) even without drift (0: never): a link that gets faster may not move
            the step of a compressed method much (measured: Top-k-like ``lowrank`` kept its step when
            a 10 Mbit/s link went back to 1 Gbit/s, and auto stayed on it). Costs a probe (small on
            fast links; about one dense step's traffic on slow ones), or only a link check
            (``probe_check``). Counted from any decision before, a ``gain`` re-decision at step 172
            put the re-probe at step 273 on the quickstart MLP, 73 steps into a link back at 1 Gbit/s
            that Top-k's step did not show (docs/auto.md).
        probe_every_max: the periodic re-decision's interval doubles, up to this many steps, each
            time one keeps the method on a link its check found unchanged (``probe_check``), and
            goes back to ``probe_every`` after any other decision that looked at the link. On the
            quickstart MLP at 20 Mbit/s each periodic check sends 168 kB + 80 KiB, ~0.1 s: 4 checks
            in a 475-step run took 0.4 of its 18.4 s, about half of what auto spent beyond static
            ``lowrank`` (docs/auto.md). The price: a change that neither the step nor the exchange
            shows (a link that came back under a compressed method whose exchange fits the shaper's
            burst) is seen up to this many steps late on a long-steady link. Never below
            ``probe_every``. 0: no doubling (every ``probe_every`` steps, the earlier behaviour).
        probe_check: a periodic or (moderate) drift re-decision first sends one message of the last probe's
            size (after its small partner, as in the probe) and compares its time with that
            probe's: within this factor either way, the link is taken as unchanged and the decision
            uses the stored network, without the full probe (latency, then two sizes three times
            each after a warm-up: about 4x the traffic). 0: always the full probe. On the quickstart
            MLP at 20 Mbit/s a full re-probe cost 0.47-0.52 s of a 6 s run to the target.
        dense_probe_s: when the profiled dense step waited at least this long (seconds, slowest rank)
            for DDP's buckets after its last gradient was ready, that step is the bandwidth
            measurement: β is the value at which the model's DDP step equals it
            (``model.beta_from_dense_step``), α comes from the latency round alone, and the warm-up's
            bandwidth probe is skipped (the first periodic or drift re-decision then probes in full).
            Such a step is hundreds of kilobytes per rank sent anyway; the probe it replaces cost about
            0.4 s on the quickstart MLP at 20 Mbit/s (a tenth of its run to the target) and read that
            link at 18-38 Mbit/s across runs. 0: always probe. Below the threshold (a fast link) the
            step's wait is mostly the framework's and the collective's CPU time, not the link. A drift
            re-decision while a dense mode runs uses its drifted window the same way (the window's
            median less the mode's step on a free network is its wait).
        explore: after a calibration, how many more not-yet-measured candidates may be installed
            and measured (one ``window`` each, plus the settling window) because the raw model still
            favours them, per probed decision; 0 settles on the measured methods at once. Measured:
            with one correction for all compressed methods (no exploration), auto kept ``lowrank``
            at 1.24x Top-k's step on the quickstart MLP at 20 Mbit/s.
        explore_margin: a decision installs a method not yet measured on this link only if its
            (optimistic, shifted) prediction per unit of progress is at least this fraction below
            that of the best method measured in a window on this link; else it takes that method.
            Without such a method (the warm-up, a link that moved) the plain minimum decides, and a
            ``gain`` re-decision always does: it acts on re-measured errors, new information about
            the measured methods themselves. Why: the raw model leaves out what a real path adds,
            so a small predicted lead is often the model's optimism, and a window on the wrong
            method costs its steps and, for a lossy one, progress. Off (0) by default, measured
            (docs/auto.md): on the quickstart MLP at 20 Mbit/s, where auto had explored EF-signSGD on
            a 3 % lead and reached the target 1.75x later than static Top-k, 0.1 gave 1.06/1.10/1.07x
            the best static method's time against 1.18/1.16/1.12x with 0 (3 rounds, one run); on
            ``lm`` at 100 Mbit/s 0.1 kept ``lowrank`` after a drift re-decision where fp16, predicted
            2.6 % ahead, was the better method (1.63x the 16-bit hook's time; 0.98x in an earlier run
            without it), and applied to ``gain`` re-decisions too it held ``lowrank`` against
            Top-k's 6.3 % lead (1.28x). Try 0.1 where the candidates' steps are close and a wrong
            lossy pick costs progress.
        gain_every: every this many steps after the last measurement of the candidates' errors, the
            next step's local gradients are copied (post-accumulate-grad hooks; nothing is sent) and
            every candidate's ``delta2`` is measured on them again, between steps (0: only at the
            warm-up). A gradient's compressibility changes as training goes on: on ``cnn`` width
            16 (4 ranks' mean) ``lowrank``'s error fell from 0.69 at step 2 to 0.49 at step 40 while
            Top-k's stayed at 0.53-0.60, which reverses their ranking (docs/auto.md, "Gain").
            Costs one copy of the gradient and one compression per candidate, no communication
            beyond one agreement of a few floats.
        gain_every_max: the re-measurement's interval doubles, up to this many steps, after each one
            that left the method as it was (its errors moved too little to re-decide, ``gain_drift``,
            or the re-decision kept the method), and goes back to ``gain_every`` after any decision
            that switched the method. Why: a re-measurement is the chooser's most expensive routine
            look; on ``mlp`` (1.09 M parameters, 4 ranks on 2 cores) each made its step 0.19-0.40 s
            against 60-80 ms (each rank measured its five compressed and 16-bit candidates in
            58-323 ms, and the agreement waited for the slowest), 3-7 ms per step at every 50
            steps; errors that keep the same pick need not be measured that often. The price: a
            slow change of the errors that would move the pick is seen up to this many steps late.
            Never below ``gain_every``. 0: no doubling (every ``gain_every`` steps, the earlier
            behaviour).
        gain_first: the first re-measurement after the warm-up's comes this many steps after it, or
            after ``gain_every`` if that is sooner (0: after ``gain_every``). Why earlier than the
            rest: the warm-up measures the errors on the first gradients of training, which are
            unlike later ones. On ``lm`` at 100 Mbit/s (4 ranks) ``lowrank``'s weighted error
            ``w·delta2`` was 0.013 at the warm-up (step 1) and 0.43 at step 51, Top-k's 0.18 and
            0.32: auto ran ``lowrank`` until the re-measurement at step 51 moved it to Top-k
            (docs/auto.md, "Gain"). One gradient copy and one compression per candidate.
        gain_drift: the re-measured errors re-decide (trigger ``"gain"``, no probe) when some
            candidate's progress per step (``1/(1 + w·delta2)``) moved by more than this, relative,
            from the value the last decision used; smaller changes are not acted on (and the stored
            errors kept, so a slow drift still adds up against them).
        early_comm_ratio: if the first (skipped) dense step's exposed communication (end of backward's
            closure after the last gradient was ready, where DDP waits for its buckets) is at least
            this many times the rest of its wall, that step is profiled and decided on at once and
            the dense warm-up ends there (0: never; a configured ``warmup_steps`` above
            ``skip_steps + profile_steps`` still holds). So on a slow link auto runs no dense step
            beyond the engine's own first one: a dense step there is mostly the exchange (2.1 s of a
            2.2 s step on ``cnn`` width 16 at 20 Mbit/s), and the second one costs far more than the
            profile gains. The first step's profile carries one-off costs that make every
            unmeasured candidate look slower; this was off by default until ``compute_shift``
            removed that bias after the first window (on ``cnn`` at 20 Mbit/s auto had stayed on
            Top-k; with the shift it moved to ``lowrank`` at step 10). Measured with both in the
            same bench run: on the quickstart MLP at 20 Mbit/s its time to target was lower than
            with 0 in all 3 rounds (4.66, 4.63, 4.22 s against 4.77, 5.43, 5.55 s), on ``cnn``
            equal (29.5 against 29.7 s) (docs/auto-measurements.md, "Measured").
        family_margin: after the first window of a dense mode (``ddp``, ``fp16``, ``bf16``), a dense
            sibling not yet measured on this link is run for one window when its raw prediction plus
            the measured mode's correction (what the model misses on that shared path) is within
            this fraction of the measured step, per unit of progress; then auto keeps the faster,
            the interrupted mode unless the sibling leads it by ``switch_margin``.
            The model cannot tell apart two paths this close: on ``gpt`` at 1 Gbit/s it put the
            16-bit hook 13 ms under DDP, and DDP ran 11 ms faster (4 ranks on 2 cores: the cast's
            passes over memory compete with backward). Costs at most one window on a step within
            the margin; 0 tries a sibling only if it is predicted at least as fast. 0.3 was tried
            on the quickstart MLP at 1 Gbit/s (3 rounds each): the trial then ran in every round,
            and auto's step was 1.27/1.03/1.18x the faster of DDP and fp16 against 1.22/0.91/1.40x
            with 0.15, no difference that run-to-run noise does not cover (docs/auto.md).
        switch_margin: a decision replaces the running method, measured in a window on this link,
            by another method measured in a window on this link only if that one's time per unit of
            progress is at least this fraction lower; else the running method stays (the history
            records the candidate so held off as ``held_by_margin``). Why: the running method's
            figure is fresh and the other's was measured earlier, so on a host whose speed drifts
            the running one always looks a little worse. On ``gpt`` at 1 Gbit/s (4 ranks, 2 cores)
            auto went fp16 → ddp → fp16 → ddp at three periodic looks at an unchanged link, on leads
            of 1.3 %, 2.8 % and 0.2 % (docs/auto.md). Costs at most this fraction of the step where
            the other method really is that much faster; 0 switches on any lead (the earlier
            behaviour). At the calibration that ends a dense sibling's trial, the mode the trial
            interrupted holds in the running method's place: the sibling is kept only on this lead
            over it (two single windows cannot tell 2-3 % apart; holding the sibling itself there,
            an earlier version, kept DDP 1.4 % slower than fp16 on ``gpt`` at 1 Gbit/s). Not applied
            at other calibrations (the decision after a method's first window on this link): they
            compare two recent windows and take the faster. Nor to a method not yet measured
            (``explore_margin`` decides those).
        compute_shift: when every method measured in a window of its own ran faster than the raw
            model said, lower the prediction of every method not yet measured so by the smallest of
            those speed-ups (``model.compute_shift``): the warm-up's profiled compute is slower than
            a settled step's, which the raw model otherwise charges to every method it has not run.
            On ``lm`` at 100 Mbit/s it put Top-k at 244 ms where it ran 102 ms, and auto never tried
            it. The speed-ups are the dense modes' measured in a window, on any link, when there
            are any (their path is the profiled one; a compressed method's correction carries its
            own costs too), else every method's measured on this link. False: unmeasured methods by
            the raw model (the earlier behaviour).
        time_codecs: when the engine candidates' codecs are timed. ``"on_demand"`` (default): the
            warm-up measures every candidate's payload and error (one compression each) but times no
            engine codec; a decision whose best candidate has an untimed codec (predicted with 0,
            a lower bound: every prediction grows with the codec's time) times that codec and
            decides again, until its best is timed (the others' bounds lost to it already, and only
            grow). The pick is the one timing them all would give, and on a fast link,
            where a dense mode wins even against the bounds, no codec is timed: on the quickstart
            MLP (4 ranks, 1 Gbit/s) timing them took ~70 of the first decision's ~170 ms.
            ``"upfront"``: time every codec at the warm-up (the earlier behaviour; every
            prediction in the history is then a full one).
        canary_bytes: off by default (0). With e.g. 65536, before each step a dense mode runs the
            engine sends this many bytes from every rank to every other rank, timed, on its worker,
            and on a fallen link the step stops (its gradient kept as error memory) and auto
            re-decides at its end (lightning_gc/engine/dense_stop.py; docs/auto.md, "The link
            canary"). For links known to fall to a small fraction of their rate: on ``mlp`` at
            1 Gbit/s → 10 Mbit/s it turned a 2.9-3.0 s fp16 step into a stopped step of 0.61-0.66 s.
            It costs ~3-7 ms of every dense step on ``mlp`` and 1-10 ms on ``cnn`` width 16 on this
            project's 2-core machine (4 ranks), beyond the fast-link bound. Above the link's burst
            allowance divided by ``N-1`` (the bench's shaper lets 64 KiB out at line rate), or a
            fall does not show. Only on 2-8 ranks off NCCL (the direct exchange), with a plan that
            sends every parameter every step, and with a network auto measures (not one pinned by
            ``network_alpha_s``/``network_beta_s_per_byte``: it could not re-read it).
        canary_factor: the link fell when the fastest rank's time for the canary is at least this
            many times the network model's for it ...
        canary_margin_s: ... and at least this many seconds more (scheduling noise: on this
            project's 2-core machine a 4-rank direct exchange takes 0.7-1 ms at 1 Gbit/s, with
            outliers of a scheduler slice).
    """

    candidates: tuple[str, ...] = DEFAULT_CANDIDATES
    progress_weight: float = DEFAULT_PROGRESS_WEIGHT
    skip_steps: int = 1
    profile_steps: int = 1
    repeats: int = 3
    window: int = 5
    drift: float = 0.3
    patience: int = 2
    severe_drift: float = 2.0
    severe_steps: int = 3
    min_interval: int = 30
    probe_every: int = 100
    probe_every_max: int = 400
    probe_check: float = 1.5
    dense_probe_s: float = 0.1
    explore: int = 2
    explore_margin: float = 0.0
    gain_every: int = 50
    gain_every_max: int = 400
    gain_first: int = 20
    gain_drift: float = 0.1
    early_comm_ratio: float = 1.0
    family_margin: float = 0.15
    switch_margin: float = 0.03
    compute_shift: bool = True
    time_codecs: str = "on_demand"
    canary_bytes: int = 0
    canary_factor: float = 4.0
    canary_margin_s: float = 0.02

    def __post_init__(self) -> None:
        cands = tuple(self.candidates)
        object.__setattr__(self, "candidates", cands)
        if not cands:
            raise ValueError("auto_candidates is empty: list at least 'ddp', e.g. ('ddp', 'fp16', 'topk').")
        for c in cands:
            candidate(c)
        if len(set(cands)) != len(cands):
            raise ValueError(f"auto_candidates={cands!r} lists a method twice.")
        if "ddp" not in cands:
            raise ValueError(f"auto_candidates={cands!r} must include 'ddp': the warm-up measures it, and it is the "
                             "method auto falls back to.")
        w = self.progress_weight
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0:
            raise ValueError(f"auto_progress_weight={w!r} must be a finite number >= 0 (0: step time only; "
                             "default 2).")
        _int("skip_steps", self.skip_steps, 0, "Use 0 to profile from the first step.")
        _int("profile_steps", self.profile_steps, 1, "Use at least 1 (3 by default: the median of three).")
        _int("repeats", self.repeats, 1, "Use at least 1.")
        _int("window", self.window, 2, "Use at least 2 steps per window.")
        _int("patience", self.patience, 1, "Use at least 1.")
        sv = self.severe_drift
        if isinstance(sv, bool) or not isinstance(sv, (int, float)) or not math.isfinite(sv) or not (sv == 0 or sv > 1):
            raise ValueError(f"auto_severe_drift={sv!r} must be 0 (off) or a factor > 1 (e.g. 2.0: a window at twice or "
                             "half the reference step re-decides at once).")
        _int("severe_steps", self.severe_steps, 0, "Use 0 to test severe drift on windows only, or e.g. 3.")
        if self.severe_steps == 1:
            raise ValueError("auto_severe_steps=1 would re-decide on one slow step: a step's wall includes any "
                             "validation or checkpoint before it. Use 0 (windows only) or at least 2 (e.g. 3).")
        _int("min_interval", self.min_interval, 1, "Use at least 1.")
        _int("probe_every", self.probe_every, 0, "Use 0 to re-decide on drift only.")
        _int("probe_every_max", self.probe_every_max, 0, "Use 0 for no doubling, or e.g. 400.")
        dp = self.dense_probe_s
        if isinstance(dp, bool) or not isinstance(dp, (int, float)) or not math.isfinite(dp) or dp < 0:
            raise ValueError(f"auto_dense_probe_s={dp!r} must be a finite number of seconds >= 0 (0: always probe the "
                             "bandwidth; e.g. 0.1: a dense step that waited 0.1 s on the network measures it).")
        pc = self.probe_check
        if isinstance(pc, bool) or not isinstance(pc, (int, float)) or not math.isfinite(pc) or not (pc == 0 or pc > 1):
            raise ValueError(f"auto_probe_check={pc!r} must be 0 (always the full probe) or a factor > 1 (e.g. 1.5: a "
                             "check message within 1.5x of the last probe's time keeps the probed network).")
        _int("explore", self.explore, 0, "Use 0 to settle on measured methods after the first calibration.")
        _int("gain_every", self.gain_every, 0, "Use 0 to measure the candidates' errors at the warm-up only.")
        _int("gain_every_max", self.gain_every_max, 0, "Use 0 for no doubling, or e.g. 400.")
        _int("gain_first", self.gain_first, 0, "Use e.g. 20 steps after the warm-up; 0 waits gain_every steps.")
        er = self.early_comm_ratio
        if isinstance(er, bool) or not isinstance(er, (int, float)) or not math.isfinite(er) or er < 0:
            raise ValueError(f"auto_early_comm_ratio={er!r} must be a finite number >= 0 (0: always profile after "
                             "skip_steps; 1, the default: decide on the first dense step when it waited on the "
                             "network at least as long as it did anything else).")
        if not isinstance(self.compute_shift, bool):
            raise ValueError(f"auto_compute_shift={self.compute_shift!r} must be true or false (true: a speed-up "
                             "every measured method showed also lowers the unmeasured methods' predictions).")
        if self.time_codecs not in TIME_CODECS:
            raise ValueError(f"auto_time_codecs={self.time_codecs!r} is not one of {', '.join(TIME_CODECS)} "
                             "('on_demand': time a codec only when its lower bound would be picked; 'upfront': "
                             "time every codec at the warm-up).")
        em = self.explore_margin
        if isinstance(em, bool) or not isinstance(em, (int, float)) or not math.isfinite(em) or not 0 <= em < 1:
            raise ValueError(f"auto_explore_margin={em!r} must be a number in [0, 1) (a relative lead, e.g. 0.1: an "
                             "unmeasured method replaces the best measured one only if predicted 10% faster per "
                             "unit of progress; 0: any lead, the default).")
        sm = self.switch_margin
        if isinstance(sm, bool) or not isinstance(sm, (int, float)) or not math.isfinite(sm) or not 0 <= sm < 1:
            raise ValueError(f"auto_switch_margin={sm!r} must be a number in [0, 1) (a relative lead, e.g. 0.03: a "
                             "measured method replaces the running measured one only if 3% faster per unit of "
                             "progress; 0: any lead).")
        fm = self.family_margin
        if isinstance(fm, bool) or not isinstance(fm, (int, float)) or not math.isfinite(fm) or fm < 0:
            raise ValueError(f"auto_family_margin={fm!r} must be a finite number >= 0 (a relative margin, e.g. 0.15; "
                             "0: try a dense sibling only if the transferred correction makes it at least as fast).")
        gd = self.gain_drift
        if isinstance(gd, bool) or not isinstance(gd, (int, float)) or not math.isfinite(gd) or gd < 0:
            raise ValueError(f"auto_gain_drift={gd!r} must be a finite number >= 0 (a relative change of a "
                             "candidate's progress per step, e.g. 0.1; 0 re-decides on every re-measurement).")
        d = self.drift
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not (0 < d):
            raise ValueError(f"auto_drift={d!r} must be > 0 (a relative change, e.g. 0.3).")
        _int("canary_bytes", self.canary_bytes, 0, "Use 0 (the default) to leave the link canary off, or e.g. 65536.")
        try:  # the factor's and the margin's own checks, whether the canary is on or not
            LinkCanary(self.canary_bytes or 1, self.canary_factor, self.canary_margin_s)
        except ValueError as e:
            raise ValueError(f"auto_{e}") from None

    def canary(self) -> LinkCanary | None:
        """The :class:`~lightning_gc.engine.dense_stop.LinkCanary` of these options (None: off)."""
        if not self.canary_bytes:
            return None
        return LinkCanary(self.canary_bytes, self.canary_factor, self.canary_margin_s)

    @property
    def dense_steps_needed(self) -> int:
        return self.skip_steps + self.profile_steps

    @classmethod
    def coerce(cls, value: AutoConfig | dict | None) -> AutoConfig:
        """An :class:`AutoConfig` from itself, a dict of its fields (YAML) or ``None`` (defaults)."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            known = {f.name for f in fields(cls)}
            unknown = sorted(set(value) - known)
            if unknown:
                raise ValueError(f"auto={value!r}: unknown option(s) {unknown}; valid: {sorted(known)}.")
            return cls(**value)
        raise TypeError(f"auto={value!r} must be an AutoConfig, a dict of its fields or None.")

    def as_dict(self) -> dict:
        return {**asdict(self), "candidates": list(self.candidates)}


def _lead(preds: dict[str, Prediction], a: str, b: str) -> float:
    """How much lower ``a``'s predicted time per unit of progress is than ``b``'s, relative to ``b``'s
    (the lead that ``explore_margin`` and ``switch_margin`` are compared with)."""
    return 1.0 - preds[a].time_per_progress_s / preds[b].time_per_progress_s


def _overhead_in(entry: dict, name: str) -> float:
    """What a history entry's decision added to ``name``'s raw prediction (``model.overhead_used``);
    entries written before the compute shift have neither ``settled`` nor ``shift_s``."""
    return overhead_used(name, entry["corrections"], float(entry.get("shift_s", 0.0)), entry.get("settled"))


#: a per-method correction measured on a link whose bandwidth differs from the current one by more
#: than this factor is not used (:meth:`AutoChooser._valid_corrections`); probes of one 1 Gbit/s
#: link varied well within it
STALE_NETWORK_FACTOR = 2.0
_BETA_FLOOR = 1e-12  # s/byte (8 Tbit/s): an unlimited link (β = 0) compares as a very fast one


class AutoChooser(StepParticipant):
    """Profiles, measures, chooses and re-chooses the method (see the module docstring)."""

    name = "auto"
    state_scope = "replicated"

    def __init__(self, engine: Any, config: AutoConfig, module: torch.nn.Module,
                 named_parameters: list[tuple[str, Tensor]]) -> None:
        self.engine = engine
        self.config = config
        self.candidates: list[AutoCandidate] = [candidate(c) for c in config.candidates]
        self.params = [p for _, p in named_parameters]
        self.names = [n for n, _ in named_parameters]
        #: the early path (early_comm_ratio) never shortens the warm-up below this: the configuration
        #: raised a warm-up of at most skip_steps + profile_steps to that sum for auto (GCConfig), so
        #: such a warm-up is auto's; 1 is the engine's own (DDP's bucket rebuild after step 0); a
        #: longer one was asked for and is kept
        w = int(engine.config.warmup_steps)
        self._configured_warmup = w if w > config.dense_steps_needed else 1
        engine.raise_warmup_steps(config.dense_steps_needed)
        # every step's wall rides in the next step's messages (the every-step test and the windows read
        # them there): a compressed step's closing report. A dense mode's is agreed at once by a direct
        # exchange (one message latency) where the group allows one, else it rides in the next step's
        # first gradient bucket (see _agree_wall_later)
        self._dense_walls_direct = (1 < engine.world_size <= DIRECT_MAX_RANKS and dist.is_available()
                                 and dist.is_initialized() and backend_allows(engine.process_group))
        if not self._dense_walls_direct:
            engine.enable_dense_carry()
        #: the link canary before each step a dense mode runs (AutoConfig.canary_bytes; None: off; the engine
        #: sings it, lightning_gc/engine/dense_stop.py); each dense step's wall is still agreed at its own end
        #: (_agree_wall_later), for a fall during a step. Not under a network the user pinned: a fall it saw could not
        #: re-read the link (the pinned figures are not recalibrated), and every dense step would stop
        pinned = bool(engine.network.pinned and engine.network.model is not None)
        self.canary = (config.canary() if self._dense_walls_direct and not pinned and engine.plan_sends_every_param
                       else None)
        #: before a decision that did not look at the link moves from a compressed method to a dense mode, one
        #: canary message tells whether the link fell meanwhile (a compressed method's step may not show it:
        #: its exchange can fit the shaper's burst). The user's canary if on, else the defaults; None where the
        #: group takes no direct exchange or the network is pinned. See _decide and docs/auto.md
        self._switch_check = ((self.canary or LinkCanary()) if self._dense_walls_direct and not pinned else None)
        if self.canary is not None:
            engine.enable_canary(self.canary)
        #: every decision (replicated, checkpointed): step, trigger, inputs, predictions, choice
        self.history: list[dict] = []
        self.chosen: str | None = None
        self.workload: Workload | None = None
        self.costs: list[MethodCost] | None = None
        self.network: NetworkModel | None = None
        self.predictions: dict[str, Prediction] = {}
        self.measured: list[float] = []  # this rank's step walls (profile, then windows)
        self._profile: list[dict] = []
        self._reference: float | None = None
        self._settling = True
        #: measured step minus raw prediction, per method that has run (replicated: agreed windows)
        self._corrections: dict[str, float] = {}
        #: per method: the network's β (s/byte) when its correction was measured (see _valid_corrections)
        self._correction_beta: dict[str, float] = {}
        self._explore_left = config.explore
        #: the large message of the last bandwidth probe (bytes; 0 before any probe or with a pinned network)
        self.probe_bytes = 0
        #: that message's time in the last full probe (agreed, MAX over ranks): the link check's reference
        self.probe_time_s = 0.0
        #: whether :attr:`probe_time_s` is the model's time for that message, not a measured one (a network
        #: measured by a dense step: :func:`modelled_check_s`); the first check's own time replaces it
        self.probe_time_modelled = False
        #: every probe's β is multiplied by this (replicated): the warm-up's profiled DDP step divided
        #: by what the model gave it at the probed β, when shorter (model.calibrate_beta); 1 otherwise
        self.beta_scale = 1.0
        self._drifted = 0
        self._window: list[float] = []
        #: agreed step walls for the every-step severe test (severe_steps; the mean over ranks, carried in the
        #: next step's closing report or first gradient bucket), the oldest first, and the last step's wall
        #: still to be read (its step, its reader; see _agree_wall_later)
        self._recent: list[float] = []
        self._recent_pending: tuple[int, Callable[[], float | None]] | None = None
        self._recent_step: int | None = None  # the step of the newest wall in _recent
        #: steps whose wall may hold time that is not a training step's (mark_wall: an epoch's first step,
        #: a checkpoint saved before it): the one-step test (ONE_STEP_FACTOR) leaves them out
        self._marked_walls: set[int] = set()
        #: the walls read so far (step -> the mean over ranks, None where it was lost), the last few:
        #: the windows' medians come from them without an agreement of their own (see _check_drift)
        self._carried_walls: dict[int, float | None] = {}
        #: a compressed method's exchange times of the last steps (the closing report's mean over ranks),
        #: the current window's, and the reference window's fastest (the exchange test's reference; None before)
        self._recent_exchange: list[float] = []
        self._window_exchange: list[float] = []  # the agreed exchanges of the current window's steps
        self._reference_exchange: float | None = None
        #: the agreed medians of the running method's windows since its reference window (that one
        #: first; replicated, checkpointed): its figure at a gain or periodic re-decision (see _decide)
        self._run_medians: list[float] = []
        self._last_decision_step: int | None = None
        # the last decision that looked at the link (a probe, a link check, a dense step's β): the
        # periodic re-probe counts from it, not from a calibration's, a trial's or a gain re-decision's
        self._last_link_step: int | None = None
        self._link_interval = config.probe_every  # the periodic re-decision's interval now (probe_every_max)
        self._gain_interval = config.gain_every  # the errors' re-measurement interval now (gain_every_max)
        self._stamps: dict[int, float] = {}
        self._t_start = self._t_fwd = self._t_closure_end = 0.0
        self._t_prev_end: float | None = None
        self._t_paused: float | None = None  # pause_walls: when the validation (or other non-training time) began
        self._handles: list[Any] = []
        #: this rank's local gradients of the step being sampled (parameter index → copy), or None when
        #: no step is sampled: the warm-up's dense steps (the last profiled one is measured) and, every
        #: ``gain_every`` steps, one armed step (see _arm_sample)
        self._sample: dict[int, Tensor] | None = None
        self._sample_handles: list[Any] = []
        #: the step whose gradients the candidates' stored errors were last measured on (replicated)
        self._last_gain_step: int | None = None
        #: every re-measurement of the errors (replicated, checkpointed): step, each candidate's
        #: agreed delta2, the largest relative change of progress per step, whether it re-decided
        self.gain_checks: list[dict] = []
        if engine.world_size > 1:
            self._sample = {}
            self._handles = [p.register_post_accumulate_grad_hook(self._stamp(i)) for i, p in enumerate(self.params)]
            self._handles.append(module.register_forward_hook(self._on_forward))

    # ------------------------------------------------------------------ timing (autograd / main thread)
    def _stamp(self, i: int) -> Callable[[Tensor], None]:
        def hook(param: Tensor) -> None:
            self._stamps[i] = time.perf_counter()  # before the copy: the copy is not backward's time
            self._keep(i, param)
        return hook

    def _keep(self, i: int, param: Tensor) -> None:
        """Copy a parameter's local gradient if this step is sampled. A post-accumulate-grad hook runs
        when the tensor's gradient is complete on this rank and before DDP's reducer (a hook of the
        same autograd node, run after it) or the engine has touched it, so it is this rank's own
        gradient; under gradient accumulation the last micro-batch's copy (the full sum) is kept."""
        if self._sample is not None and param.grad is not None:
            self._sample[i] = param.grad.detach().clone()

    def _arm_sample(self) -> None:
        """Copy the next step's local gradients (for the errors' re-measurement, see ``gain_every``)."""
        self._disarm_sample()
        self._sample = {}

        def keeper(i: int) -> Callable[[Tensor], None]:
            return lambda param: self._keep(i, param)
        self._sample_handles = [p.register_post_accumulate_grad_hook(keeper(i)) for i, p in enumerate(self.params)]

    def _disarm_sample(self) -> dict[int, Tensor] | None:
        sample, self._sample = self._sample, None
        for h in self._sample_handles:
            h.remove()
        self._sample_handles = []
        return sample

    def _on_forward(self, *_: Any) -> None:
        self._t_fwd = time.perf_counter()

    def wrap_closure(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        def timed() -> Any:
            if self._canary_due():  # on the engine's worker: the step's buckets wait behind it
                self.engine.sing_canary(math.nan)  # nothing carried: the step before's wall was agreed at its end
            self._stamps = {}
            self._t_start = time.perf_counter()
            self._t_fwd = self._t_start
            out = closure()
            self._t_closure_end = time.perf_counter()
            return out
        return timed

    def _remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    # ------------------------------------------------------------------ step boundary
    def pause_walls(self) -> None:
        """Time from now until :meth:`resume_walls` is not a training step's (the strategy calls the
        two around validation, and the checkpoint saved at its end). Why: the step after a validation
        carried it in its wall (80-130 ms against ~20 ms steps on the quickstart MLP at 1 Gbit/s), and
        with one more noisy step the median of 3 fired the 2x test on a steady link; that false
        re-decision then held the real one (the link falling 14 steps later) for ``min_interval``
        steps: 16 DDP steps of ~440 ms (docs/auto.md). The bench leaves validation out of its step
        times the same way."""
        self._t_paused = time.perf_counter()

    def mark_wall(self) -> None:
        """The step now running (or about to) may hold time that is not a training step's: the strategy
        calls this at an epoch's first batch (the loop's epoch end, a data loader's workers starting)
        and when a checkpoint is saved between steps. Such a step still counts in the windows and the
        test of the last ``severe_steps``; the one-step test (:data:`ONE_STEP_FACTOR`) leaves it out.
        Called on every rank alike (the batch index and the checkpoint's save are the same on every
        rank), so every rank leaves out the same steps."""
        self._marked_walls.add(int(self.engine.step))

    def resume_walls(self) -> None:
        """End of :meth:`pause_walls`: the next step's wall starts where the last step ended, plus the pause."""
        if self._t_paused is not None and self._t_prev_end is not None:
            self._t_prev_end += time.perf_counter() - self._t_paused
        self._t_paused = None

    def after_optimizer_step(self) -> None:
        engine = self.engine
        t_end = time.perf_counter()
        wall = None if self._t_prev_end is None else t_end - self._t_prev_end
        self._t_prev_end = t_end
        if engine.world_size == 1:
            return
        step = engine.step - 1  # the step that just finished
        if self.chosen is None:
            cfg = self.config
            complete = len(self._stamps) == len(self.params)
            if step >= cfg.skip_steps and wall is not None and complete:
                self._profile.append(self._profile_entry(t_end, wall))
            elif step < cfg.skip_steps and step + 1 >= self._configured_warmup and self._early(t_end, complete):
                # the skipped step waited mostly on the network: profile it and end the warm-up here
                self._profile = [self._profile_entry(t_end, t_end - self._t_start)]
                engine.shorten_warmup_steps(step + 1)
            if len(self._profile) >= cfg.profile_steps or not engine.step_is_dense():
                self._first_decision(step)
                self._t_prev_end = time.perf_counter()  # the measurement is not a step
            return
        stats = engine.last_step
        if stats is not None and stats.step == step and stats.dense_stopped:
            self._read_carried()  # the step before's wall (agreed at its end; nothing pending then)
            self._on_dense_stop(step, stats)
            return
        if wall is not None:  # None on the first step after a resume
            self.measured.append(wall)
            self._window.append(wall)
        self._read_carried()  # the step before's wall, carried in this step's messages
        if self._sample_handles:  # this step was sampled: measure the errors again
            self._check_gain(step, self._disarm_sample() or {})
            self._t_prev_end = time.perf_counter()  # the measurement is not a step
        elif len(self._window) >= self.config.window:
            self._check_drift(step)
            self._t_prev_end = time.perf_counter()
        if wall is not None and self._last_decision_step == step and self._recent_pending is None:
            # a decision's step: its wall is carried all the same (the next window reads it; the severe
            # test leaves it out)
            self._recent_pending = (step, self._agree_wall_later(step, wall))
        if wall is not None and self._last_decision_step != step:
            exchange_s, exchange_step = None, None
            if candidate(self.chosen).compressor is not None:  # agreed by the step's closing report
                stats = engine.last_step
                if stats is not None and not stats.dense:
                    # this step's, or the step before's where the report rode in the last message
                    exchange_s, exchange_step = stats.exchange_comm_mean_s, stats.exchange_comm_mean_step
            self._check_severe_steps(step, wall, exchange_s, exchange_step)
        if self._gain_due(step):
            self._arm_sample()

    def _on_dense_stop(self, step: int, stats: Any) -> None:
        """Step ``step`` was a dense mode's, and the link canary before it saw the link fall: the step
        stopped (lightning_gc/engine/dense_stop.py; its compressed groups' gradients are error memory;
        the verdict is agreed, so every rank is here). Re-decide now (trigger ``drift``, test
        ``canary``), whatever ``min_interval`` says: until a decision looks at the link again, every
        dense step would stop. The network for it: β from the canary itself (its second message's time
        on the fastest rank, less the model's α, over the ``N-1`` copies each rank sent), no probe.
        Why: a probe that starts small and grows took 0.9 s on the quickstart MLP at 10 Mbit/s, and the
        canary timed the link at the size a probe ends at. The stopped step is not a step of the
        method (it sent its exact group only) and enters no window; a gradient sample armed for it
        is dropped (the next one comes at the next due step)."""
        canary = self.canary
        assert canary is not None
        fastest, predicted = stats.dense_check_s, stats.dense_check_predicted_s
        rank_zero_info(f"lightning_gc auto: the link canary before step {step} under {self.chosen!r} took "
                       f"{1e3 * fastest:.1f} ms on the fastest rank (twice), {1e3 * predicted:.2f} ms on the network "
                       "model: the link fell, the step kept its gradient as error memory; re-deciding")
        self._disarm_sample()
        self._decide(step, "drift", probe=True, check_link=False, canary_s=fastest, detail="canary")
        self._t_prev_end = time.perf_counter()  # the decision is not a step

    def _gain_due(self, step: int) -> bool:
        """Whether the next step's gradients are sampled to measure the candidates' errors again:
        ``gain_first`` (then ``gain_every``) steps after the last measurement, and not while a method
        is on trial (:attr:`in_trial`). A re-decision in the middle of a trial cut it short: its
        window was never measured, and the trial ran again later. On ``cnn`` width 16 at 1 Gbit/s
        the re-measurement at step 21 ended DDP's trial window, begun at step 11, and DDP ran a second
        trial from step 31: 20 of 100 steps on the slower dense path (docs/auto.md). Deferred, the
        sample is taken at the first step after the trial's window is measured. The interval
        doubles while the pick stands (``gain_every_max``)."""
        every, first = (self._gain_interval if self.config.gain_every else 0), self.config.gain_first
        if every and first and not self.gain_checks:  # not re-measured yet: the warm-up's errors are the first
            every = min(every, first)
        due = bool(every) and self._last_gain_step is not None and step + 1 - self._last_gain_step >= every
        return due and not self.in_trial

    def _profile_entry(self, t_end: float, wall: float) -> dict:
        order = sorted(range(len(self.params)), key=lambda i: self._stamps[i])
        return {"forward_s": self._t_fwd - self._t_start, "order": order,
                "ready": [self._stamps[i] - self._t_fwd for i in order],
                "optimizer_s": max(t_end - self._t_closure_end, 0.0), "wall_s": wall,
                # DDP's wait for its buckets: the end of the closure after the last gradient was ready
                "exposed_s": max(self._t_closure_end - max(self._stamps.values()), 0.0)}

    def _early(self, t_end: float, complete: bool) -> bool:
        """Whether a skipped dense step's exposed communication (closure end after the last
        gradient was ready: DDP's wait for its buckets) was at least ``early_comm_ratio`` times the
        rest of the step (its start to its end), on the slowest rank (agreed, so every rank takes
        the same path). A step without every gradient's time (an unused parameter): no."""
        ratio = self.config.early_comm_ratio
        if not ratio:
            return False
        last_ready = max(self._stamps.values()) if complete and self._stamps else None
        exposed = max(self._t_closure_end - last_ready, 0.0) if last_ready is not None else 0.0
        rest = max((t_end - self._t_start) - exposed, 0.0)
        missing = 0.0 if last_ready is not None else 1.0
        exposed, rest, missing = agree_values([exposed, rest, missing], "max", self.engine.process_group,
                                              self.engine.device)
        return not missing and exposed > 0.0 and exposed >= ratio * rest

    def _check_severe_steps(self, step: int, wall: float, exchange_s: float | None = None,
                            exchange_step: int | None = None) -> None:
        """The every-step severe tests (``severe_steps``; see :class:`AutoConfig`), at least
        ``min_interval`` steps after the last severe re-decision (:meth:`_severe_held`); each
        re-decides with a probe (trigger ``drift``). Every input is agreed, so every rank takes the same path.

        * **The step** (test ``steps``): reads the agreed wall of the step before (issued there;
          complete by now) and issues this step's; every one of the last ``severe_steps`` agreed
          walls ``severe_drift`` or more off the reference the same way, or their median twice that
          far (:func:`steps_apart`; or off a calibrated prediction, before the reference window).
        * **The exchange** (test ``exchange``; compressed methods): ``exchange_s``, step
          ``exchange_step``'s time in the compressed exchanges averaged over the ranks (the step's
          closing report, agreed already; the step before's where the report rode in the step's
          last message, ``EngineConfig.report_rides``), against the fastest exchange of the reference window: the median of the last
          ``severe_steps`` ``severe_drift`` times or more *faster* and by at least
          :data:`EXCHANGE_SHARE` of the reference step. The fastest, not the median: the median let
          a reference window that caught the slow mode of a two-mode exchange (below) fire on the
          fast one; with the median, Top-k on a steady 20 Mbit/s link re-decided twice per
          300-step run (quickstart MLP, 3 rounds), each time with a link check.
          Why: a compressed method's step can hide a link that came back; on the quickstart MLP
          ``lowrank`` went from 53 to 43 ms when 10 Mbit/s returned to 1 Gbit/s, under the step
          test's 2x, and auto ran it to the end of the run where fp16 takes ~24 ms (docs/auto.md);
          the exchange is the part of the step that the link sets.

          Only faster, since a fall shows in the step test. Measured on the quickstart MLP on a
          steady 10 Mbit/s link: tested both ways, it fired twice in one run (Top-k at step 162,
          EF-signSGD at 188; the first moved auto to ``lowrank``); faster only, once in the next
          (Top-k at step 152: the full probe cost 0.91 s and kept Top-k). A likely cause, not
          confirmed by a trace: the shaper lets a burst of a few tens of kilobytes out at line
          rate, so a small exchange's time has two modes on an unchanged link. So the decision
          this test starts begins with the link check (``probe_check``: one message of the last
          probe's size, above any burst allowance), and on an unchanged link the stored network
          decides without the probe."""
        n, sv = self.config.severe_steps, self.config.severe_drift
        self._read_carried()
        # carried whatever the test's setting: the windows read their medians from these walls too
        self._recent_pending = (step, self._agree_wall_later(step, wall))
        if self._dense_agreed_now():  # agreed already (a dense mode): this step's wall enters the tests now
            self._read_carried()
        if not n or not sv:
            return
        last = self._last_decision_step if self._last_decision_step is not None else -10**9
        at = step if exchange_step is None else exchange_step
        if exchange_s is not None and at > last + 1:  # not the decision's step, nor the switch's first
            self._recent_exchange = (self._recent_exchange + [exchange_s])[-n:]
            self._window_exchange.append(exchange_s)
        if self._severe_held(step):
            return
        test = basis = None
        if len(self._recent) >= n:
            # every one of the last n steps off by the factor the same way, or their median twice that far
            # (steps_apart; not the median at the factor: two slow steps of three are scheduling noise often
            # enough on a busy host)
            slow, fast = min(self._recent), max(self._recent)
            if self._reference is not None:
                if steps_apart(self._recent, self._reference, sv):
                    test, basis = "steps", f"{1e3 * self._reference:.1f} ms after the last decision"
            elif self._link_moved_under(self._recent):
                test = "steps"
                basis = f"{1e3 * self.predictions[self.chosen].step_s:.1f} ms predicted from its own measured step"
            what = (f"the last {n} steps ran {1e3 * slow:.1f}-{1e3 * fast:.1f} ms (median "
                    f"{1e3 * statistics.median(self._recent):.1f} ms)")
        if test is None and self._one_step_fell():
            test, one = "step", self._recent[-1]
            what = (f"one step ({self._recent_step}) ran {1e3 * one:.1f} ms under {self.chosen!r}, "
                    f"{ONE_STEP_FACTOR * self.config.severe_drift:g}x or more")
            basis = (f"{1e3 * self._reference:.1f} ms after the last decision" if self._reference is not None else
                     f"{1e3 * self.predictions[self.chosen].step_s:.1f} ms predicted from its own measured step")
        ref_x = self._reference_exchange
        if test is None and ref_x and self._reference and len(self._recent_exchange) >= n:
            med_x = statistics.median(self._recent_exchange)
            # faster only: a fall shows in the step test, and a small exchange's time on a shaped, steady
            # link has two modes (likely the shaper's burst allowance; see the docstring)
            if med_x * sv <= ref_x and ref_x - med_x >= EXCHANGE_SHARE * self._reference:
                test, what = "exchange", f"the last {n} steps' exchanges took {1e3 * med_x:.1f} ms (median)"
                basis = f"{1e3 * ref_x:.1f} ms in the reference window (step {1e3 * self._reference:.1f} ms)"
        if test is None:
            return
        rank_zero_info(f"lightning_gc auto: {what} against {basis} (at least {sv:g}x apart): re-deciding")
        # the step test saw a fall, or a rise, of 2x or more: the link most likely moved, and a check would only
        # add its message to the probe. A faster exchange may come from an unchanged link (see the docstring):
        # the check (one message above any burst allowance) tells, and spares the probe
        drift_wall = {"steps": statistics.median(self._recent), "step": self._recent[-1]}.get(test)
        self._decide(step, "drift", probe=True, check_link=test == "exchange", drift_wall_s=drift_wall, detail=test)
        self._t_prev_end = time.perf_counter()  # the decision is not a step

    def _one_step_fell(self) -> bool:
        """The one-step test: a dense mode runs, and the newest agreed wall (:attr:`_recent`, not a
        step :meth:`mark_wall` named) is ``ONE_STEP_FACTOR · severe_drift`` times its reference or
        more; before the reference window, its calibrated prediction (as :meth:`_link_moved_under`).
        Why the prediction too: on ``cnn`` width 16 a dense sibling's trial had just ended when the
        link fell, and fp16's reference window was not measured yet: three ~2 s steps ran before the
        test of the last 3 saw it (docs/auto.md). Slower only: a dense mode's step is the one a fall
        inflates by the whole exchange; a faster link under it is seen by the test of the last
        ``severe_steps``."""
        sv = self.config.severe_drift
        ref = self._reference if self._reference is not None else self._calibrated_prediction()
        if not self._recent or ref is None or not sv or self.chosen is None:
            return False
        if candidate(self.chosen).compressor is not None or self._recent_step in self._marked_walls:
            return False
        return self._recent[-1] >= ONE_STEP_FACTOR * sv * ref

    def _read_carried(self) -> None:
        """Read the wall still pending (handed to the engine at the step before, carried in this step's
        messages; see :meth:`_agree_wall_later`): into :attr:`_carried_walls` for the windows, and, unless
        it is the last decision's step or the switch's first step, into the severe test's last walls.
        Idempotent within a step (nothing pending after the first call)."""
        if self._recent_pending is None:
            return
        at, read = self._recent_pending
        self._recent_pending = None
        value = read()
        self._carried_walls[at] = value
        for old in [k for k in self._carried_walls if k < at - 4 * max(self.config.window, 1)]:
            del self._carried_walls[old]
        last = self._last_decision_step if self._last_decision_step is not None else -10**9
        n = self.config.severe_steps
        if n and value is not None and at > last + 1:  # not the decision's step, nor the switch's first step
            self._recent = (self._recent + [value])[-n:]
            self._recent_step = at
        if self._marked_walls:  # usually empty: an epoch's first step, a checkpoint
            self._marked_walls = {s for s in self._marked_walls if s >= at}

    def _window_median(self, step: int) -> float:
        """The median step of the window that ends at ``step`` (:attr:`_window`, this rank's walls),
        the same on every rank. From the walls carried in the steps' own messages where every one of
        them arrived: the window shifted one step back (steps ``step - len .. step - 1``: the last
        one's wall arrives with the next step), the mean over ranks of each step, no collective. Else
        (a lost wall: a resume, a step not carried) the median of this rank's walls, agreed as the MAX
        over ranks: a blocking all-reduce. Why: on ``mlp`` on 4 unshaped ranks that all-reduce took
        ~4 ms every 5 steps, 0.8 ms of the chooser's 2.3 ms per step (docs/auto.md)."""
        n = len(self._window)
        carried = [self._carried_walls.get(s) for s in range(step - n, step)]
        if n and all(v is not None for v in carried):
            return statistics.median(carried)
        engine = self.engine
        return agree_values([statistics.median(self._window)], "max", engine.process_group, engine.device)[0]

    def _agree_wall_later(self, step: int, wall: float) -> Callable[[], float | None]:
        """Hand step ``step``'s ``wall`` to the engine; the returned function reads its mean over the
        ranks at the next step's end (None if it was lost: see below). It rides in the next step's
        messages, at no message of its own (:meth:`GCEngine.carry_wall`): a compressed step's closing
        report, or a dense step's first gradient bucket (:meth:`GCEngine.enable_dense_carry`; in the
        bucket's dtype, so about 3 significant digits under a 16-bit mode). Why: a separate 8-byte
        all-reduce per step is one more latency-bound collective on the process group the exchanges
        use; at 20 Mbit/s auto's Top-k steps took 1.1-3.5 ms (3-10 %) longer with it than without the
        every-step test, and on the ``mlp`` preset on unshaped ranks auto's 16-bit steps took
        1.5-2 ms more (docs/auto.md). A rank that lost its value (a resume) makes it None on every
        rank, and the test skips it (the step after a decision is left out anyway).

        **Under a dense mode** on up to 8 ranks off NCCL the wall is agreed now instead, by a direct
        exchange of its own (one message latency; lightning_gc/comm/direct.py), and the returned
        function gives that mean. Why: carried in the next step's first bucket, a wall was read one
        step late, so a link that fell under a dense mode cost two dense steps at the fallen rate
        before the one-step test could act (``mlp`` at 10 Mbit/s: 2.9 s and 3.4-3.7 s); agreed now,
        the test acts at the end of the first. The exchange costs ~1 ms on 4 ranks of this project's
        2-core machine, where gloo's ring all-reduce of the same 8 bytes took 1.5-2 ms of a 43 ms
        16-bit step (docs/auto.md). **With the link canary on** (:attr:`canary`) too: the canary sees
        a fall that comes before the next step, the wall one that came during this step. Why: the
        wall rode in the next step's canary at first, and a link that fell inside a dense step
        (``lightning-gc bench --change-in-step``) cost that step and then the canary's stopped step
        after it (``mlp`` 1.40-1.51x the best static method's mean step, against the default's
        1.18-1.44x in the same rounds; docs/auto.md, "The link canary")."""
        engine = self.engine
        if self._dense_agreed_now():
            value = agree_values([wall], "mean", engine.process_group, engine.device)[0]
            return lambda: value
        engine.carry_wall(wall)

        def carried() -> float | None:
            stats = engine.last_step
            return stats.carried_wall_mean_s if stats is not None and stats.step == step + 1 else None
        return carried

    def _dense_agreed_now(self) -> bool:
        """Whether a step's wall is agreed at its own end (a dense mode runs, on a group that takes the
        direct exchange, with or without the link canary; :meth:`_agree_wall_later`), not carried
        into the next step. Replicated."""
        return self._dense_walls_direct and self._dense_mode_runs()

    def _sing_switch_check(self) -> dense_stop.CanaryResult:
        """One canary message (:class:`LinkCanary`, twice where the first says "fell") on the training thread,
        between steps, on every rank alike (a collective; the decision that calls it is replicated, and has
        synchronized the engine already)."""
        engine = self.engine
        assert self._switch_check is not None
        return dense_stop.sing(self._switch_check, math.nan, self.network, engine.exchange_group, engine.world_size,
                               engine.device)

    def _canary_due(self) -> bool:
        """Whether the link canary goes before the next step (a dense mode runs, the canary is on).
        Replicated."""
        return self._dense_walls_direct and self.canary is not None and self._dense_mode_runs()

    def _dense_mode_runs(self) -> bool:
        return self.chosen is not None and candidate(self.chosen).compressor is None

    def _check_drift(self, step: int) -> None:
        window_exchange, self._window_exchange = self._window_exchange, []
        if self._settling:  # the first window after a decision holds the switch itself: not a reference
            self._settling, self._window = False, []
            return
        med = self._window_median(step)
        self._window = []
        last = self._last_decision_step if self._last_decision_step is not None else -10**9
        if self._reference is None:
            if self._link_moved_under([med]):
                # not a reference: a step measured across a link change would hide that change from
                # every later window. Re-decided with a probe (severe: see _severe_held)
                if not self._severe_held(step):
                    rank_zero_info(f"lightning_gc auto: {self.chosen!r} ran {1e3 * med:.1f} ms, predicted "
                                   f"{1e3 * self.predictions[self.chosen].step_s:.1f} ms from its own measured "
                                   f"step on this link: the link moved, re-deciding")
                    self._decide(step, "drift", probe=True, check_link=False, drift_wall_s=med,
                                 detail="reference_window")
                return
            self._reference = med
            self._run_medians = [med]
            n = self.config.severe_steps
            # the window's fastest exchange, not its median: a small exchange's time on a steady shaped link
            # has two modes (see _check_severe_steps), and a reference in the slow one made the fast one
            # look like a link that came back
            self._reference_exchange = min(window_exchange) if n and len(window_exchange) >= n else None
            if self.history:
                self.history[-1]["measured_step_s"] = med
            self._calibrate(step, med)
            return
        moved = abs(med - self._reference) / self._reference > self.config.drift if self._reference > 0 else False
        self._drifted = self._drifted + 1 if moved else 0
        self._run_medians.append(med)
        sv = self.config.severe_drift
        severe = bool(sv) and factor_apart(med, self._reference, sv)
        last_link = self._last_link_step if self._last_link_step is not None else last
        if self.config.probe_every and step - last_link >= self._link_interval:
            self._decide(step, "periodic", probe=True)
            return
        moderate = self._drifted >= self.config.patience and step - last >= self.config.min_interval
        if moderate or (severe and not self._severe_held(step)):
            why = (f"at least {sv:g}x in one window" if severe and self._drifted < self.config.patience else
                   f"drift > {100 * self.config.drift:.0f}% for {self._drifted} windows")
            rank_zero_info(f"lightning_gc auto: step {1e3 * med:.1f} ms vs {1e3 * self._reference:.1f} ms after the last "
                           f"decision ({why}): re-deciding")
            # a window at severe_drift x or more: the link most likely moved, and a check would only add
            # its message to the full probe (on a link that fell to 10 Mbit/s, 0.2 s on the quickstart MLP)
            self._decide(step, "drift", probe=True, check_link=not severe, drift_wall_s=med,
                         detail="severe_window" if severe else "window")

    def _severe_held(self, step: int) -> bool:
        """Whether a severe re-decision (any test of ``severe_drift``: a window, the last steps, a
        reference window, the exchange) must wait: within ``min_interval`` steps of the last severe
        one. Not after other decisions (see ``min_interval`` in :class:`AutoConfig`). From the
        history, so a checkpoint carries it and every rank reads the same."""
        last = next((h["step"] for h in reversed(self.history) if h.get("drift_test") in SEVERE_TESTS), None)
        return last is not None and step - last < self.config.min_interval

    # ------------------------------------------------------------------ measurement
    def _first_decision(self, step: int) -> None:
        engine = self.engine
        engine.synchronize()
        self._remove_hooks()
        if not self._profile:
            raise RuntimeError(
                "lightning_gc auto: no dense step could be profiled (every gradient must reach backward on every "
                "step); pass find_unused_parameters=False models, or raise auto_profile_steps/warmup_steps.")
        prof = self._profile
        order = prof[-1]["order"]
        n = len(self.params)
        # per-tensor ready times in the last profile's order (medians over steps), then durations
        ready_by_param = [statistics.median(p["ready"][p["order"].index(i)] for p in prof) for i in range(n)]
        local = ([statistics.median(p["forward_s"] for p in prof), statistics.median(p["optimizer_s"] for p in prof),
                  statistics.median(p["wall_s"] for p in prof), statistics.median(p["exposed_s"] for p in prof)]
                 + ready_by_param)
        agreed = agree_values(local, "max", engine.process_group, engine.device)
        fwd, opt, wall, exposed = agreed[:4]
        ready = agreed[4:]
        # the ready order is fixed by the first rank's (replicated) view: sort the agreed times
        order = sorted(range(n), key=lambda i: (ready[i], i))
        t_prev, durations = 0.0, []
        for i in order:
            durations.append(max(ready[i] - t_prev, 0.0))
            t_prev = max(ready[i], t_prev)
        self.workload = Workload(fwd, tuple(durations), tuple(self.params[i].numel() for i in order), opt, 0.0)
        self._measure_costs(self._disarm_sample() or {})
        self._last_gain_step = step
        self._decide(step, "warmup", probe=True, dense_wall_s=wall, dense_exposed_s=exposed)

    def _group_sample(self, grads: dict[int, Tensor]) -> tuple[Tensor, GroupContext, float]:
        """The compressed group's local gradient (``grads``: parameter index → this rank's copy) as
        the engine flattens it, its context, and the bytes of the tensors sent exactly beside it.
        A tensor without a gradient on this rank counts as zeros, as the engine sends it."""
        engine = self.engine
        lossy = [g for g in engine.plan.groups if not g.exact]
        exact_bytes = float(sum(4 * n for g in engine.plan.groups if g.exact for n in g.numels))
        g = lossy[0]
        index = {id(p): i for i, p in enumerate(self.params)}
        views = []
        for pid in g.param_ids:
            param = engine.params[pid]
            grad = grads.get(index[id(param)])
            views.append(torch.zeros(param.numel(), device=param.device) if grad is None
                         else grad.reshape(-1).float())
        flat = torch.cat(views)
        ctx = GroupContext(step=engine.step, rank=engine.rank, world_size=engine.world_size, segments=g.numels,
                           group_id=g.gid, seed=engine.config.seed, device=flat.device,
                           shapes=tuple(tuple(engine.params[pid].shape) for pid in g.param_ids), names=g.names)
        return flat, ctx, exact_bytes

    def _measure_costs(self, grads: dict[int, Tensor]) -> None:
        """Every candidate's codec time, payload and error on this rank's local gradient of the last
        profiled step, agreed: MAX of times and payloads (the slowest rank sets a synchronous step),
        the MEAN of the errors (each rank compresses its own gradient; the model's ``delta2/N`` for
        a method without error feedback averages independent per-rank errors). Engine codecs are
        timed here only with ``time_codecs="upfront"`` (else by :meth:`_time_codecs`, on demand)."""
        engine = self.engine
        flat, ctx, exact_bytes = self._group_sample(grads)
        upfront = self.config.time_codecs == "upfront"
        norm2 = squared_norm(flat)  # once for every candidate's error
        local = [measure_method(c, flat, ctx, engine.world_size, self.config.repeats, exact_bytes, time_codec=upfront,
                                norm2=norm2) for c in self.candidates]
        vals = []
        for m in local:
            vals += [m.codec_s, m.payload_bytes]
        agreed = agree_values(vals, "max", engine.process_group, engine.device)
        errors = agree_values([m.delta2 for m in local], "mean", engine.process_group, engine.device)
        self.costs = [MethodCost(m.name, m.wire, agreed[2 * k], agreed[2 * k + 1], errors[k], m.error_feedback,
                                 m.sparse_ratio, m.value_bytes, m.exact_bytes, codec_timed=m.codec_timed)
                      for k, m in enumerate(local)]

    def _time_codecs(self, names: Collection[str],
                     sample: tuple[Tensor, GroupContext, float] | None = None) -> list[str]:
        """Time the untimed codecs among ``names`` with :func:`time_method_codec` on this rank's
        gradients as they are now (the last step's, after its exchange: a codec's time depends on
        the sizes, not the values; ``sample``: that group sample, taken already), agree the MAX and
        store it; returns the names timed. Called on every rank alike: whether a decision needs it
        depends on agreed values only."""
        engine = self.engine
        assert self.costs is not None
        untimed = [k for k, c in enumerate(self.costs) if not c.codec_timed and c.name in names]
        if not untimed:
            return []
        flat, ctx, _ = sample or self._live_sample()
        by_name = {c.name: c for c in self.candidates}
        local = [time_method_codec(by_name[self.costs[k].name], flat, ctx, engine.world_size, self.config.repeats)
                 for k in untimed]
        agreed = agree_values(local, "max", engine.process_group, engine.device)
        for k, s in zip(untimed, agreed):
            self.costs[k] = replace(self.costs[k], codec_s=float(s), codec_timed=True)
        return [self.costs[k].name for k in untimed]

    def _live_sample(self) -> tuple[Tensor, GroupContext, float]:
        """The group sample (:meth:`_group_sample`) of the gradients as they are now."""
        return self._group_sample({i: p.grad for i, p in enumerate(self.params) if p.grad is not None})

    def _model_inputs(self) -> tuple[dict[str, float], list[str], list[str], float]:
        """What a decision predicts with besides the costs, the workload and the network: the valid
        corrections, the methods settled on this link, the compute shift's basis and the shift."""
        valid = self._valid_corrections()
        windowed = self._windowed()
        settled = sorted(windowed & set(valid))
        shift_from = self._shift_basis(windowed, settled)
        shift = compute_shift([self._corrections[m] for m in shift_from]) if self.config.compute_shift else 0.0
        return valid, settled, shift_from, shift

    def _check_gain(self, step: int, grads: dict[int, Tensor]) -> None:
        """Measure the candidates' errors again on this step's local gradients (agreed mean, as at the
        warm-up) and re-decide (trigger ``"gain"``, no probe) if some measured candidate's progress
        per step moved by more than ``gain_drift`` from what the last decision used.

        Only the candidates that could win are measured (branch and bound on the error): the running
        method first, then every candidate whose predicted step (the gain decision's own model, in
        which the error does not enter the step) is at most the least time per unit of progress
        among those measured. A candidate above that bound loses whatever its error (its time per
        progress is its step over an efficiency of at most 1); its stored error stays, marked in
        ``gain_checks[].skipped``. Why: every error measured is CPU on the step's critical path (4 ranks
        share 2 cores on this project's machine); on ``mlp`` at 10 Mbit/s five of the six candidates'
        predicted steps were 2.7-57x the pick's time per progress, and measuring the pick alone took
        that step from 204-206 ms to 140-177 ms, against ~60 ms steps (docs/auto-measurements.md).
        Every rank measures the same candidates: the bound is computed from agreed values only."""
        engine = self.engine
        assert self.costs is not None and self.workload is not None and self.network is not None
        flat, ctx, _ = self._group_sample(grads)
        ws, w = engine.world_size, self.config.progress_weight
        valid, settled, _, shift = self._model_inputs()
        _, preds = choose_measured(self.costs, valid, self.workload, self.network, ws, w, shift_s=shift,
                                   settled=settled)
        step_s = [preds[c.name].step_s for c in self.costs]
        errors: dict[int, float] = {}
        norm2 = squared_norm(flat)  # once for every candidate's error

        def measure(ks: list[int]) -> None:
            vals = agree_values([measure_error(self.candidates[k], flat, ctx, norm2=norm2) for k in ks], "mean",
                                engine.process_group, engine.device)
            errors.update(zip(ks, vals))

        names = [c.name for c in self.costs]
        first = names.index(self.chosen) if self.chosen in names else min(range(len(names)), key=step_s.__getitem__)
        measure([first])
        bound = min(step_s[k] / efficiency(replace(self.costs[k], delta2=d2), ws, w) for k, d2 in errors.items())
        rest = [k for k in range(len(names)) if k not in errors and step_s[k] <= bound]
        if rest:
            measure(rest)
        skipped = [names[k] for k in range(len(names)) if k not in errors]
        moved = 0.0
        for k, d2 in errors.items():
            old = self.costs[k]
            before, after = efficiency(old, ws, w), efficiency(replace(old, delta2=d2), ws, w)
            moved = max(moved, abs(after - before) / before)
        act = moved > self.config.gain_drift
        entry = {"step": step, "delta2": {names[k]: errors[k] for k in sorted(errors)}, "moved": moved,
                 "redecided": act, "skipped": skipped, "bound_s": bound}
        self.gain_checks.append(entry)
        self._last_gain_step = step
        running = self.chosen
        if act:
            self.costs = [replace(c, delta2=errors[k]) if k in errors else c for k, c in enumerate(self.costs)]
            rank_zero_info(f"lightning_gc auto: the candidates' errors moved (progress per step by up to "
                           f"{100 * moved:.0f}%): re-deciding")
            self._decide(step, "gain", probe=False)
        # the pick stood (the errors stayed put, or moved and the re-decision kept the method): look again twice
        # as late (gain_every_max); a switch starts from gain_every
        every, cap = self.config.gain_every, max(self.config.gain_every_max, self.config.gain_every)
        stood = self.chosen == running and bool(self.config.gain_every_max)
        self._gain_interval = min(2 * self._gain_interval, cap) if stood else every
        entry["next_interval"] = self._gain_interval

    # ------------------------------------------------------------------ decision
    def _decide(self, step: int, trigger: str, probe: bool, dense_wall_s: float | None = None,
                force: str | None = None, dense_exposed_s: float | None = None, check_link: bool = True,
                drift_wall_s: float | None = None, detail: str | None = None,
                canary_s: float | None = None) -> None:
        engine = self.engine
        assert self.workload is not None and self.costs is not None
        t0 = time.perf_counter()
        parts = dict.fromkeys(DECIDE_PARTS, 0.0)

        def timed(part: str, fn: Callable[..., Any], *args: Any) -> Any:
            start = time.perf_counter()
            out = fn(*args)
            parts[part] += time.perf_counter() - start
            return out

        engine.synchronize()
        ws = engine.world_size
        ddp = next(c for c in self.costs if c.name == "ddp")
        pinned = engine.network.pinned and engine.network.model is not None
        link_check: dict | None = None  # a re-decision's check of the link before (or instead of) a probe
        source = "pinned" if pinned else "kept"  # where this decision's network came from
        dense_beta = latency = None  # β from a dense step that waited long on the network (dense_probe_s)
        dense = None  # (that step's wall, its wait on the network, the dense method it ran)
        if dense_wall_s is not None and dense_exposed_s is not None:  # the warm-up's profiled DDP step
            dense = (dense_wall_s, dense_exposed_s, ddp)
        elif drift_wall_s is not None and self.chosen is not None and candidate(self.chosen).compressor is None:
            # a drift window of a dense mode: its median step less the step the model gives it on a free network
            cost = next(c for c in self.costs if c.name == self.chosen)
            free = predict(cost, self.workload, NetworkModel(0.0, 0.0), ws).step_s
            dense = (drift_wall_s, drift_wall_s - free, cost)
        fall_check = self.canary or self._switch_check
        if not pinned and canary_s is not None and self.network is not None and fall_check is not None:
            # the link canary (or the switch check) saw a fall: β from its message, α as last looked at; never
            # faster than the model that gave the message far less time
            alpha0, latency_bytes = self.network.alpha_s, 0
            dense_beta = max((canary_s - alpha0) / ((ws - 1) * fall_check.nbytes), self.network.beta_s_per_byte)
        elif not pinned and probe and dense is not None and self.config.dense_probe_s \
                and dense[1] >= self.config.dense_probe_s:
            if dense_wall_s is None and self.network is not None:
                # a dense mode's drifted window: α from the last look at the link, no latency round. Why: right
                # after the steps of a fallen link that round took 38-73 ms on the quickstart MLP and 0.33-0.49 s
                # on `mlp` (10 Mbit/s), and the β solved from a step that waited 0.1 s or more on the network
                # barely depends on α; a probe measures α again at the next periodic look (docs/auto.md)
                alpha0, latency_bytes = self.network.alpha_s, 0
            else:
                latency = timed("latency", self._probe_latency)
                # agreed before β is solved from it, so that every rank solves the same equation
                alpha0 = agree_values([latency.min_times_s[0]], "max", engine.process_group, engine.device)[0]
                latency_bytes = latency.sizes_bytes[0]
            # what the model already charges to other_s (calibrated at the warm-up; 0 there) is not the link's
            dense_beta = beta_from_dense_step(dense[0] - self.workload.other_s, self.workload, dense[2], alpha0, ws,
                                              latency_bytes=latency_bytes)
        if pinned:  # network_alpha_s/beta given: no probe, and the user's figures are not recalibrated
            self.network = engine.network.model
        elif dense_beta is not None:  # the dense step measured the link: no bandwidth probe
            alpha = max(alpha0 - dense_beta * latency_bytes, 0.0)
            self.network, self.beta_scale = NetworkModel(alpha, dense_beta), 1.0
            source = "canary" if canary_s is not None else "dense_step"
            # the link check's reference: the model's time for the message a probe would have settled on
            # (modelled_check_s), not a timed one. Without a reference the first periodic re-decision probed
            # in full (0.5 s at 20 Mbit/s on the quickstart MLP); timing it cost 0.27-0.37 s of the decision
            # where the quickstart's link fell to 10 Mbit/s, a message that decision did not need
            # (docs/auto.md). The first check's own time replaces it.
            self.probe_bytes = check_bytes(self.network, self._probe_start())
            self.probe_time_s, self.probe_time_modelled = modelled_check_s(self.network, self.probe_bytes), True
        elif probe or self.network is None:
            source = "probe"
            if check_link and probe and dense_wall_s is None and self.network is not None and self.config.probe_check \
                    and self.probe_bytes > 0 and self.probe_time_s > 0:
                (check_s, check_beta), retimed = timed("check", self._check_link), False
                if not link_unchanged(check_s, self.probe_time_s, self.config.probe_check):
                    # a message that looks moved is timed once more and the faster kept: this host's
                    # scheduling only adds time. One check on `lm` at 20 Mbit/s read 0.40 s against
                    # 0.12 s, the full probe that followed read the link at half its rate, and auto
                    # left the method it was on (docs/auto.md). Every rank agreed the first time, so
                    # every rank times the second message.
                    (check_s, check_beta), retimed = min((check_s, check_beta), timed("check", self._check_link)), True
                link_check = {"check_s": check_s, "probe_s": self.probe_time_s, "bytes": self.probe_bytes,
                              "unchanged": link_unchanged(check_s, self.probe_time_s, self.config.probe_check),
                              "retimed": retimed, "reference": "modelled" if self.probe_time_modelled else "measured"}
                source = "check" if link_check["unchanged"] else "probe"
                if link_check["unchanged"] and self.probe_time_modelled:  # measured on the same link: the reference
                    self.probe_time_s, self.probe_time_modelled = check_s, False
                if not link_check["unchanged"] and check_s >= PROBE_TARGET_S / 4 and check_beta > 0:
                    # moved, and the check's message is bandwidth-bound at its size (where the probe would
                    # stop growing it): the check was one round of the probe's measurement. β from its
                    # slope, α kept (a latency round timed now would wait behind the check's bytes in the
                    # shaper's queue). Why: when the quickstart's link fell to 10 Mbit/s under a periodic
                    # re-probe, the full probe after the check made that step 1.79 s (docs/auto.md)
                    self.network = NetworkModel(self.network.alpha_s, check_beta * self.beta_scale)
                    self.probe_time_s, self.probe_time_modelled, source = check_s, False, "check_slope"
                    link_check["beta_s_per_byte"] = check_beta
            if source == "probe":  # no check, or a moved one that could not measure β itself
                probed = timed("probe", self._probe, latency)
                if dense_wall_s is not None:  # the profiled DDP step bounds the link's β from above
                    beta = calibrate_beta(dense_wall_s, self.workload, ddp, probed, ws)
                    self.beta_scale = beta / probed.beta_s_per_byte if probed.beta_s_per_byte > 0 else 1.0
                self.network = NetworkModel(probed.alpha_s, probed.beta_s_per_byte * self.beta_scale)
        if not engine.network.pinned:
            engine.adopt_network(self.network)  # AR-Topk's per-step choice uses it; auto owns re-probing
        if dense_wall_s is not None:
            other = calibrate_other(dense_wall_s, self.workload, ddp, self.network, ws)
            w = self.workload
            self.workload = Workload(w.forward_s, w.backward_s, w.numels, w.optimizer_s, other)
            # the profiled steps ran DDP's path and `other` makes its prediction their wall: measured
            self._corrections.setdefault("ddp", 0.0)
            self._correction_beta.setdefault("ddp", self.network.beta_s_per_byte)
        running_figure = self._running_figure(trigger, source)
        if trigger not in ("calibration", "family"):  # a new decision: the model's pick, a fresh exploration budget
            self._explore_left = self.config.explore
        explore = trigger not in ("calibration", "family") or self._explore_left > 0
        valid, settled, shift_from, shift = self._model_inputs()
        best, preds = choose_measured(self.costs, valid, self.workload, self.network, ws,
                                      self.config.progress_weight, explore=explore, shift_s=shift, settled=settled)
        timed_codecs: list[str] = []
        sample = None
        while force is None and not next(c for c in self.costs if c.name == best).codec_timed:
            # the best is a lower bound: time its codec and decide again, until the best is timed. The
            # others' bounds lost to it already and only grow when timed, so a timed best is the pick
            # timing every codec would give (branch and bound). Not every untimed codec at once: on the
            # quickstart MLP at 10-20 Mbit/s that took 44-53 ms of a decision (4 ranks on 2 cores)
            sample = sample or timed("codecs", self._live_sample)
            timed_codecs += timed("codecs", self._time_codecs, [best], sample)
            best, preds = choose_measured(self.costs, valid, self.workload, self.network, ws,
                                          self.config.progress_weight, explore=explore, shift_s=shift,
                                          settled=settled)
        held = None
        if force is not None:  # a dense sibling's trial window (see _dense_sibling): every prediction as usual
            best = force
        else:
            if best not in valid and trigger != "gain":  # an unmeasured method must lead by explore_margin
                best = self._explore_or_stay(best, preds, settled)
            if trigger == "calibration" and best not in valid:
                self._explore_left -= 1
            if trigger != "calibration":  # a calibration compares two recent windows: see _hold_or_switch
                best, held = self._hold_or_switch(best, preds, settled)
            elif self.in_family_trial and best == self.chosen:  # the sibling would stay: the interrupted mode holds
                best, held = self._hold_or_switch(best, preds, settled, self.history[-1].get("previous"))
        switch_check = None
        if (trigger in SWITCH_CHECK_TRIGGERS and not probe and canary_s is None and self._switch_check is not None
                and self.network is not None and self.chosen is not None and best != self.chosen
                and candidate(best).compressor is None and candidate(self.chosen).compressor is not None):
            # about to leave a compressed method for a dense mode on a network last looked at earlier: a link that
            # fell meanwhile would cost a whole dense step at the fallen rate before the one-step test
            res = timed("check", self._sing_switch_check)
            switch_check = {"fell": res.fell, "fastest_s": res.fastest_s, "predicted_s": res.predicted_s,
                            "messages": res.messages, "bytes": self._switch_check.nbytes}
            if res.fell:
                rank_zero_info(f"lightning_gc auto: before leaving {self.chosen!r} for {best!r} ({trigger}), one "
                               f"{self._switch_check.nbytes} B message per rank took {1e3 * res.fastest_s:.1f} ms on the "
                               f"fastest rank (twice), {1e3 * (res.predicted_s or 0.0):.2f} ms on the network model: the "
                               "link fell, re-deciding on it")
                self._decide(step, "drift", probe=True, check_link=False, canary_s=res.fastest_s, detail="switch_check")
                if self.history:
                    self.history[-1]["switch_check"] = switch_check
                return
        previous = self.chosen
        if best != previous:
            self._apply(best)
            self._gain_interval = self.config.gain_every  # a new method: its errors looked at as often as at first
        self.chosen, self.predictions = best, preds
        # a decision that keeps the method on the link it measured keeps its references: a calibration (it was
        # just measured), and a periodic or gain re-decision that did not measure the link anew (a link check
        # that found it unchanged, or the stored network). Why: the reference window after such a decision
        # measured whatever came next as the new normal; on the quickstart MLP the periodic re-probe kept
        # `lowrank` one step before 10 Mbit/s went back to 1 Gbit/s, and `lowrank` ran to the end of the run
        # on the fast link where fp16 runs at half its step (docs/auto.md)
        kept = best == previous and self._reference is not None and (
            trigger == "calibration" or (trigger in ("periodic", "gain") and source in ("check", "kept", "pinned")))
        if not kept:
            self._reference, self._drifted, self._window, self._settling = None, 0, [], True
            self._run_medians = []
            self._recent, self._recent_exchange, self._reference_exchange = [], [], None
            self._window_exchange = []
        self._last_decision_step = step
        if probe or dense_wall_s is not None:
            self._last_link_step = step
            # a periodic look that found the link as it was and kept the method: look again twice as late
            # (probe_every_max); anything else that looked at the link starts from probe_every again
            calm = trigger == "periodic" and source in ("check", "pinned") and best == previous
            cap = max(self.config.probe_every_max, self.config.probe_every)
            self._link_interval = (min(2 * self._link_interval, cap)
                                   if calm and self.config.probe_every_max else self.config.probe_every)
        entry = {"step": step, "trigger": trigger, "chosen": best, "previous": previous,
                 "network": [self.network.alpha_s, self.network.beta_s_per_byte], "probe_bytes": self.probe_bytes,
                 "beta_scale": self.beta_scale, "link_check": link_check, "network_source": source,
                 "dense_exposed_s": dense_exposed_s,
                 "workload": self.workload.as_dict(), "costs": [c.as_dict() for c in self.costs],
                 "predictions": {k: v.as_dict() for k, v in preds.items()},
                 # a decision that kept its reference was measured by it already
                 "dense_wall_s": dense_wall_s, "measured_step_s": self._reference if kept else None,
                 "kept_reference": kept,
                 "corrections": dict(valid), "settled": settled, "shift_s": shift, "shift_from": shift_from,
                 "explore_left": self._explore_left,
                 # steps from the last look at the link to the next periodic re-decision (probe_every_max)
                 "link_interval": self._link_interval,
                 # the codecs this decision timed, in order (each one's lower bound was the best when it was
                 # timed; time_codecs="on_demand")
                 "timed_codecs": timed_codecs,
                 # a measured method that led the running one by less than switch_margin, which stayed (at the
                 # end of a dense sibling's trial: the sibling, which led the mode it interrupted by less)
                 "held_by_margin": held,
                 # the running method's figure from all its windows since its reference (None: not used)
                 "running_figure_s": running_figure,
                 # which test saw a drift: "window" (moderate, patience), "severe_window", "steps", "step",
                 # "exchange" (severe_steps), "reference_window"
                 "drift_test": detail,
                 # a gain or calibration move from a compressed method to a dense mode timed the link first
                 # (_switch_check): what it saw (None: no such move, or no check on this group)
                 "switch_check": switch_check}
        # replicated state: the slowest rank's times, like every other figure here (one agreement for all)
        took = agree_values([time.perf_counter() - t0] + [parts[k] for k in DECIDE_PARTS], "max",
                            engine.process_group, engine.device)
        entry["decide_s"] = took[0]
        entry["decide_parts_s"] = dict(zip(DECIDE_PARTS, took[1:]))
        self.history.append(entry)
        bw = self.network.bandwidth_bits_per_s
        checked = "" if link_check is None else (
            f" (link check: {1e3 * link_check['check_s']:.1f} ms vs {1e3 * link_check['probe_s']:.1f} ms "
            f"{'modelled after a dense step measured the link' if link_check['reference'] == 'modelled' else 'at the last probe'}"
            f", {'unchanged, not re-probed' if link_check['unchanged'] else 'changed, β from the check' if source == 'check_slope' else 'changed, re-probed'})")
        shifted = (f"methods not yet measured predicted {1e3 * -shift:.1f} ms under the raw model (the least "
                   f"speed-up of {', '.join(shift_from)}); ") if shift else ""
        notes = (f"timed the codecs of {', '.join(timed_codecs)} (their lower bound led); "
                 if timed_codecs else "")
        if held is not None:
            kept_mode = "the mode its trial interrupted comes back" if held == previous else "the running method stays"
            notes += (f"{held!r} leads by less than switch_margin "
                      f"({100 * self.config.switch_margin:g}%), so {kept_mode}; ")
        head = (f"lightning_gc auto ({trigger}, step {step}): network α={1e3 * self.network.alpha_s:.3f} ms, "
                f"{bw / 1e6:.1f} Mbit/s{checked}; {shifted}{notes}")
        if best == previous:
            nxt = (f"; next periodic look at the link in {self._link_interval} steps"
                   if trigger == "periodic" and self.config.probe_every else "")
            rank_zero_info(head + f"kept {best!r} (predicted {1e3 * preds[best].step_s:.1f} ms/step){nxt}")
        else:
            rank_zero_info(head + f"chose {best!r}" + (f" (was {previous!r})" if previous else "") + "\n"
                           + table(preds, best))

    def _explore_or_stay(self, best: str, preds: dict, settled: list[str]) -> str:
        """``best``, an unmeasured method the plain minimum would install, if its predicted time per
        unit of progress leads the best method measured in a window on this link (``settled``) by at
        least ``explore_margin``; else that measured method (ties to the earlier candidate). Without
        such a method (the warm-up, a link that moved) the plain minimum stands."""
        measured = [c for c in self.config.candidates if c in settled and c in preds]
        if not measured:
            return best
        stay = min(measured, key=lambda c: preds[c].time_per_progress_s)
        return best if _lead(preds, best, stay) >= self.config.explore_margin else stay

    def _hold_or_switch(self, best: str, preds: dict, settled: list[str],
                        incumbent: str | None = None) -> tuple[str, str | None]:
        """``(best, None)``, or ``(running, best)`` when ``best`` would replace the running method
        while both were measured in a window on this link (``settled``) and ``best``'s predicted time
        per unit of progress is less than ``switch_margin`` below the running method's
        (``AutoConfig.switch_margin``: the running one's figure is the fresher one).

        ``incumbent``: at the calibration that ends a dense sibling's trial, when the sibling would
        stay, the mode the trial interrupted, which holds in the running method's place: the
        sibling replaces it only on a lead of ``switch_margin``, the bar any switch between
        measured methods has to clear (another measured method is taken as any calibration takes
        the faster). Why: the two figures are single 5-step windows, ten steps apart. On ``cnn``
        width 16, ``gpt`` and ``lm`` at 1 Gbit/s (one round each) DDP's trial window led fp16's by
        2.5 %, 2.1 % and 2.7 %, auto kept DDP for the rest of the run, and the static runs of the
        same rounds had fp16 3.8 %, 0.3 % and 3.4 % faster than DDP (docs/auto-measurements.md).
        Not at other calibrations, whose purpose is to take the faster of two recent figures."""
        running = self.chosen if incumbent is None else incumbent
        if running is None or best == running or best not in settled or running not in settled or running not in preds:
            return best, None
        return (best, None) if _lead(preds, best, running) >= self.config.switch_margin else (running, best)

    def _calibrate(self, step: int, measured_s: float) -> None:
        """Every reference window sets the running method's correction: its measured step minus the
        raw model's prediction (what the model does not see: the engine's worker and agreements,
        Python per step, contention, its own collective), tagged with the network it was measured on.
        If the method had no valid correction before (it had not run, or only on another network),
        the choice is made again at once without a new probe (trigger ``"calibration"``): see
        :func:`choose_measured`. So it is, too, after a re-decision that switched to a method
        already measured here (:meth:`_switched_on_an_older_figure`). Otherwise a method already
        measured on this network just keeps the newer figure (no re-decision; at a later decision
        ``switch_margin`` keeps two measured methods from taking turns, see :meth:`_hold_or_switch`)."""
        chosen = self.chosen
        assert chosen is not None and self.costs is not None and self.network is not None
        was_valid = chosen in self._valid_corrections()
        # the last decision's predictions used the corrections (and shift) its history entry records
        raw = self.predictions[chosen].step_s - _overhead_in(self.history[-1], chosen)
        self._corrections[chosen] = measured_s - raw
        self._correction_beta[chosen] = self.network.beta_s_per_byte
        if self.in_family_trial:  # the sibling's window: choose among what has been measured
            self._decide(step, "calibration", probe=False)
            return
        sibling = self._dense_sibling(chosen, measured_s - raw, measured_s)
        if sibling is not None:
            self._decide(step, "family", probe=False, force=sibling)
            return
        if not was_valid or self._switched_on_an_older_figure():
            self._decide(step, "calibration", probe=False)

    def _running_figure(self, trigger: str, source: str) -> float | None:
        """At a ``gain`` or ``periodic`` re-decision on the link the running method was measured on
        (the network kept, or a link check that found it unchanged), set the running method's
        correction from the median of its windows since its reference window (at least
        :data:`RUN_FIGURE_MIN_WINDOWS` of them), not from the reference window alone; returns that
        median (None when not used). Replicated: the windows' medians are agreed.

        Why: one 5-step window on a host shared by 4 ranks is off by 10-20 % often enough to decide.
        On ``cnn`` width 16 at 1 Gbit/s the 16-bit mode's reference window read 200.7 ms while its
        next 50 steps averaged 169.5 ms; the ``gain`` re-decision at step 72 weighed the 200.7 ms
        against DDP's 193.0 ms and switched, and DDP ran 174-183 ms from there
        (docs/auto-measurements.md)."""
        chosen = self.chosen
        if (trigger not in ("gain", "periodic") or source not in ("check", "kept", "pinned") or chosen is None
                or chosen not in self._corrections or len(self._run_medians) < RUN_FIGURE_MIN_WINDOWS
                or not self.history or chosen not in self.predictions):
            return None
        figure = statistics.median(self._run_medians)
        raw = self.predictions[chosen].step_s - _overhead_in(self.history[-1], chosen)
        self._corrections[chosen] = figure - raw
        return figure

    def _switched_on_an_older_figure(self) -> bool:
        """Whether the last decision replaced the running method by another one at a re-decision
        (``gain``, ``periodic``, ``drift``), not at a calibration. Such a decision weighed the
        running method's fresh figure against the other's older one (the other had one on this
        link; a method without one is calibrated by its first window anyway). Its first window then
        decides again (trigger ``"calibration"``): two figures a window apart, the faster kept. Not
        after a calibration's own switch (it compared two recent windows already), so this adds at
        most one decision per re-decision, and no probe.

        Why: on ``cnn`` width 16 at 1 Gbit/s the 16-bit mode was measured at 154.9 ms after step 1
        and at 179.4 ms after step 22, as this host slowed; DDP's figure, 172.4 ms, was from its trial
        at steps 11-20. The ``gain`` re-decision at step 72 moved to DDP on that 4 % lead, DDP's
        window then read 199.0 ms, and DDP ran to the end of the run (docs/auto-measurements.md)."""
        if not self.history:
            return False
        last = self.history[-1]
        # "corrections": the figures that decision had, per method measured on its link
        return (last["trigger"] in ("gain", "periodic", "drift") and last.get("previous") is not None
                and last["previous"] != last["chosen"] and last["chosen"] in (last.get("corrections") or {}))

    @property
    def in_family_trial(self) -> bool:
        """Whether a dense sibling is running its one window (the last decision was its trial)."""
        return bool(self.history) and self.history[-1]["trigger"] == "family"

    @property
    def in_trial(self) -> bool:
        """Whether the running method is on trial, its window not measured yet: a dense sibling's one
        window (:attr:`in_family_trial`), a method an exploration installed (a ``"calibration"``
        decision) that has no correction on this link, or a method a re-decision switched to on an
        older figure (:meth:`_switched_on_an_older_figure`). Derived from the history and the
        corrections, so a checkpoint carries it and every rank reads the same."""
        if not self.history:
            return False
        trigger = self.history[-1]["trigger"]
        return (trigger == "family" or (trigger == "calibration" and self.chosen not in self._valid_corrections())
                or self._switched_on_an_older_figure())

    def _windowed(self) -> set[str]:
        """The methods measured in a window of their own (a decision whose step was then measured),
        not only by the warm-up's profile; derived from the history, so a checkpoint carries it."""
        return {h["chosen"] for h in self.history if h.get("measured_step_s") is not None}

    def _dense_sibling(self, chosen: str, correction: float, measured_s: float) -> str | None:
        """The dense mode to run next for one window (step 6 of the module docstring), or None.

        ``chosen`` must be a dense mode just measured in a window with ``correction``; a sibling
        qualifies if it was not measured in a window of its own on this link and its raw prediction
        plus that correction, per unit of progress, is within ``family_margin`` of ``measured_s`` per
        unit of progress; the best-predicted one is returned."""
        dense = [c for c in self.config.candidates if candidate(c).compressor is None]
        if chosen not in dense or len(dense) < 2:
            return None
        valid, last = self._valid_corrections(), self.history[-1]

        def per_progress(name: str, step_s: float) -> float:
            p = self.predictions[name]
            return step_s * (p.time_per_progress_s / p.step_s) if p.step_s > 0 else step_s

        limit = (1.0 + self.config.family_margin) * per_progress(chosen, measured_s)
        best, best_t, windowed = None, math.inf, self._windowed()
        for name in dense:
            if name == chosen or (name in windowed and name in valid) or name not in self.predictions:
                continue
            t = per_progress(name, self.predictions[name].step_s - _overhead_in(last, name) + correction)
            if t <= limit and t < best_t:
                best, best_t = name, t
        return best

    def _link_moved_under(self, measured: Sequence[float]) -> bool:
        """Whether a reference window's median is ``severe_drift`` times or more off the running
        method's prediction although that prediction carried the method's own correction, measured
        in a window on this link: then the window, not the model, is what changed (the link moved
        between the decision and the window). A method not yet measured so is expected to be off
        (that is what its first window calibrates), and is never judged here.

        Why: on the quickstart MLP, with the link falling from 1 Gbit/s to 10 Mbit/s at step 100,
        auto switched to fp16 (measured before, 19.5 ms) at step 100; the switch's reference window
        fell on the slow link and read 222 ms, and that became the drift reference, so no later
        window looked drifted: fp16 ran 222 ms steps until the periodic re-probe at step 200, where
        Top-k ran 36 ms (docs/auto.md).

        ``measured``: a window's median (one value), or the last few steps' times (the every-step
        test); judged by :func:`steps_apart`."""
        sv, predicted = self.config.severe_drift, self._calibrated_prediction()
        return bool(sv) and predicted is not None and steps_apart(list(measured), predicted, sv)

    def _calibrated_prediction(self) -> float | None:
        """The running method's predicted step when that prediction carries the method's own
        correction, measured in a window on this link (see :meth:`_link_moved_under`); else None."""
        chosen = self.chosen
        if chosen is None or not self.history or chosen not in self.predictions:
            return None
        calibrated = chosen in (self.history[-1].get("corrections") or {}) and chosen in self._windowed()
        return self.predictions[chosen].step_s if calibrated else None

    def _shift_basis(self, windowed: set[str], settled: list[str]) -> list[str]:
        """The methods whose corrections the compute shift is taken from (:func:`compute_shift`):
        the dense modes measured in a window of their own (``windowed``), on any link, if there are
        any; else every method measured in a window on this link (``settled``).

        Why the dense modes: the warm-up profiled a DDP step and fitted ``other`` to it, so a dense
        mode's path is the one the raw model describes best, and its correction is mostly what the
        shift is for, the warm-up's slow compute, which does not depend on the link. A compressed
        method's correction adds its own unmodelled cost, and the least speed-up of all then lets
        that method hold every unmeasured one back. Measured on the quickstart MLP on a link that
        fell from 1 Gbit/s to 10 Mbit/s: fp16 had run 32 ms under the raw model at 1 Gbit/s; on the
        slow link `lowrank`, picked first, ran only 10 ms under it (its own CPU cost), so Top-k was
        predicted 53.6 ms, where static Top-k ran 38 ms in the same run, and was never tried
        (docs/auto.md). A dense correction measured on another link still counts: it is the
        compute part that carries over, and taking the least speed-up keeps it conservative."""
        dense = sorted(m for m in windowed if m in self._corrections and candidate(m).compressor is None)
        return dense if dense else list(settled)

    def _valid_corrections(self) -> dict[str, float]:
        """The corrections measured on a network like the current one. An additive correction holds
        for the link it was measured on: measured on the quickstart MLP, ``lowrank`` ran 24 ms under
        its prediction at a probed 7.5 Mbit/s; carried to the link back at 920 Mbit/s it predicted
        19.8 ms for a method that ran 39.9 ms, and auto stayed on it at 2.3x DDP's step. A correction
        whose network's bandwidth differs from the current one by more than
        :data:`STALE_NETWORK_FACTOR` is left out, and its method is judged by the raw model again
        (and explored, if that favours it)."""
        if self.network is None:
            return dict(self._corrections)
        now = self.network.beta_s_per_byte + _BETA_FLOOR
        out = {}
        for name, corr in self._corrections.items():
            then = self._correction_beta.get(name)
            if then is not None and max(now / (then + _BETA_FLOOR), (then + _BETA_FLOOR) / now) > STALE_NETWORK_FACTOR:
                continue
            out[name] = corr
        return out

    def _probe(self, latency: Any = None) -> NetworkModel:
        """α from 64-byte ring shifts timed before any large message, β from the slope between two
        larger shifts, ``S/4`` and ``S`` bytes (each rank's medians, then the MAX), ``S`` grown from
        :data:`PROBE_START_BYTES` until its message is bandwidth-bound (:func:`next_probe_bytes`).

        Not one least-squares line over interleaved sizes (the probe's default): on tc-shaped links a
        large message's send completes while its bytes still sit in the shaper's queue, and the small
        message timed next waits behind them. Fitted that way, α came out at 1.4-17 ms, and taken from
        the 64-byte message of the interleaved run at 3-105 ms (quickstart, 4 ranks, 1 Gbit/s to
        20 Mbit/s), while Top-k's measured 31 ms steps at 20 Mbit/s, with ~20 α-terms per step in the
        model, bound α below 2 ms; that error alone decided against every engine candidate."""
        engine = self.engine
        small = latency if latency is not None else self._probe_latency()  # the warm-up's may have run already

        rounds = []

        def measure(size: int) -> tuple[float, float]:
            # a warm-up run in the first round only: a grown round reuses the connections it warmed
            # (at 1 MiB + 256 KiB and 1 Gbit/s a warm-up run is ~11 ms)
            large = probe_network(engine.process_group,
                                  ProbeConfig(sizes_bytes=(probe_small_bytes(size), size), warmup=0 if rounds else 1,
                                              repeats=3),
                                  device=engine.device)
            rounds.append(size)
            (s0, s1), (t0, t1) = large.sizes_bytes, large.median_times_s
            beta, t_large = agree_values([max((t1 - t0) / (s1 - s0), 0.0), t1], "max", engine.process_group,
                                         engine.device)
            return beta, t_large

        beta, self.probe_bytes, self.probe_time_s = probe_bandwidth(
            measure, self._probe_start())
        self.probe_time_modelled = False
        # each rank's fastest 64-byte shift, not its median: on 2 cores shared by 4 ranks a median of
        # 2.5 ms was read once where other runs read 0.2-0.3 ms, and with ~20 α-terms per compressed
        # step that alone put every compressor above the 16-bit hook at 20 Mbit/s (docs/auto.md)
        alpha = max(small.min_times_s[0] - beta * small.sizes_bytes[0], 0.0)
        a = agree_values([alpha], "max", engine.process_group, engine.device)[0]
        return NetworkModel(a, beta)

    def _probe_start(self) -> int:
        """The bandwidth probe's first message for this model (:func:`probe_start_bytes`)."""
        return probe_start_bytes(4 * sum(p.numel() for p in self.params))

    def _probe_latency(self) -> Any:
        """The latency round (:data:`PROBE_LATENCY`), timed before any large message; ``min_times_s[0]``
        is this rank's fastest 64-byte shift (not agreed: the caller agrees what it derives)."""
        return probe_network(self.engine.process_group, PROBE_LATENCY, device=self.engine.device)

    def _check_link(self) -> tuple[float, float]:
        """One message of the last probe's size, after its small partner (the order the probe
        times them in), timed on every rank: returns that message's time, compared with the probe's
        by :func:`link_unchanged`, and the slope between the two messages (β, as one round of the
        probe's own measurement would give it; used when the link moved, see :meth:`_decide`), both
        agreed (MAX). About a quarter of a full probe's traffic, and no latency round."""
        engine = self.engine
        size = self.probe_bytes
        small = probe_small_bytes(size)
        r = probe_network(engine.process_group, ProbeConfig(sizes_bytes=(small, size), warmup=0, repeats=1),
                          device=engine.device)
        t0, t1 = r.median_times_s
        slope = max((t1 - t0) / (size - small), 0.0) if size > small else 0.0
        t1, slope = agree_values([t1, slope], "max", engine.process_group, engine.device)
        return t1, slope

    def _apply(self, name: str) -> None:
        engine = self.engine
        cand = candidate(name)
        if cand.compressor is None:
            engine.set_dense_mode(cand.dense_mode)
            return
        for g in engine.plan.groups:
            if not g.exact:
                engine.set_group_method(g.gid, cand.spec())
        engine.set_dense_mode(None)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        return {
            # copies: the state of this moment, not lists that later decisions append to
            "version": 2, "chosen": self.chosen, "history": copy.deepcopy(self.history),
            "workload": self.workload.as_dict() if self.workload is not None else None,
            "costs": [c.as_dict() for c in self.costs] if self.costs is not None else None,
            "network": [self.network.alpha_s, self.network.beta_s_per_byte] if self.network is not None else None,
            "reference": self._reference, "drifted": self._drifted, "settling": self._settling,
            "reference_exchange": self._reference_exchange, "run_medians": list(self._run_medians),
            "corrections": dict(self._corrections), "explore_left": self._explore_left,
            "correction_beta": dict(self._correction_beta),
            "last_decision_step": self._last_decision_step, "last_link_step": self._last_link_step,
            "link_interval": self._link_interval, "gain_interval": self._gain_interval,
            "last_gain_step": self._last_gain_step, "gain_checks": copy.deepcopy(self.gain_checks), "beta_scale": self.beta_scale,
            "sampling": bool(self._sample_handles), "warmup_steps": int(self.engine.config.warmup_steps),
            "probe_bytes": self.probe_bytes, "probe_time_s": self.probe_time_s,
            "probe_time_modelled": self.probe_time_modelled,
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != 2:
            raise ValueError(f"unsupported auto chooser state version {state.get('version')!r}: this version reads 2 "
                             "(version 1, per-family corrections, was written before the per-method ones); resume "
                             "with the lightning_gc that wrote the checkpoint, or start the run anew.")
        self.chosen = state["chosen"]
        self.history = list(state["history"])
        wl = state.get("workload")
        self.workload = None if wl is None else Workload(wl["forward_s"], tuple(wl["backward_s"]), tuple(wl["numels"]),
                                                         wl["optimizer_s"], wl["other_s"])
        costs = state.get("costs")
        self.costs = None if costs is None else [MethodCost(**c) for c in costs]
        net = state.get("network")
        self.network = None if net is None else NetworkModel(*net)
        if self.network is not None and not self.engine.network.pinned:
            self.engine.adopt_network(self.network)
        self._reference, self._drifted = state.get("reference"), int(state.get("drifted", 0))
        self._settling = bool(state.get("settling", True))
        self._corrections = {str(k): float(v) for k, v in state.get("corrections", {}).items()}
        # written before corrections were tagged with their network: every correction counts as current
        self._correction_beta = {str(k): float(v) for k, v in state.get("correction_beta", {}).items()}
        self._explore_left = int(state.get("explore_left", self.config.explore))
        self._last_decision_step = state.get("last_decision_step")
        # written before the periodic re-probe counted from the last look at the link: the last decision
        self._last_link_step = state.get("last_link_step", self._last_decision_step)
        # written before the interval doubled: probe_every
        self._link_interval = int(state.get("link_interval", self.config.probe_every))
        # written before the re-measurement's interval doubled: gain_every
        self._gain_interval = int(state.get("gain_interval", self.config.gain_every))
        # written before the errors were re-measured: the last decision's step stands for the last measurement
        self._last_gain_step = state.get("last_gain_step", self._last_decision_step)
        self.gain_checks = list(state.get("gain_checks", []))
        self._run_medians = [float(v) for v in state.get("run_medians", [])]  # older checkpoints: none yet
        self.beta_scale = float(state.get("beta_scale", 1.0))  # written before the calibration: none
        # written before the link check: no reference, so the next re-decision probes in full
        self.probe_bytes, self.probe_time_s = int(state.get("probe_bytes", 0)), float(state.get("probe_time_s", 0.0))
        self.probe_time_modelled = bool(state.get("probe_time_modelled", False))  # before: always measured
        if self.chosen is not None and state.get("warmup_steps") is not None:  # an early end of the warm-up
            self.engine.shorten_warmup_steps(int(state["warmup_steps"]))
        self._window = []
        self._recent, self._recent_pending = [], None  # walls of the process that saved: not carried
        self._carried_walls = {}
        self._recent_exchange, self._window_exchange = [], []
        self._reference_exchange = state.get("reference_exchange")
        self._t_prev_end = None
        if self.chosen is not None:
            self._remove_hooks()
            self._disarm_sample()
            if state.get("sampling"):  # saved between arming a sampled step and measuring it
                self._arm_sample()
            if self.history:
                preds = self.history[-1]["predictions"]
                self.predictions = {k: Prediction(**v) for k, v in preds.items()}

    def close(self, timeout: float = 60.0) -> None:
        self._remove_hooks()
        self._disarm_sample()
        if self._recent_pending is not None:  # every rank issued it: wait, so no collective is left in flight
            self._recent_pending[1]()
            self._recent_pending = None

    def decisions(self) -> list[dict]:
        """Every decision in brief: step, trigger, the choice, its predicted step, the step measured
        in the first window after it (``None`` until then) and the runner-up (end-of-fit summary)."""
        out = []
        for h in self.history:
            ranked = sorted(h["predictions"].items(), key=lambda kv: kv[1]["time_per_progress_s"])
            runner = ranked[1] if len(ranked) > 1 else None
            out.append({"step": h["step"], "trigger": h["trigger"], "chosen": h["chosen"],
                        "predicted_step_s": h["predictions"][h["chosen"]]["step_s"],
                        "measured_step_s": h.get("measured_step_s"),
                        "runner_up": runner[0] if runner else None,
                        # ranked by a lower bound: its codec was not timed (time_codecs="on_demand")
                        "runner_up_bound": bool(runner and runner[1].get("details", {}).get("lower_bound"))})
        return out

    # ------------------------------------------------------------------ lifecycle (StepSession)
    def on_validation_start(self) -> None:
        self.pause_walls()

    def on_validation_end(self) -> None:
        self.resume_walls()

    def on_train_batch_start(self, batch_idx: int) -> None:
        if batch_idx == 0:  # the epoch's end and start are in this step's wall
            self.mark_wall()

    def on_checkpoint_saved(self) -> None:
        self.mark_wall()
