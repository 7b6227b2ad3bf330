"""DiLoCo: local inner steps, then an outer step on the averaged pseudo-gradient (Douillard et al., 2023).

With ``GCStrategy(sync="diloco")`` every rank trains on its own for ``inner_steps`` (H) optimizer
steps — DDP's gradient synchronisation is switched off (``require_backward_grad_sync = False``,
what ``DDP.no_sync()`` does), so inner steps send **no bytes at all** — and then takes an *outer
step*, identical on every rank:

1. the pseudo-gradient ``Δ_r = θ_outer − θ_local,r`` of every rank is averaged: dense (fp32
   allreduce of ``Δ_r / N``) or through any lightning_gc compressor on the collective it needs,
   with error feedback kept per parameter across outer steps (``e_r ← Δ_r + e_r − sent_r``);
2. an outer optimizer (default: SGD, lr 0.7, momentum 0.9, Nesterov, as published) updates
   ``θ_outer`` with the averaged ``Δ`` as its gradient;
3. every rank loads the new ``θ_outer``: ranks are bit-identical after every outer step.

Inner optimizer state (AdamW moments, momentum buffers, step counts) stays local to each rank.

With ``topology="nodes"`` the workers are nodes, not ranks (:mod:`lightning_gc.sync.diloco_nodes`):
inner steps average the gradients inside the node, and the outer step sends each local rank's
shard of Δ between nodes, then gathers the averaged shards inside the node.

Decisions where the paper is silent (docs/diloco.md):

* **Buffers** (BatchNorm running statistics) would drift apart with DDP's buffer broadcast off; at
  every outer step floating-point buffers are averaged (dense, counted in the bytes) and integer
  buffers are left as they are (they advance identically on every rank).
* **Non-finite Δ.** One 1-element MAX allreduce per outer step agrees whether any rank's Δ is
  non-finite; if so, the round is discarded on every rank: ``θ_outer``, the outer optimizer and the
  error memory are left unchanged and every rank reloads ``θ_outer``.
* **What evaluation and checkpoints see.** Validation, test and predict run on ``θ_outer`` (the
  only model all ranks agree on); the rank's ``θ_local`` is put back afterwards. A checkpoint's
  model weights are ``θ_outer``; its ``lightning_gc`` entry holds ``θ_outer``, the outer optimizer
  state and the inner-step position once, and per rank ``θ_local``, the inner optimizer state and
  the error memory, so a resume is exact (same world size). On a world-size change every rank
  restarts the round from ``θ_outer`` with rank 0's inner optimizer state (warned).
* **End of fit.** If the last round is unfinished, one more outer step closes it, so the trained
  model contains every inner step and is the same on every rank.

With ``H = 1``, a plain SGD outer optimizer with lr 1 (no momentum) and a dense Δ, an outer step
gives ``θ − mean_r(θ − θ_local,r)``; with a plain SGD inner optimizer (lr η) that is DDP's
``θ − η·mean_r(g_r)`` in real arithmetic. In floating point the two differ only by the rounding of
``θ − (θ − η g_r)`` (a relative error of about one ulp of ``θ`` per step), which the tests bound.
"""

from __future__ import annotations

import contextlib
import importlib
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor

from .._finite import all_finite
from ..comm.collectives import ring_allreduce_bytes, unflatten_into
from ..comm.hierarchy import NodeTopology, destroy_groups
from ..comm.worker import InlineRunner, OrderedWorker
from ..engine.ports import EngineControl, FamilySwitch
from ..engine.session import StepParticipant
from .diloco_nodes import NodeWorkers
from .optimizer_state import average_optimizer_state, repair_optimizer_state

_DILOCO_GROUP_ID = 1 << 21  # GroupContext.group_id of the outer exchange: random draws differ from any plan group
#: the published outer optimizer (DiLoCo, Douillard et al. 2023, section 3)
PUBLISHED_OUTER_ARGS: dict[str, Any] = {"lr": 0.7, "momentum": 0.9, "nesterov": True}
#: SparseLoCo's outer step: plain SGD at lr 1, the error memory in place of the outer momentum
SPARSELOCO_OUTER_ARGS: dict[str, Any] = {"lr": 1.0}
#: the dtype the inner optimizer's state travels in when DiLoCo is left (``leave``): AdamW's two
#: moments are twice the model, the largest fixed cost of a switch on a slow link; bfloat16 halves
#: it and keeps the ranks bit-identical (sync/optimizer_state.py says what it rounds). None: fp32
LEAVE_WIRE_DTYPE: torch.dtype | None = torch.bfloat16
#: compressors of the pseudo-gradient that only DiLoCo runs (``diloco_compressor``)
DELTA_COMPRESSORS: tuple[str, ...] = ("sparseloco",)


def resolve_optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    """``"SGD"`` → ``torch.optim.SGD``; a dotted path (``"my.module.Lion"``) is imported."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"diloco_outer_optimizer={name!r} must be a torch.optim class name such as 'SGD' or "
                         "'AdamW', or a dotted path to an Optimizer subclass.")
    if "." in name:
        module, _, attr = name.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"diloco_outer_optimizer={name!r} cannot be imported ({e}). Give a torch.optim "
                             "class name ('SGD') or an importable dotted path.") from e
    else:
        cls = getattr(torch.optim, name, None)
        if cls is None:
            import difflib

            known = [n for n in dir(torch.optim) if isinstance(getattr(torch.optim, n), type)
                     and issubclass(getattr(torch.optim, n), torch.optim.Optimizer) and n != "Optimizer"]
            same = [k for k in known if k.lower() == name.lower()]
            close = same or difflib.get_close_matches(name, known, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else f" Known: {', '.join(sorted(known))}."
            raise ValueError(f"diloco_outer_optimizer={name!r} is not a torch.optim optimizer.{hint}")
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ValueError(f"diloco_outer_optimizer={name!r} is {cls!r}, not a torch.optim.Optimizer subclass.")
    return cls


@dataclass(frozen=True)
class DiLoCoConfig:
    """Options of DiLoCo synchronisation (flat names ``diloco_<field>`` on :class:`~lightning_gc.GCStrategy`).

    Attributes:
        inner_steps: H, optimizer steps between outer steps (≥ 1). Communication per optimizer
            step is the model's Δ once per H steps: about H× less than DDP with a dense Δ. Larger H
            saves more and lets the replicas drift further apart; the paper uses 500 for large
            language models, 10–50 suits small models and short runs.
        outer_optimizer: a ``torch.optim`` class name (``"SGD"``, ``"AdamW"``, ...) or a dotted path
            to an Optimizer subclass; it updates θ_outer with the averaged Δ as its gradient.
        outer_args: keyword arguments of the outer optimizer. ``None``: for ``"SGD"`` the published
            ``lr=0.7, momentum=0.9, nesterov=True`` (with ``compressor="sparseloco"``: ``lr=1``, no
            momentum); the optimizer's own defaults otherwise.
        fragments: Streaming DiLoCo's F: the parameters are cut into F fragments of about equal
            element count (contiguous in model order) and fragment ``p`` is synchronised at inner
            steps ``⌊H/F·(p+1)⌋ + kH``, so the link carries 1/F of the model at a time. 1: plain DiLoCo.
        overlap_steps: Streaming DiLoCo's τ: a fragment's exchange runs on a worker thread while the
            next τ inner steps compute, and is applied τ steps after it was sent (0: at once, on
            the main thread). Must be smaller than H/F, so one fragment is applied before the next
            one is sent.
        mixing: Streaming DiLoCo's α: when a fragment's outer step is applied, its parameters become
            ``α·θ_local + (1 − α)·θ_outer``; 0 (default) takes θ_outer and drops the τ local steps
            the fragment made meanwhile, values towards 1 keep more of them.
        error_decay: β of SparseLoCo's error feedback on a compressed Δ: before compressing, the
            memory is scaled by β (``Δ + β·e``), so what was not sent fades by β per outer step.
            1.0 (default) keeps everything not sent until it is sent (plain error feedback);
            SparseLoCo uses 0.95 with outer SGD lr 1 and no outer momentum, where the decayed memory
            itself plays the part of the outer momentum. Needs a compressor with error feedback.
        compressor: a compressor of the pseudo-gradient that only DiLoCo runs (``None``: the one named
            by ``compressor=``). ``"sparseloco"``: SparseLoCo's chunked Top-k with 2/4-bit values
            (:mod:`lightning_gc.compressors.sparseloco`), allgathered, with per-rank error feedback
            always on; without ``outer_args`` the outer optimizer is then plain SGD at lr 1 (no
            momentum: the error memory stands in for it, as in the paper).
        compressor_args: its options (:class:`~lightning_gc.compressors.sparseloco.SparseLoCoConfig`:
            ``density``, ``chunk``, ``bits``, ``rounding``).
    """

    inner_steps: int = 50
    outer_optimizer: str = "SGD"
    outer_args: Mapping[str, Any] | None = field(default=None)
    fragments: int = 1
    overlap_steps: int = 0
    mixing: float = 0.0
    error_decay: float = 1.0
    compressor: str | None = None
    compressor_args: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        self._check_delta_compressor()
        h = self.inner_steps
        if isinstance(h, bool) or not isinstance(h, int) or h < 1:
            raise ValueError(f"diloco_inner_steps={h!r} must be an integer ≥ 1 (local optimizer steps between "
                             "outer steps). E.g. 50; 1 synchronises every step.")
        f = self.fragments
        if isinstance(f, bool) or not isinstance(f, int) or not 1 <= f <= h:
            raise ValueError(f"diloco_fragments={f!r} must be an integer in [1, diloco_inner_steps={h}]: each fragment "
                             "is synchronised at its own inner step within every H steps. E.g. 1 (plain DiLoCo) or 4.")
        tau = self.overlap_steps
        if isinstance(tau, bool) or not isinstance(tau, int) or not 0 <= tau < h // f:
            raise ValueError(f"diloco_overlap_steps={tau!r} must be an integer in [0, H/F) = [0, {h // f}) with "
                             f"diloco_inner_steps={h} and diloco_fragments={f}: a fragment's exchange must be applied "
                             "before the next fragment is sent. Lower it, or raise diloco_inner_steps.")
        a = self.mixing
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0.0 <= a <= 1.0:
            raise ValueError(f"diloco_mixing={a!r} must be a number in [0, 1] (the weight of the local parameters when "
                             "a fragment's outer step is applied). E.g. 0.0.")
        b = self.error_decay
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not 0.0 < b <= 1.0:
            raise ValueError(f"diloco_error_decay={b!r} must be a number in (0, 1] (the factor applied to the error "
                             "memory of a compressed Δ at each outer step). E.g. 1.0 (keep all) or 0.95 (SparseLoCo).")
        if self.outer_args is not None and not isinstance(self.outer_args, Mapping):
            raise ValueError(f"diloco_outer_args={self.outer_args!r} must be a dict of the outer optimizer's "
                             "keyword arguments, e.g. {'lr': 0.7, 'momentum': 0.9, 'nesterov': True}.")
        cls = resolve_optimizer_class(self.outer_optimizer)
        try:  # refuse bad options now, not in every process after launch
            cls([torch.zeros(1, requires_grad=True)], **self.resolved_args())
        except (TypeError, ValueError) as e:
            raise ValueError(f"diloco_outer_optimizer={self.outer_optimizer!r} with diloco_outer_args="
                             f"{dict(self.resolved_args())!r} cannot be built: {e}") from e

    def _check_delta_compressor(self) -> None:
        if self.compressor_args is not None and not isinstance(self.compressor_args, Mapping):
            raise ValueError(f"diloco_compressor_args={self.compressor_args!r} must be a dict of the pseudo-gradient "
                             "compressor's options, e.g. {'density': 0.015625, 'chunk': 4096, 'bits': 2}.")
        if self.compressor_args is not None and not self.compressor_args:
            object.__setattr__(self, "compressor_args", None)  # {} and None mean the same: the defaults
        if self.compressor is None:
            if self.compressor_args is not None:
                raise ValueError(f"diloco_compressor_args={dict(self.compressor_args)!r} needs diloco_compressor: pass "
                                 f"diloco_compressor={DELTA_COMPRESSORS[0]!r} too, or drop it.")
            return
        if self.compressor not in DELTA_COMPRESSORS:
            raise ValueError(f"diloco_compressor={self.compressor!r} is not a DiLoCo pseudo-gradient compressor; the "
                             f"choices are {list(DELTA_COMPRESSORS)} (or None, to send Δ with compressor=). E.g. "
                             "diloco_compressor='sparseloco'.")
        self.delta_compressor()  # validates the options

    def delta_compressor(self) -> Any:
        """The compressor of ``compressor``/``compressor_args`` (``None`` without one)."""
        if self.compressor is None:
            return None
        import dataclasses

        from ..compressors.sparseloco import SparseLoCoCompressor, SparseLoCoConfig

        args = dict(self.compressor_args or {})
        valid = [f.name for f in dataclasses.fields(SparseLoCoConfig)]
        unknown = sorted(set(args) - set(valid))
        if unknown:
            raise ValueError(f"diloco_compressor_args {unknown} are not options of diloco_compressor="
                             f"{self.compressor!r}; its options are {valid}.")
        return SparseLoCoCompressor(SparseLoCoConfig(**args))

    def send_offset(self, fragment: int) -> int:
        """The first inner step at which ``fragment`` is sent (then every H steps)."""
        return (self.inner_steps * (fragment + 1)) // self.fragments

    def resolved_args(self) -> dict[str, Any]:
        """The outer optimizer's keyword arguments with ``None`` resolved (see ``outer_args``)."""
        if self.outer_args is not None:
            return dict(self.outer_args)
        if self.outer_optimizer not in ("SGD", "torch.optim.SGD"):
            return {}
        return dict(SPARSELOCO_OUTER_ARGS if self.compressor == "sparseloco" else PUBLISHED_OUTER_ARGS)

    def build_outer_optimizer(self, params: list[Tensor]) -> torch.optim.Optimizer:
        return resolve_optimizer_class(self.outer_optimizer)(params, **self.resolved_args())


def split_fragments(numels: list[int], fragments: int) -> list[list[int]]:
    """Contiguous runs of parameter indices with about equal element counts (cut where the running
    count first reaches k/F of the total); every fragment gets at least one tensor."""
    total = sum(numels)
    out: list[list[int]] = [[] for _ in range(fragments)]
    running, frag = 0, 0
    for i, n in enumerate(numels):
        remaining_tensors = len(numels) - i
        remaining_frags = fragments - frag
        if out[frag] and (running >= total * (frag + 1) / fragments or remaining_tensors < remaining_frags):
            frag = min(frag + 1, fragments - 1)
        out[frag].append(i)
        running += n
    if any(not f for f in out):
        raise ValueError(f"diloco_fragments={fragments} is more than the model's {len(numels)} parameter tensors; "
                         "lower diloco_fragments.")
    return out


@dataclass
class DiLoCoStats:
    """What the last outer step did (for :class:`~lightning_gc.callbacks.GCMonitor`)."""

    outer_step: int = 0  # outer steps taken so far (including this one; per fragment with streaming)
    inner_step: int = 0  # optimizer step at which it was applied
    fragment: int = 0  # which fragment (0 without streaming)
    sent_at: int = 0  # optimizer step at which its Δ was sent (inner_step − τ)
    bytes_sent: int = 0  # bytes this rank sent for Δ and the buffers
    bytes_payload: int = 0  # compressed payload size of this rank's Δ (dense: Δ's fp32 size)
    bytes_inter_node: int = 0  # of bytes_sent, those sent between nodes (topology="nodes"; 0 when flat)
    comm_s: float = 0.0  # wall time of the exchange (agreement and Δ; buffers)
    wait_s: float = 0.0  # time the main thread waited for it when applying (exposed communication)
    delta_norm: float = 0.0  # ‖mean Δ‖₂ applied by the outer optimizer
    error_norm: float = 0.0  # ‖error memory‖₂ of the fragment after the exchange (0 without error feedback)
    discarded: bool = False  # the round was discarded because Δ was non-finite on some rank


@dataclass
class _Exchange:
    """One fragment's outer exchange: filled by the job (worker or main thread), read when applied."""

    fragment: int
    sent_at: int
    due: int
    delta: Tensor | None = None  # this rank's Δ (+ memory; by nodes its shard), consumed by the job
    numel: int = 0  # elements of the fragment's Δ (by nodes: what the gathered shards are cut back to)
    mean: Tensor | None = None  # the mean over ranks (identical on every rank)
    residual: Tensor | None = None  # with error feedback: what was not sent (this rank)
    bad: bool = False
    bytes_sent: int = 0
    bytes_payload: int = 0
    bytes_inter_node: int = 0
    comm_s: float = 0.0
    error: BaseException | None = None


class DiLoCoSync(StepParticipant):
    """The DiLoCo synchronisation model as a step-session participant (see the module docstring).

    Args:
        engine: the engine; DiLoCo uses its parameters, process group, seed and byte counters (the
            engine's own hook is never called: DDP does not synchronise gradients).
        config: H, the outer optimizer and the streaming options.
        compressor: the Δ compressor (``None``: dense fp32 allreduce).
        collective: the compressor's collective (``"auto"``: its natural one).
        error_feedback: keep what the compressor did not send and add it to the next Δ.
        buffers: the module's buffers, in a fixed order (averaged at every outer step if floating).
        nodes: the engine's node topology with ``topology="nodes"`` (``None``: flat). Nodes are
            then the workers (:mod:`lightning_gc.sync.diloco_nodes`): inner steps average the
            gradients inside the node, the outer step sends each local rank's shard of Δ between nodes.
    """

    name = "diloco"
    state_scope = "rank"

    def __init__(self, engine: EngineControl, config: DiLoCoConfig, compressor: Any = None,
                 collective: str = "auto", error_feedback: bool = False,
                 buffers: list[tuple[str, Tensor]] | None = None, nodes: NodeTopology | None = None,
                 switch: FamilySwitch | None = None) -> None:
        self.engine = engine
        self.params: list[Tensor] = list(engine.params)
        self.names: list[str] = list(engine.names)
        self.numels = [p.numel() for p in self.params]
        self.world_size: int = engine.world_size
        self.device = engine.device
        self.buffers = [(n, b) for n, b in (buffers or []) if b.is_floating_point()]
        self.group = None
        if self.world_size > 1:
            pg = engine.process_group
            ranks = dist.get_process_group_ranks(pg) if pg is not None else None
            self.group = dist.new_group(ranks=ranks, backend=dist.get_backend(pg))
        #: with nodes as the workers: the node mean of inner steps and the outer shard exchange
        self.nodes = NodeWorkers(nodes, dist.get_backend(self.group)) if nodes is not None and self.group is not None else None
        #: a run that switches families (``compressor="auto"``): DiLoCo starts dormant and runs between
        #: :meth:`enter` and :meth:`leave`; None: DiLoCo runs from the first step (``sync="diloco"``)
        self.switch = switch
        self.active = switch is None
        self.choice: str | None = None  # the configuration entered (by its name in ``switch``)
        self.last_stats: DiLoCoStats | None = None
        self.comm_s_total = 0.0  # wall time of every outer exchange since this process started (summary)
        self.steps_run = self.outer_steps_run = 0  # inner and outer steps since this process started (summary)
        self.inner_bytes = 0  # bytes this rank sent in the last inner step's node mean (by nodes)
        self._layout_changed = False  # a resume on another node layout: this rank's own state is not loaded
        self._runner: OrderedWorker | InlineRunner = InlineRunner()
        self._optimizer: torch.optim.Optimizer | None = None
        self._pending_inner_state: dict | None = None
        self._configure(config, compressor, collective, error_feedback, check=self.active)

    def _configure(self, config: DiLoCoConfig, compressor: Any, collective: str, error_feedback: bool,
                   check: bool = True) -> None:
        """Everything that follows from the configuration, and a round that starts at θ = θ_outer."""
        self._runner.close()
        self.config = config
        self.fragments = split_fragments(self.numels, config.fragments)
        self.exchange = None
        self.error_feedback = False
        if config.compressor is not None:  # SparseLoCo: its own codec, allgathered, per-rank error feedback
            compressor, collective, error_feedback = config.delta_compressor(), "allgather", True
        if compressor is not None and self.world_size > 1:
            from ..exchanges.registry import make_exchange

            self.exchange = make_exchange(compressor, collective,
                                          group=self.nodes.inter if self.nodes is not None else self.group)
            self.error_feedback = bool(error_feedback)
        if self.group is not None and check:
            self._check_ranks_agree()
        with torch.no_grad():
            self.theta_outer: list[Tensor] = [p.detach().to(torch.float32).clone() for p in self.params]
        self.outer_optimizer = config.build_outer_optimizer(self.theta_outer)
        self.memories: dict[int, Tensor] = {}  # per fragment: flat error memory (fp32), with error feedback
        self.inner_step = 0  # optimizer steps taken (every rank the same)
        self.round_shift = 0  # inner steps the round schedule is moved by (enter's first_round − H)
        self.outer_steps = 0  # outer steps applied (per fragment with streaming), discarded ones not counted
        self.sends = [0] * len(self.fragments)  # exchanges started per fragment
        self.last_send = [0] * len(self.fragments)  # inner step of each fragment's last send
        self._pending: dict[int, _Exchange] = {}
        self._runner = (OrderedWorker(name="lightning_gc-diloco", device=self.device)
                        if config.overlap_steps > 0 and self.world_size > 1 else InlineRunner())
        self._finished_at: int | None = None  # the inner step of the last closing round (finish)

    def enter(self, choice: str, first_round: int | None = None) -> None:
        """Start DiLoCo now, as configuration ``choice`` of :attr:`switch`: θ_outer is the current θ, a
        fresh outer optimizer, and DDP's gradient synchronisation off. Between steps, on every rank alike.
        ``first_round``: inner steps until the first outer step (None: H); every later one follows H
        steps after the one before, so a caller can keep the rounds on the steps a run that started in
        DiLoCo would synchronise at."""
        if self.switch is None:
            raise RuntimeError("DiLoCoSync.enter() is for a run that switches families (compressor='auto').")
        if self.active:
            raise RuntimeError(f"DiLoCo is running already (as {self.choice!r}); leave() it first.")
        resolved = self.switch.resolve(choice)
        h = resolved[0].inner_steps
        if first_round is not None and (isinstance(first_round, bool) or not isinstance(first_round, int)
                                        or not 1 <= first_round < 2 * h):
            raise ValueError(f"first_round={first_round!r} must be an integer in [1, 2H) = [1, {2 * h}) for "
                             f"{choice!r}, whose H is {h}.")
        self._configure(*resolved)
        self.round_shift = (first_round or h) - h
        self.choice, self.active = choice, True
        self.switch.set_gradient_sync(False)

    def _go_dormant(self) -> None:
        assert self.switch is not None
        self.active, self.choice = False, None
        self.switch.set_gradient_sync(True)

    def describe(self) -> str:
        """Everything that sets the outer exchanges' shape and order (compared across ranks at setup)."""
        c = self.config
        delta = f"{self.exchange.compressor.describe()}/{self.exchange.name}" if self.exchange is not None else "dense"
        return (f"H={c.inner_steps} F={c.fragments} tau={c.overlap_steps} numels={self.numels} delta={delta} "
                f"ef={self.error_feedback} buffers={[b.numel() for _, b in self.buffers]} workers={self.layout}")

    @property
    def layout(self) -> str:
        """Who the workers are: ``"ranks"`` (flat), or ``"nodes(<nodes>x<ranks per node>)"``."""
        return self.nodes.describe() if self.nodes is not None else "ranks"

    def _check_ranks_agree(self) -> None:
        """A rank-dependent H, fragment split or Δ codec would pair different collectives (a hang or a
        gloo abort): compare once, at setup, and raise on every rank if they differ."""
        from ..comm.collectives import check_descriptor

        check_descriptor(f"DiLoCo {self.describe()}", 0, self.group, self.world_size, self._comm_device())

    @property
    def memory(self) -> Tensor | None:
        """The error memory without streaming (one fragment); ``None`` before the first compressed send."""
        return self.memories.get(0) if len(self.fragments) == 1 else None

    # ------------------------------------------------------------------ the step
    def before_optimizer_step(self, loss: Any) -> bool:
        """By nodes: the inner step's gradients become the node's fp32 mean (after backward, before
        clipping and the optimizer). Flat: nothing (inner steps send nothing)."""
        if self.nodes is not None and self.active:
            t0 = time.perf_counter()
            self.inner_bytes, payload = self.nodes.mean_gradients(self.params)
            self.comm_s_total += time.perf_counter() - t0
            self.engine.add_deferred_traffic(self.inner_bytes, payload, 0)
        return False

    def prepare_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self._optimizer is None:
            self._optimizer = optimizer
        elif optimizer is not self._optimizer:
            raise ValueError(
                "GCStrategy(sync='diloco') supports one inner optimizer; this LightningModule steps two. "
                "Return one optimizer from configure_optimizers, or use sync='bsp'.")

    def after_optimizer_step(self) -> None:
        if not self.active:
            return
        self.inner_step += 1
        self.steps_run += 1
        t, cfg = self.inner_step, self.config
        for p in sorted(self._pending):  # exchanges sent τ steps ago
            if self._pending[p].due == t:
                self._apply(p)
        for p in range(len(self.fragments)):
            off = cfg.send_offset(p) + self.round_shift
            if t >= max(off, 1) and (t - off) % cfg.inner_steps == 0:
                self._send(p)
                if cfg.overlap_steps == 0:
                    self._apply(p)

    def outer_step(self) -> None:
        """Synchronise every fragment now (send and apply, mixing 0): a full outer step."""
        for p in sorted(self._pending):
            self._apply(p)
        for p in range(len(self.fragments)):
            self._send(p, due=self.inner_step)
            self._apply(p, mixing=0.0)

    @property
    def dense_bytes_per_step(self) -> int:
        """Bytes this rank would send per optimizer step with DDP's fp32 ring allreduce (the baseline)."""
        return ring_allreduce_bytes(4 * sum(self.numels), self.world_size)

    def _differs(self, p: int) -> bool:
        return self.last_send[p] < self.inner_step or p in self._pending or self.config.mixing > 0

    @property
    def round_open(self) -> bool:
        """Whether some parameters may differ from θ_outer (inner steps since the last outer step)."""
        return self.active and any(self._differs(p) for p in range(len(self.fragments)))

    def finish(self) -> None:
        """End of fit (every rank at the same step): apply what is in flight, then close every
        fragment that may differ from θ_outer with an outer step (mixing 0), so the ranks end
        identical and the model contains every inner step. Idempotent: a second call at the same
        inner step changes nothing (with mixing > 0 every fragment counts as differing)."""
        if self._finished_at == self.inner_step or not self.active:
            return
        self._finished_at = self.inner_step
        for p in sorted(self._pending):
            self._apply(p)
        for p in range(len(self.fragments)):
            if self._differs(p):
                self._send(p, due=self.inner_step)
                self._apply(p, mixing=0.0)

    def leave(self) -> int:
        """Hand the run back to per-step synchronisation: close the round (:meth:`finish`: every rank
        holds θ_outer), then make the inner optimizer's state the ranks' mean, summed in
        :data:`LEAVE_WIRE_DTYPE` (:func:`~lightning_gc.sync.optimizer_state.average_optimizer_state`), so identical gradients
        give identical updates again. The caller then turns DDP's gradient synchronisation back on.
        Returns the bytes this rank sent for the optimizer state."""
        if not self.active:
            return 0
        self.finish()
        sent = 0
        if self._optimizer is not None and self.group is not None:
            sent = average_optimizer_state(self._optimizer, self.group, wire_dtype=LEAVE_WIRE_DTYPE)
        if self.switch is not None:
            self._go_dormant()
        return sent

    def _send(self, p: int, due: int | None = None) -> None:
        """Compute this rank's Δ of fragment ``p`` and start its exchange (worker with τ > 0)."""
        idx = self.fragments[p]
        with torch.no_grad():
            delta = torch.cat([(self.theta_outer[i] - self.params[i].detach().to(torch.float32)).reshape(-1)
                               for i in idx])
            numel = delta.numel()
            if self.nodes is not None:  # identical on the node's ranks: each sends its own shard
                delta = self.nodes.take(delta)
            if self.error_feedback and p in self.memories:
                delta = delta + self.config.error_decay * self.memories[p]  # β = 1: plain error feedback
        job = _Exchange(fragment=p, sent_at=self.inner_step,
                        due=self.inner_step + self.config.overlap_steps if due is None else due, delta=delta,
                        numel=numel)
        ctx = None
        if self.exchange is not None:
            from ..compressors import GroupContext

            ctx = GroupContext(
                step=self.sends[p], rank=dist.get_rank(self.group), world_size=self.world_size,
                segments=tuple(self.numels[i] for i in idx), group_id=_DILOCO_GROUP_ID + p,
                seed=self.engine.config.seed, device=delta.device,
                shapes=tuple(tuple(self.params[i].shape) for i in idx), names=tuple(self.names[i] for i in idx))
            if self.nodes is not None:
                ctx = self.nodes.context(ctx, numel)
        self.sends[p] += 1
        self.last_send[p] = self.inner_step
        self._pending[p] = job
        self._runner.submit(lambda: self._job(job, ctx))

    def _job(self, job: _Exchange, ctx: Any) -> None:
        """The exchange itself (worker thread with τ > 0, else inline): agreement on finiteness, then
        the mean of Δ over the ranks, dense or compressed."""
        try:
            t0 = time.perf_counter()
            delta, job.delta = job.delta, None
            assert delta is not None
            bad = torch.tensor([0.0 if all_finite(delta) else 1.0], device=self._comm_device())
            if self.group is not None:
                dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=self.group)
            job.bad = bool(bad.item() > 0)
            if not job.bad:
                job.mean = self._average(delta, job, ctx)
            job.comm_s = time.perf_counter() - t0
        except BaseException as e:  # noqa: BLE001 - surfaced on the main thread by _apply
            job.error = e

    def _average(self, delta: Tensor, job: _Exchange, ctx: Any) -> Tensor:
        """The mean of the ranks' Δ (identical on every rank); records this rank's bytes."""
        if self.world_size == 1:
            return delta
        if self.nodes is not None:
            return self._average_by_nodes(delta, job, ctx)
        nbytes = delta.numel() * delta.element_size()
        if self.exchange is None:  # dense: DDP's numerics, mean = sum of (Δ / N)
            comm = delta.to(self._comm_device()).div_(self.world_size)
            dist.all_reduce(comm, group=self.group)
            job.bytes_sent += ring_allreduce_bytes(nbytes, self.world_size)
            job.bytes_payload += nbytes
            return comm.to(delta.device)
        from ..comm.exchange import ExchangeTimes, Timer, error_feedback_residual

        # a payload of the wrong size (a compressor bug) is recorded and sent as zeros rather than raised
        # on its rank alone while the others wait in the collective; every rank then raises below
        times = ExchangeTimes(malformed=[])
        mean, sent = self.exchange.run(delta, ctx, Timer(delta.device, times))
        times.raise_if_malformed_anywhere(self.group, self._comm_device(), self.world_size, "a compressed pseudo-gradient",
                                          self.exchange.compressor.name,
                                          "the outer step is not taken on any rank.")
        if self.error_feedback:
            job.residual = error_feedback_residual(delta, sent, in_place=False)
        job.bytes_sent += int(times.bytes_sent)
        job.bytes_payload += int(times.bytes_payload)
        return mean.to(torch.float32).reshape(-1)

    def _average_by_nodes(self, shard: Tensor, job: _Exchange, ctx: Any) -> Tensor:
        """This rank's shard of Δ averaged over the nodes (dense or compressed, on the shard's group),
        then the node's shards gathered: the full mean Δ, identical on every rank."""
        nodes = self.nodes
        assert nodes is not None
        shard = shard.to(self._comm_device())
        if self.exchange is None:
            mean, sent = nodes.dense_mean(shard)
            payload = shard.numel() * shard.element_size()
        else:
            mean, sent, payload = self._compressed_shard(shard, job, ctx)
        job.bytes_payload += payload
        job.bytes_sent += sent
        job.bytes_inter_node += sent
        full, gathered = nodes.gather(mean.to(torch.float32).reshape(-1), job.numel)
        job.bytes_sent += gathered
        return full.to(shard.device)

    def _compressed_shard(self, shard: Tensor, job: _Exchange, ctx: Any) -> tuple[Tensor, int, int]:
        """The shard's mean over the nodes through the Δ compressor; (mean, bytes sent, payload bytes)."""
        from ..comm.exchange import ExchangeTimes, Timer, error_feedback_residual

        assert self.exchange is not None
        times = ExchangeTimes(malformed=[])
        mean, sent = self.exchange.run(shard, ctx, Timer(shard.device, times))
        times.raise_if_malformed_anywhere(self.group, self._comm_device(), self.world_size,
                                          "a compressed pseudo-gradient shard", self.exchange.compressor.name,
                                          "the outer step is not taken on any rank.")
        if self.error_feedback:  # per shard: each local rank keeps what its shard did not send
            job.residual = error_feedback_residual(shard, sent, in_place=False)
        return mean, int(times.bytes_sent), int(times.bytes_payload)

    def _apply(self, p: int, mixing: float | None = None) -> None:
        """Wait for fragment ``p``'s exchange, step the outer optimizer on it and merge it into the
        parameters (``α·θ_local + (1 − α)·θ_outer``)."""
        job = self._pending.pop(p)
        t0 = time.perf_counter()
        self._runner.drain()
        stats = DiLoCoStats(outer_step=self.outer_steps, inner_step=self.inner_step, fragment=p,
                            sent_at=job.sent_at, wait_s=time.perf_counter() - t0, comm_s=job.comm_s)
        if job.error is not None:
            raise RuntimeError(
                f"lightning_gc DiLoCo: the outer exchange of fragment {p} sent at step {job.sent_at} failed on this "
                f"rank ({job.error!r}); the outer step cannot be taken."
            ) from job.error
        alpha = self.config.mixing if mixing is None else mixing
        idx = self.fragments[p]
        with torch.no_grad():
            if job.bad:
                stats.discarded = True
                alpha = 0.0  # back to θ_outer of before the round
                if self._optimizer is not None and self.group is not None:  # the round's NaN must not outlive it
                    stats.bytes_sent += repair_optimizer_state(self._optimizer, [self.params[i] for i in idx],
                                                               self.group, LEAVE_WIRE_DTYPE)
                rank_zero_warn(
                    f"lightning_gc DiLoCo: the pseudo-gradient of fragment {p} sent at step {job.sent_at} is non-finite "
                    "on some rank; that round is discarded on every rank (θ_outer, outer optimizer and error memory "
                    "unchanged; a rank's inner optimizer state that went non-finite takes the finite ranks' mean). "
                    "Lower the inner learning rate or clip the inner gradients."
                )
            else:
                assert job.mean is not None
                offset = 0
                for i in idx:
                    o = self.theta_outer[i]
                    o.grad = job.mean[offset:offset + o.numel()].view_as(o).clone()
                    offset += o.numel()
                self.outer_optimizer.step()  # parameters without a gradient (other fragments) are skipped
                for i in idx:
                    self.theta_outer[i].grad = None
                if self.error_feedback and job.residual is not None:
                    self.memories[p] = job.residual
                self.outer_steps += 1
                self.outer_steps_run += 1
                stats.outer_step = self.outer_steps
                stats.delta_norm = float(job.mean.norm())
                stats.bytes_sent, stats.bytes_payload = job.bytes_sent, job.bytes_payload
                stats.bytes_inter_node = job.bytes_inter_node
                if p == len(self.fragments) - 1:  # once per H steps, while the worker is idle
                    t1 = time.perf_counter()
                    sent, inter = self._average_buffers()
                    stats.bytes_sent += sent
                    stats.bytes_inter_node += inter
                    stats.comm_s += time.perf_counter() - t1
            for i in idx:
                if alpha == 0.0:
                    self.params[i].copy_(self.theta_outer[i])
                else:
                    self.params[i].copy_(alpha * self.params[i].to(torch.float32) + (1.0 - alpha) * self.theta_outer[i])
        if p in self.memories:
            stats.error_norm = float(self.memories[p].norm())
        self.engine.add_deferred_traffic(stats.bytes_sent, stats.bytes_payload, stats.bytes_inter_node)
        self.comm_s_total += stats.comm_s
        self.last_stats = stats

    def _average_buffers(self) -> tuple[int, int]:
        """Floating buffers ← their mean over all ranks; (bytes sent, of which between nodes)."""
        if not self.buffers or self.group is None:
            return 0, 0
        flat = torch.cat([b.detach().to(torch.float32).reshape(-1) for _, b in self.buffers]).to(self._comm_device())
        if self.nodes is not None:
            sent, inter = self.nodes.allreduce_mean(flat)
        else:
            flat.div_(self.world_size)
            dist.all_reduce(flat, group=self.group)
            sent, inter = ring_allreduce_bytes(flat.numel() * flat.element_size(), self.world_size), 0
        unflatten_into(flat, [b for _, b in self.buffers])
        return sent, inter

    def load_outer(self) -> None:
        """Copy θ_outer into the model's parameters."""
        with torch.no_grad():
            for p, o in zip(self.params, self.theta_outer):
                p.copy_(o)

    @contextlib.contextmanager
    def outer_view(self) -> Iterator[None]:
        """Parameters hold θ_outer inside the block, this rank's θ_local again after it."""
        if not self.round_open:
            yield
            return
        with torch.no_grad():
            local = [p.detach().clone() for p in self.params]
            self.load_outer()
        try:
            yield
        finally:
            with torch.no_grad():
                for p, v in zip(self.params, local):
                    p.copy_(v)

    def _comm_device(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    def drain(self, timeout: float | None = None) -> bool:
        """Wait for exchanges in flight (they are applied at their due step, not now: a checkpoint
        holds their results, so a resume is exact)."""
        return self._runner.drain(timeout)

    # ------------------------------------------------------------------ checkpoints
    def shared_state_dict(self) -> dict:
        """The replicated part (identical on every rank; saved once)."""
        self.drain()
        if not self.active:
            return {"active": False}
        return {
            "active": True, "choice": self.choice,
            "inner_step": self.inner_step,
            "round_shift": self.round_shift,
            "outer_steps": self.outer_steps,
            "workers": self.layout,
            "sends": list(self.sends),
            "last_send": list(self.last_send),
            "theta_outer": {n: o.detach().cpu().clone() for n, o in zip(self.names, self.theta_outer)},
            "outer_optimizer": _to_cpu(self.outer_optimizer.state_dict()),
            "exchange": self.exchange.state_dict() if self.exchange is not None else {},
            "pending": {p: {"sent_at": j.sent_at, "due": j.due, "bad": j.bad, "comm_s": j.comm_s,
                            "mean": j.mean.detach().cpu().clone() if j.mean is not None else None}
                        for p, j in self._pending.items()},
        }

    def load_shared_state_dict(self, state: dict) -> None:
        if not self._load_activity(state):
            return
        with torch.no_grad():
            saved = state["theta_outer"]
            missing = [n for n in self.names if n not in saved]
            if missing:
                raise ValueError(f"lightning_gc DiLoCo: the checkpoint's θ_outer lacks parameters {missing[:3]}; it "
                                 "was written for another model.")
            for n, o in zip(self.names, self.theta_outer):
                o.copy_(saved[n])
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])
        self.inner_step = int(state["inner_step"])
        self.round_shift = int(state.get("round_shift", 0))  # 0 in checkpoints from before it was kept
        self.outer_steps = int(state["outer_steps"])
        self.sends = list(state.get("sends", self.sends))
        self.last_send = list(state.get("last_send", self.last_send))
        if self.exchange is not None and state.get("exchange"):
            self.exchange.load_state_dict(state["exchange"], world_size=self.world_size)
        self._pending = {}
        for p, j in (state.get("pending") or {}).items():
            mean = j["mean"].to(self.device) if j["mean"] is not None else None
            self._pending[int(p)] = _Exchange(fragment=int(p), sent_at=int(j["sent_at"]), due=int(j["due"]),
                                              mean=mean, bad=bool(j["bad"]), comm_s=float(j["comm_s"]))
        saved = state.get("workers", "ranks")
        self._layout_changed = saved != self.layout
        if self._layout_changed:
            rank_zero_warn(
                f"lightning_gc DiLoCo: the checkpoint was written with workers={saved}, this run has "
                f"workers={self.layout}; each rank's θ_local and error memory belong to the old layout and are not "
                "loaded: every rank restarts the round from θ_outer (and rank 0's inner optimizer state).")
        # without this rank's own state (world-size change) the round restarts from θ_outer
        self.load_outer()

    def state_dict(self) -> dict:
        """This rank's part: θ_local (if it differs from θ_outer), inner optimizer state, error memory
        and what its exchanges in flight did not send."""
        self.drain()
        if not self.active:
            return {"active": False}
        return {
            "theta_local": ({n: p.detach().cpu().clone() for n, p in zip(self.names, self.params)}
                            if self.round_open else None),
            "inner_optimizer": _to_cpu(self._optimizer.state_dict()) if self._optimizer is not None else None,
            "memories": {p: m.detach().cpu().clone() for p, m in self.memories.items()},
            "pending": {p: {"residual": j.residual.detach().cpu().clone() if j.residual is not None else None,
                            "bytes_sent": j.bytes_sent, "bytes_payload": j.bytes_payload}
                        for p, j in self._pending.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        if self._layout_changed or not self.active:  # load_shared_state_dict came first and put θ_outer back
            return
        with torch.no_grad():
            local = state.get("theta_local")
            if local is not None:
                for n, p in zip(self.names, self.params):
                    p.copy_(local[n])
        self.memories = {int(p): m.to(self.device) for p, m in (state.get("memories") or {}).items()}
        for p, j in (state.get("pending") or {}).items():
            if int(p) in self._pending:
                job = self._pending[int(p)]
                job.residual = j["residual"].to(self.device) if j["residual"] is not None else None
                job.bytes_sent, job.bytes_payload = int(j["bytes_sent"]), int(j["bytes_payload"])
        self._pending_inner_state = state.get("inner_optimizer")

    def _load_activity(self, state: dict) -> bool:
        """A switching run resumes in the family it saved in (:meth:`enter` without a new θ_outer: the
        checkpoint's is loaded next). Returns whether DiLoCo was running."""
        running = bool(state.get("active", True))
        if self.switch is None:
            if not running:
                raise ValueError("lightning_gc DiLoCo: this checkpoint was written by compressor='auto' while it "
                                 "ran per-step; resume it with compressor='auto' and auto_diloco, not sync='diloco'.")
            return True
        if running and not state.get("choice"):
            raise ValueError("lightning_gc DiLoCo: this checkpoint was written by sync='diloco'; resume it with "
                             "sync='diloco' (compressor='auto' switches families itself and cannot take it over).")
        if self.active:
            self.leave()
        if running:
            self.enter(str(state["choice"]))
        return running

    def restore_inner_optimizer(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """Load this rank's inner optimizer state after Lightning restored rank 0's into every rank."""
        if self._pending_inner_state is None:
            return
        if len(optimizers) != 1:
            raise ValueError("GCStrategy(sync='diloco') supports one inner optimizer; the resumed module has "
                             f"{len(optimizers)}.")
        optimizers[0].load_state_dict(self._pending_inner_state)
        self._optimizer = optimizers[0]
        self._pending_inner_state = None

    # ------------------------------------------------------------------ lifecycle (StepSession)
    def on_train_end(self) -> None:
        """Close the last round before any user hook reads the trained model: every ``on_train_end``
        (callbacks' and the module's) sees θ_outer, identical on every rank."""
        self.finish()

    @contextlib.contextmanager
    def evaluation_view(self) -> Iterator[bool]:
        """θ_outer for evaluation and a checkpoint's weights while a round is open (:meth:`outer_view`)."""
        swapped = self.round_open
        with self.outer_view():
            yield swapped

    def on_optimizer_state_loaded(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.restore_inner_optimizer(optimizers)

    def snapshot(self) -> Any:
        if not self.active:
            return None
        raise ValueError("GCStrategy(sync='diloco') cannot be explored by AdaptiveRatio(mode='rollback'): inner steps "
                         "send nothing, so there is no per-step ratio to adapt. Drop the AdaptiveRatio callback.")

    def close(self, timeout: float = 60.0) -> None:
        self._runner.close(timeout)
        if self.nodes is not None:
            self.nodes.close()
        if self.group is not None:
            destroy_groups([self.group])
            self.group = None


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_to_cpu(v) for v in obj)
    return obj


__all__ = ["DELTA_COMPRESSORS", "DiLoCoConfig", "DiLoCoStats", "DiLoCoSync", "PUBLISHED_OUTER_ARGS", "SPARSELOCO_OUTER_ARGS", "resolve_optimizer_class",
           "split_fragments"]
