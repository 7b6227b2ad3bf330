"""The one assembly of the engine, its participants and the step session, for both front doors.

:class:`~lightning_gc.GCStrategy` (a Lightning Trainer) and
:class:`~lightning_gc.fabric.GCFabricStrategy` (Lightning Fabric) wrap the model in DDP their own
way, then call :func:`build_session` with the validated :class:`~lightning_gc.config.GCConfig`.
What runs per step — compressor, engine, OMGS, ``auto``, OSP, DiLoCo, the non-finite rule — is
decided here only, so the two front doors cannot drift apart. The front doors only forward their
lifecycle events to :class:`~lightning_gc.engine.session.StepSession`.

The startup header (one rank-zero line) is built here too: it names what the user chose
(``compressor=auto`` with its candidates, the synchronisation model and its main options), not the
engine's placeholder slot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.nn.parallel import DistributedDataParallel

from .auto import AutoChooser
from .auto.diloco_candidates import diloco_choice
from .comm.hierarchy import NodeTopology
from .compressors import get_entry
from .config import GCConfig
from .engine import GCEngine, gc_comm_hook
from .engine.omgs import OMGSController
from .engine.session import StepParticipant, StepSession
from .sync import OSPSync
from .sync.diloco import DiLoCoConfig, DiLoCoSync
from .sync.lgp import check_training_setup

SINGLE_PROCESS_WARNING = ("lightning_gc: world size is 1, so gradients are neither communicated nor compressed; "
                          "training proceeds as on a single device.")


@dataclass
class Assembly:
    """What :func:`build_session` built: the engine, the session (which holds the participants in
    calling order), typed handles on the participants present, and the startup header line."""

    engine: GCEngine
    session: StepSession
    header: str
    omgs: OMGSController | None = None
    auto: AutoChooser | None = None
    osp: OSPSync | None = None
    diloco: DiLoCoSync | None = None


def build_session(config: GCConfig, ddp: DistributedDataParallel, *, scaler: Any = None,
                  pending_state: dict | None = None, announce: bool = True,
                  ranks_per_node: int | None = None) -> Assembly:
    """Build the engine on ``ddp``'s parameters and process group, the participants the
    configuration asks for, and the step session; restore ``pending_state`` (a checkpoint's
    ``"lightning_gc"`` entry read before the model was wrapped) and register the session as DDP's
    communication hook. ``scaler``: the AMP GradScaler, if any (it skips non-finite steps itself).
    ``announce``: say the startup header on rank zero (or warn at world size 1). ``ranks_per_node``:
    the launcher's processes per node (``topology="nodes"``; ``topology_ranks_per_node`` overrides it)."""
    named = [(n, p) for n, p in ddp.module.named_parameters() if p.requires_grad]
    compressor = get_entry(config.compression.compressor).compressor_cls(config.compression.compressor_config())
    engine = GCEngine(compressor, config.engine, named, process_group=ddp.process_group,
                      topology=config.topology, ranks_per_node=ranks_per_node,
                      topology_refused=config.topology_refusal() if config.topology.kind == "auto" else None)
    if casts_on_buckets(config, engine, compressor):
        engine.set_dense_mode(compressor.name)
    built = _participants(config, engine, ddp, named)
    participants: list[StepParticipant] = [p for p in built.values() if p is not None]
    session = StepSession(engine, participants, skip_nonfinite=config.nonfinite == "skip" and scaler is None)
    out = Assembly(engine=engine, session=session, header=startup_header(config, engine, built["diloco"]), **built)
    if pending_state is not None:
        apply_state(session, pending_state)
    ddp.register_comm_hook(session, gc_comm_hook)
    if announce:
        if engine.world_size == 1:
            rank_zero_warn(SINGLE_PROCESS_WARNING)
        else:
            rank_zero_info(out.header)
    return out


def _participants(config: GCConfig, engine: GCEngine, ddp: DistributedDataParallel,
                  named: list[tuple[str, Any]]) -> dict[str, Any]:
    """The participants, in calling order (OMGS, DiLoCo, auto, OSP); ``None`` where absent. DiLoCo comes
    before auto: auto switches families after DiLoCo's post-step work (auto/sync_switch.py)."""
    many = engine.world_size > 1
    omgs = (OMGSController(engine, config.omgs, ddp, named, config.engine.plan)
            if config.omgs is not None and many else None)
    diloco = _build_diloco(config, engine, ddp) if config.sync == "diloco" else None
    if config.auto is not None and config.auto.diloco and many:  # dormant until auto enters it
        diloco = DiLoCoSync(engine, DiLoCoConfig(), buffers=list(ddp.module.named_buffers()),
                            switch=AutoFamilies(ddp))
    auto = AutoChooser(engine, config.auto, ddp, named, sync=diloco) if config.auto is not None and many else None
    osp = OSPSync(engine, config.osp) if config.sync == "osp" else None
    return {"omgs": omgs, "diloco": diloco, "auto": auto, "osp": osp}


class AutoFamilies:
    """The :class:`~lightning_gc.engine.ports.FamilySwitch` of ``compressor="auto"`` with ``auto_diloco``:
    DiLoCo's configurations by their auto names, and DDP's gradient synchronisation flag."""

    def __init__(self, ddp: DistributedDataParallel) -> None:
        self.ddp = ddp

    def resolve(self, choice: str) -> tuple[DiLoCoConfig, Any, str, bool]:
        c = diloco_choice(choice)
        return c.config(), c.compressor(), "auto", False

    def set_gradient_sync(self, on: bool) -> None:
        # DDP.no_sync()'s flag: off, backward hands no bucket to the hook; no_sync() itself (gradient
        # accumulation) saves and restores it
        self.ddp.require_backward_grad_sync = bool(on)


def _build_diloco(config: GCConfig, engine: GCEngine, ddp: DistributedDataParallel) -> DiLoCoSync:
    # DDP.no_sync() for good: no bucket is handed to the hook, inner steps send nothing (by nodes
    # DiLoCo averages them inside the node itself, after backward). DDP's own no_sync() context
    # (gradient accumulation) saves and restores this flag.
    ddp.require_backward_grad_sync = False
    compression = config.compression
    compressor = None
    if compression.compressor != "dense":
        compressor = get_entry(compression.compressor).compressor_cls(compression.compressor_config())
    return DiLoCoSync(engine, config.diloco, compressor, collective=compression.collective,
                      error_feedback=config.engine.error_feedback, buffers=list(ddp.module.named_buffers()),
                      nodes=engine.topology if isinstance(engine.topology, NodeTopology) else None)


def casts_on_buckets(config: GCConfig, engine: Any, compressor: Any) -> bool:
    """Whether the compressor is a plain 16-bit cast that the engine sends on DDP's buckets (its dense
    mode, ``GCEngine.set_dense_mode``) instead of through the plan's groups.

    fp16/bf16 without error feedback over the allreduce compute, element by element, what torch's
    ``fp16_compress_hook``/``bf16_compress_hook`` compute (divide by N, cast, sum, widen). Through the
    plan's groups they cost more: a group is sent only once every bucket it spans has arrived (the
    default plan is one group, so nothing overlaps backward), and every compressed step closes with a
    cross-rank report (docs/compressors.md, "fp16, bf16"). Error feedback, another collective (a P2P
    ring or tree), OSP, DiLoCo, OMGS and ``compressor="auto"`` keep the grouped path: they need the groups."""
    from .compressors.cast import CastCompressor

    return (isinstance(compressor, CastCompressor) and engine.world_size > 1 and not engine.error_feedback
            and engine.exchange.name == "allreduce" and config.sync == "bsp"
            and config.omgs is None and config.auto is None)


def startup_header(config: GCConfig, engine: Any, diloco: Any = None) -> str:
    """The one startup line: what the user chose, the engine's resolved collective and plan, and the
    synchronisation model with its main options."""
    eng = config.engine
    if config.auto is not None:  # the engine's slot is a placeholder until auto's first decision
        families = f" diloco={','.join(config.auto.diloco)}" if config.auto.diloco else ""
        head = (f"compressor=auto candidates={','.join(config.auto.candidates)}{families} plan={eng.plan} "
                f"warmup_steps={eng.warmup_steps} (dense steps profile the job, then auto chooses; docs/auto.md)")
    elif config.sync == "diloco":  # inner steps send nothing: the compressor is the pseudo-gradient's
        head = (f"sync=diloco {_diloco_options(config)} delta={config.diloco.compressor or config.compression.compressor}"
                + (f" collective={diloco.exchange.name} error_feedback={diloco.error_feedback}"
                   if diloco is not None and diloco.exchange is not None else " (dense fp32 allreduce)"))
        if diloco is not None and diloco.nodes is not None:  # nodes are the workers (docs/diloco.md)
            head += (f" workers={diloco.layout} (inner steps: fp32 mean inside the node; outer step: each "
                     "local rank's shard of Δ between nodes)")
    else:
        head = (f"compressor={config.compression.compressor} collective={engine.exchange.name} plan={eng.plan} "
                f"groups={len(engine.plan.groups)} warmup_steps={eng.warmup_steps} "
                f"error_feedback={engine.error_feedback}")
        if config.topology.kind != "flat":
            head += " " + _topology_words(config, engine)
        if config.sync == "osp":
            head += f" sync=osp {_osp_options(config)}"
        if engine.dense_mode is not None:
            head += (f"; a plain {engine.dense_mode} cast: sent on DDP's buckets as torch's 16-bit hook "
                     f"(dense mode {engine.dense_mode}, docs/compressors.md)")
    return "lightning_gc: " + head


def _topology_words(config: GCConfig, engine: Any) -> str:
    """``topology=nodes intra_dtype=fp32``, or for ``auto`` what it chose and why."""
    topo = config.topology
    if topo.kind == "nodes":
        return f"topology=nodes intra_dtype={topo.intra_dtype}"
    chosen = engine.topology.describe()
    return f"topology=auto chose {chosen} ({engine.topology.chosen})"


def _osp_options(config: GCConfig) -> str:
    osp = config.osp
    split = (f"deferred_fraction={osp.deferred_fraction}" if osp.deferred_fraction is not None
             else f"deferred=S(Gu) schedule round_steps={osp.round_steps}")
    ratio = f" deferred_ratio={osp.deferred_ratio}" if osp.deferred_ratio is not None else ""
    return f"{split} deferred_compressor={osp.deferred_compressor}{ratio}"


def _diloco_options(config: GCConfig) -> str:
    d = config.diloco
    return (f"inner_steps={d.inner_steps} fragments={d.fragments} overlap_steps={d.overlap_steps} "
            f"mixing={d.mixing} outer={d.outer_optimizer}({d.resolved_args()})")


def adopt_defaults(config: GCConfig, engine: GCEngine, optimizers: list[Any], new: list[Any] | None = None) -> None:
    """Once the optimizers are known: the compressor's error-feedback default for them (BSP steps
    with a compressor the user picked; DiLoCo's engine sends no gradients and auto's candidates keep
    their own settings), and the algorithm's own advice about them (``new``: the optimizers not
    advised yet; default all)."""
    if config.sync != "diloco" and config.auto is None and config.compression.error_feedback is None:
        message = engine.adopt_error_feedback_default(optimizers)
        if message:
            rank_zero_info(message)
    for message in engine.compressor.advice(optimizers if new is None else new, engine.error_feedback):
        rank_zero_warn(message)


def check_setup(config: GCConfig, optimizers: list[Any], *, fp16_scaler: bool, automatic_optimization: bool) -> None:
    """Refuse, once the optimizers and precision are known, what the configured synchronisation cannot run
    with (each participant's own rule; today only OSP has one)."""
    if config.sync == "osp":
        check_training_setup(optimizers, fp16_scaler, automatic_optimization)


def apply_state(session: StepSession, state: dict[str, Any]) -> None:
    """Restore a checkpoint's ``"lightning_gc"`` entry into the session, warning about error memory
    the checkpoint did not hold."""
    missing = session.load_state_dict(state)
    if missing:
        rank_zero_warn(
            f"lightning_gc: error memory for {len(missing)} parameter(s) was not in the checkpoint "
            f"(e.g. {missing[:3]}); it starts at zero."
        )


class SessionAccess:
    """What both front doors keep of the session they assemble, and how they build and restore it."""

    _config: GCConfig
    _compressor_name: str
    _assembly: Assembly | None = None
    _engine: GCEngine | None = None
    _session: StepSession | None = None
    _pending_state: dict | None = None
    num_processes: int

    @property
    def engine(self) -> GCEngine | None:
        """The communication engine (``None`` before the model is wrapped)."""
        return self._engine

    @property
    def session(self) -> StepSession | None:
        """The step session: the engine and its participants (``None`` before the model is wrapped)."""
        return self._session

    @property
    def compressor_name(self) -> str:
        return self._compressor_name

    @property
    def config(self) -> GCConfig:
        """The validated configuration tree built from the keyword arguments (lightning_gc/config.py)."""
        return self._config

    @property
    def diloco(self) -> DiLoCoSync | None:
        """The DiLoCo synchroniser with ``sync="diloco"`` (``None`` before setup or otherwise)."""
        return self._assembly.diloco if self._assembly is not None else None

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped on every rank because the gradient was non-finite."""
        return self._session.skipped_steps if self._session is not None else 0

    def _assemble(self, ddp: DistributedDataParallel, scaler: Any) -> None:
        """Build the session on ``ddp``, with the checkpoint state read before it existed."""
        self._assembly = build_session(self._config, ddp, scaler=scaler, pending_state=self._pending_state,
                                       ranks_per_node=self.num_processes)
        self._engine, self._session, self._pending_state = self._assembly.engine, self._assembly.session, None

    def _apply_state(self, state: dict[str, Any]) -> None:
        """A checkpoint's ``"lightning_gc"`` entry: into the session, or kept until it is built."""
        if self._session is not None:
            apply_state(self._session, state)
        else:
            self._pending_state = state


__all__ = ["Assembly", "SessionAccess", "adopt_defaults", "apply_state", "build_session", "casts_on_buckets", "check_setup", "startup_header"]
