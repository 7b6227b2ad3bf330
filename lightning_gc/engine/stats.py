"""Per-step statistics and cumulative totals of the engine (this rank's view)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass

#: Exchanges whose own schedule sends some of the engine's compressed steps in another form report
#: the step's phase under one of these ``compressor_metrics`` keys; the codes map to the step's
#: :attr:`StepStats.mode`. GradiVeQ: 0 exact warm-up, 1 PCA sample step (QSGD), 2 compressed.
PHASE_MODES: dict[str, dict[float, str]] = {"gradiveq/phase": {0.0: "dense", 1.0: "sample", 2.0: "compressed"}}


@dataclass
class StepStats:
    """What one optimizer step's communication did on this rank.

    ``gain`` is this step's compression gain Σ_r‖sent_r‖² / Σ_r‖p_r‖² over all ranks (the sums
    travel in the step's closing report), ``None`` on dense and non-finite steps.
    """

    step: int = 0
    dense: bool = True
    ratio: float = 1.0
    bytes_sent: int = 0
    bytes_payload: int = 0
    bytes_dense: int = 0
    bytes_inter_node: int = 0  # of bytes_sent, modelled bytes between nodes (topology="nodes"; 0 when flat)
    compress_time_s: float = 0.0
    comm_time_s: float = 0.0
    error_norm: float = 0.0
    nonfinite: bool = False
    gain: float | None = None
    gain_ewma: float | None = None
    collective: str | None = None  # model-chosen collective(s) of the step, e.g. "art_ring"
    predicted_comm_s: float | None = None  # alpha-beta prediction for the chosen collectives
    exchange_comm_s: float = 0.0  # time inside the compressed exchanges' collectives (after the opening
    # check, which lines the ranks up, so it excludes most of the wait for slower ranks)
    exchange_comm_mean_s: float | None = None  # exchange_comm_s averaged over the ranks (from the step's
    # closing report: identical on every rank, so a decision may use it); None on dense steps
    exchange_comm_mean_step: int | None = None  # the step exchange_comm_mean_s describes: this one, or the
    # step before where the closing report rode in the step's last message (engine/agreement.py)
    carried_wall_mean_s: float | None = None  # the value every rank handed to GCEngine.carry_wall before
    # this step, averaged over the ranks by the step's closing report; None on dense steps and when not
    # every rank carried one
    # a dense step that can stop (engine/dense_stop.py): the check's agreed and predicted times (None where
    # not checked), and whether the step stopped (its compressed groups' gradients became error memory)
    dense_check_s: float | None = None
    dense_check_predicted_s: float | None = None
    dense_check_bytes: int = 0
    dense_stopped: bool = False
    alpha_s: float | None = None  # network model in force
    beta_s_per_byte: float | None = None
    probe_s: float = 0.0  # time spent probing the network during this step
    full_precision: bool | None = None  # Marsit: True on a full-precision round, False on a one-bit
    # round, None when the step ran no Marsit exchange (exchanges report it in ExchangeTimes.full_precision)
    compressor_metrics: dict | None = None  # compressor-specific values of the step, logged as
    # gc/<key> (e.g. GradiVeQ's phase, d per tensor, compression loss; ExchangeTimes.metrics)
    # the engine's own wall time on all its threads (OwnClock), the time in its agreements (opening check,
    # closing report), and the overhead: own time less gradient collectives, codec and probes (step_overhead)
    engine_own_s: float = 0.0
    control_comm_s: float = 0.0
    overhead_s: float = 0.0

    @property
    def mode(self) -> str:
        """What the step really sent: ``"dense"`` (the engine's warm-up, a compressor's own exact
        warm-up, Marsit's full-precision round), ``"sample"`` (GradiVeQ's PCA sample steps, sent
        QSGD-quantised) or ``"compressed"``."""
        if self.dense or self.full_precision:
            return "dense"
        for key, modes in PHASE_MODES.items():
            code = (self.compressor_metrics or {}).get(key)
            if code is not None:
                return modes.get(float(code), "compressed")
        return "compressed"

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Totals:
    steps: int = 0
    compressed_steps: int = 0  # steps whose mode is "compressed" (StepStats.mode)
    sample_steps: int = 0  # steps whose mode is "sample"
    nonfinite_steps: int = 0
    bytes_sent: int = 0
    bytes_payload: int = 0
    bytes_dense: int = 0
    bytes_inter_node: int = 0
    compress_time_s: float = 0.0
    comm_time_s: float = 0.0
    probes: int = 0
    # model-chosen collectives (artopk_auto): predicted vs measured time, and how often each won
    predicted_comm_s: float = 0.0
    exchange_comm_s: float = 0.0
    chose_allgather: int = 0
    chose_art_ring: int = 0
    chose_art_tree: int = 0
    engine_own_s: float = 0.0
    control_comm_s: float = 0.0
    overhead_s: float = 0.0

    def add(self, s: StepStats) -> None:
        self.steps += 1
        mode = s.mode
        self.compressed_steps += int(mode == "compressed")
        self.sample_steps += int(mode == "sample")
        self.nonfinite_steps += int(s.nonfinite)
        self.bytes_sent += s.bytes_sent
        self.bytes_payload += s.bytes_payload
        self.bytes_dense += s.bytes_dense
        self.bytes_inter_node += s.bytes_inter_node
        self.compress_time_s += s.compress_time_s
        self.comm_time_s += s.comm_time_s
        self.probes += int(s.probe_s > 0)
        self.exchange_comm_s += s.exchange_comm_s
        self.engine_own_s += s.engine_own_s
        self.control_comm_s += s.control_comm_s
        self.overhead_s += s.overhead_s
        if s.predicted_comm_s is not None:
            self.predicted_comm_s += s.predicted_comm_s
        for name in (s.collective or "").split("+"):
            if name in ("allgather", "art_ring", "art_tree"):
                setattr(self, f"chose_{name}", getattr(self, f"chose_{name}") + 1)

    def as_dict(self) -> dict:
        return asdict(self)


def step_overhead(own_s: float, comm_s: float, async_comm_s: float, compress_s: float, probe_s: float) -> float:
    """The engine's overhead of a step: its own wall time ``own_s`` minus what that time spent blocked in
    gradient collectives (``comm_s`` less ``async_comm_s``, the part measured from a collective's issue to
    its completion callback while no engine code waited: DDP-style dense buckets), in the codec
    (``compress_s``) and in network probes (``probe_s``). Agreements are not subtracted: they are the
    engine's bookkeeping. On CUDA ``comm_s``/``compress_s`` are device time from events, ``own_s`` host
    time: the difference is then an estimate (docs/bench.md, "Overhead")."""
    return own_s - (comm_s - async_comm_s) - compress_s - probe_s


class OwnClock:
    """The engine's own wall time, from monotonic clocks around its entry points, without any device
    synchronisation.

    Each thread the engine runs on (DDP's autograd thread in the hook, the ordered worker, the backend's
    completion callbacks) opens a :meth:`region` around an entry point; regions nested on one thread
    (a synchronous runner's jobs inside the hook) count once. A region adds its wall time to a pot when it
    ends; :meth:`take` empties the pot for the step being finished, with the calling thread's open region
    counted up to now (the rest of that region, and other threads' regions still open, go to the next
    step: per-step figures are exact in sum over steps, and to within one region's tail per step).
    ``clock`` is injectable for tests.
    """

    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        self._clock = clock or (lambda: time.perf_counter())  # looked up per call (tests replace it)
        self._local = threading.local()
        self._lock = threading.Lock()
        self._pot = 0.0

    @contextmanager
    def region(self) -> Iterator[None]:
        local = self._local
        if getattr(local, "start", None) is not None:  # nested on this thread: the outer region counts it
            yield
            return
        local.start = self._clock()
        try:
            yield
        finally:
            start, local.start = local.start, None
            dt = self._clock() - start
            with self._lock:
                self._pot += dt

    def wrap(self, fn: Callable) -> Callable:
        """``fn`` run inside a region (a backend callback)."""
        def run(*args, **kwargs):
            with self.region():
                return fn(*args, **kwargs)
        return run

    def take(self) -> float:
        """Seconds accumulated since the last take, this thread's open region up to now included."""
        local = self._local
        now = self._clock()
        start = getattr(local, "start", None)
        with self._lock:
            own, self._pot = self._pot, 0.0
        if start is not None:
            own += now - start
            local.start = now
        return own
