"""GCStrategy: Lightning's DDPStrategy with lightning_gc's communication engine as its comm hook.

Usage::

    import lightning_gc  # registers the gc_* strategy aliases
    trainer = Trainer(strategy=GCStrategy(compressor="topk", ratio=0.01), accelerator="cpu", devices=2)
    trainer = Trainer(strategy="gc_topk", accelerator="cpu", devices=2)

Why a DDPStrategy subclass: DDP already handles bucket readiness, overlap with backward, unused
parameters, ``no_sync`` during gradient accumulation and mixed precision; the engine plugs into
DDP's communication hook. Lightning's own ``DDPStrategy`` registers comm hooks only when the
device is CUDA and silently ignores them on CPU; this strategy registers its hook on every device
type (tests check ``model._get_ddp_logging_data()["comm_hook"]``).

State: error memory (per rank, keyed by parameter name), the step counter and the gain statistics
are saved in every Lightning checkpoint under ``"lightning_gc"`` (all ranks' states gathered to
the file) and restored on resume. A resume with another world size resets error memory with a
warning and keeps the step counter.
"""

from __future__ import annotations

import difflib
import inspect
import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.pytorch.accelerators import AcceleratorRegistry
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher
from lightning.pytorch.utilities.exceptions import _augment_message
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from ._names import guard_registry, positional_string_message
from .assembly import SessionAccess, adopt_defaults, check_setup
from .auto import AutoChooser, AutoConfig
from .compressors import available_compressors, get_entry
from .config import FLAT_FIELDS, GCConfig
from .engine import EngineConfig
from .engine.exit import ExitCleanMultiProcessingLauncher, destroy_default_group_at_exit
from .engine.omgs import OMGSConfig, OMGSController
from .engine.owner import SessionOwner
from .summary import GCSummary, summarize
from .sync import OSPSync

log = logging.getLogger(__name__)

CHECKPOINT_KEY = "lightning_gc"
#: DDP bucket size used with plans other than "model" unless bucket_cap_mb is given (see __init__)
PIPELINED_BUCKET_CAP_MB = 1.0
UNUSED_PARAMETERS_SUFFIX = "_find_unused_parameters_true"
try:  # the default timeout of torch.distributed
    from torch.distributed.constants import default_pg_timeout
except ImportError:  # pragma: no cover
    default_pg_timeout = timedelta(minutes=30)


def _ddp_keywords() -> list[str]:
    """Keyword arguments Lightning may pass on to DistributedDataParallel (``module`` and
    ``device_ids`` are Lightning's own: it sets them from the model and ``devices=``)."""
    params = inspect.signature(DistributedDataParallel.__init__).parameters
    return [n for n, p in params.items() if n not in ("self", "module", "device_ids")
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def _check_ddp_kwargs(kwargs: dict[str, Any]) -> None:
    """Refuse a DDP keyword DDP does not take now, not in every process after launch."""
    valid = _ddp_keywords()
    own = [n for n, p in inspect.signature(GCStrategy.__init__).parameters.items()
           if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and n != "self"]
    for key in kwargs:
        if key in valid:
            continue
        if key == "device_ids":
            raise ValueError(
                "device_ids= cannot be passed to GCStrategy: Lightning sets DDP's device_ids from the "
                "Trainer's devices= argument. Use Trainer(devices=[...]) instead."
            )
        close = difflib.get_close_matches(key, valid + own, n=1, cutoff=0.6)
        suggestion = f" Did you mean {close[0]}=?" if close else ""
        raise ValueError(
            f"GCStrategy got an unknown keyword argument {key}={kwargs[key]!r}: it is neither a GCStrategy "
            f"argument nor one of torch.nn.parallel.DistributedDataParallel's ({', '.join(valid)}).{suggestion}"
        )


def _unused_help(compressor: str) -> str:
    return (
        "lightning_gc: some parameters of the LightningModule were not used to produce the loss returned by "
        "training_step, so their gradients never reached DDP's communication hook. If this is intentional, "
        "enable DDP's unused-parameter detection on the GCStrategy itself: "
        f"GCStrategy(compressor={compressor!r}, find_unused_parameters=True), or the alias "
        f"strategy='gc_{compressor}_find_unused_parameters_true', or in a LightningCLI config "
        f"strategy: {{class_path: lightning_gc.GCStrategy, init_args: {{compressor: {compressor}, "
        "find_unused_parameters: true}}. (Lightning's usual advice, 'ddp_find_unused_parameters_true' or "
        "DDPStrategy(find_unused_parameters=True), would replace GCStrategy by plain DDP and drop compression.)"
    )


# DDP's own message (Lightning rewrites it in DDPStrategy.on_exception) and the engine's
_UNUSED_PATTERNS = (
    ".*Expected to have finished reduction in the prior iteration.*",
    ".*It looks like your LightningModule has parameters that were not used.*",
    ".*lightning_gc: step .* ended with plan groups .* incomplete.*",
)


def _config_from(config: GCConfig | None, flat: dict[str, Any]) -> GCConfig:
    """The configuration tree: ``config`` as given, or built from the flat keywords. Both at once is
    refused unless every flat keyword is left at its default (one source of truth, no merge rule)."""
    if config is None:
        return GCConfig.from_flat(**flat)
    if not isinstance(config, GCConfig):
        raise TypeError(f"GCStrategy(config={config!r}): expected a lightning_gc.config.GCConfig (e.g. "
                        "GCConfig.from_flat(compressor='topk', ratio=0.01)), or use the flat keyword arguments.")
    params = inspect.signature(GCStrategy.__init__).parameters
    given = [n for n in FLAT_FIELDS if n in flat and flat[n] != params[n].default]
    if given:
        raise ValueError(
            f"GCStrategy got config= and {', '.join(f'{n}={flat[n]!r}' for n in given)}: the configuration comes "
            "from one place. Put these into the tree (GCConfig.from_flat(..., "
            f"{given[0]}=...), or dataclasses.replace), or drop config= and pass the flat keywords only.")
    return config


def check_trainer_setup(config: GCConfig, callbacks: list[Any]) -> None:
    """Refuse a Trainer callback the configuration cannot serve, before any step."""
    from .adaptive.callback import AdaptiveRatio

    if config.sync == "diloco" and any(isinstance(cb, AdaptiveRatio) for cb in callbacks):
        raise ValueError(
            "GCStrategy(sync='diloco') with the AdaptiveRatio callback: inner steps send no gradients, so there "
            "is no per-step compression ratio to adapt. Drop AdaptiveRatio, or use sync='bsp'."
        )


class GCStrategy(SessionAccess, DDPStrategy, SessionOwner):
    """Data-parallel training with compressed gradient communication.

    A drop-in for :class:`~lightning.pytorch.strategies.DDPStrategy`: the positional arguments are
    DDPStrategy's, in DDPStrategy's order (``accelerator, parallel_devices, cluster_environment,
    checkpoint_io, precision_plugin, ddp_comm_state, ddp_comm_hook, ddp_comm_wrapper,
    model_averaging_period, process_group_backend, timeout, start_method``); the four comm-hook
    arguments must stay ``None`` because the engine is the hook. Everything specific to
    lightning_gc is keyword-only.

    Keyword-only args:
        compressor: algorithm name; one of :func:`lightning_gc.compressors.available_compressors`
            (``dense``, ``fp16``, ``bf16``, ``topk``, ``lwtopk``, ``mstopk``, ``randomk``, ``qsgd``,
            ``signsgd``, ``efsignsgd``, ...; docs/compressors.md), or ``"auto"``: after a few dense
            steps that profile the job, choose the method with the least predicted time per unit
            of progress among fp32 DDP, the 16-bit hook, our PowerSGD-family ``lowrank`` and
            compressors that pay on slow links, and choose again when the step time drifts
            (docs/auto.md; options in ``auto``).
        ratio: fraction of elements kept, in (0, 1], for compressors that take one (Top-k family,
            RandomK); default: the compressor's own default (0.01).
        compressor_args: further options of the compressor, e.g. ``{"levels": 15}`` for QSGD.
        collective: ``"auto"`` (the compressor's natural collective) or an explicit one; an
            incompatible pair is refused here with the valid alternatives.
        plan: ``"model"``, ``"layer"`` or ``"threshold"`` grouping (docs/concepts.md), or
            ``"omgs"`` — the merge that minimises the modelled iteration time, from a backward
            profile and cost models measured on this job (docs/omgs.md); ``"omgs_paper"`` is the
            paper's Algorithm 1, for comparison.
        plan_threshold: elements per merged group for ``plan="threshold"``.
        min_compress_numel: tensors smaller than this are sent exactly.
        warmup_steps: dense optimizer steps before compression starts (≥ 1 recommended).
        error_feedback: ``None`` uses the compressor's default (on for Top-k and EF-signSGD, off
            for unbiased QSGD/RandomK and majority-vote signSGD).
        check_finite: agree across ranks on non-finite gradients (see ``nonfinite``).
        nonfinite: ``"skip"`` — a step whose gradient is non-finite on any rank is skipped by the
            optimizer on every rank (with AMP fp16 the GradScaler does it); ``"propagate"`` — every
            rank receives the non-finite gradient, like plain DDP.
        seed: seed of all compressor randomness.
        monitor: add a :class:`~lightning_gc.callbacks.GCMonitor` if the Trainer has none.
        network_alpha_s, network_beta_s_per_byte: pin the alpha-beta network model (seconds per
            message, seconds per byte) used by ``artopk_auto`` instead of probing it.
        probe_every, probe_drift, probe_patience: when ``artopk_auto`` re-measures the network:
            every ``probe_every`` steps, or after ``probe_patience`` consecutive steps whose measured
            communication time differs from the model's prediction by more than ``probe_drift``.
        omgs: options of the OMGS profiler/planner (:class:`~lightning_gc.engine.omgs.OMGSConfig` or a
            dict of its fields). With ``plan="omgs"``/``"omgs_paper"`` the defaults apply when
            omitted; given with another plan, the job is profiled and the plan's predicted step
            time logged next to the measured one, without changing the plan. Backward is profiled
            on the provisional plan's compressed steps (no extra dense step); with
            ``profile_on="dense"`` (or ``overlap=False``) ``warmup_steps`` is raised to
            ``OMGSConfig.dense_steps_needed`` if smaller (docs/omgs.md).
        overlap: run compressed exchanges on the engine's worker thread, overlapped with the rest
            of backward (default). ``False`` runs them synchronously inside DDP's hook: the same
            results bit for bit, slower; the oracle and a debugging aid.
        check_every: a compressed step opens with the cross-rank opening check at the first step,
            after a change no other collective compared, and every ``check_every`` steps (default
            50); every compressed step's closing report carries the same check at no extra
            message. ``1`` checks before every step (a custom controller's debugging aid; it costs
            one latency-bound collective per step). See ``EngineConfig.check_every``.
        report_rides: send a compressed step's closing report inside the step's last message where
            it can ride (``lowrank``'s second allreduce) instead of in an allreduce of its own (default
            ``True``: one latency-bound collective per step fewer). See ``EngineConfig.report_rides``.
        topology: ``"flat"`` (default): every exchange across all ranks. ``"nodes"``: a dense
            reduce-scatter inside each node, the compressor only between nodes on each rank's shard,
            then an allgather inside the node (docs/topology.md); ranks per node are the Trainer's
            ``devices`` (``num_nodes`` nodes). With ``sync="diloco"`` nodes are DiLoCo's workers:
            inner steps average gradients inside the node, outer steps send each rank's shard of Δ
            between nodes (docs/diloco.md). Refused with OSP, OMGS, ``auto`` and collectives that
            cannot run on a sub-group (``lightning_gc.comm.hierarchy.refusal``). ``"auto"``: measure
            both links when training starts and take ``"nodes"`` when the one between nodes is
            ``topology_auto_ratio`` times slower per byte, else ``"flat"`` (always flat where ``"nodes"``
            is refused).
        topology_ranks_per_node: with ``topology="nodes"`` or ``"auto"``: override the ranks per node
            (emulate nodes on one machine, e.g. 2 on 4 processes).
        topology_intra_dtype: with ``topology="nodes"`` or ``"auto"``: ``"fp32"`` (default) or ``"bf16"``
            for the intra-node reduce-scatter of compressed groups.
        topology_auto_ratio: with ``topology="auto"``: how much slower per byte the link between nodes
            must be for ``"nodes"`` (default 4; ``TopologyConfig.auto_ratio`` says how to tune it).
        sync: ``"bsp"`` (default): every layer is synchronised before the optimizer step.
            ``"osp"``: two-stage synchronisation (docs/osp.md): the least important layers are
            updated with the local gradient and all-reduced while the next step computes, then
            corrected (LGP). Requires ``torch.optim.SGD``, ``Adam`` or ``AdamW``; gradient clipping is
            computed from replicated values (docs/osp.md).
            ``"diloco"``: DiLoCo (docs/diloco.md): every rank takes ``diloco_inner_steps`` local
            optimizer steps with no gradient synchronisation, then an outer step averages the
            pseudo-gradient θ_outer − θ_local through ``compressor`` (``"dense"``: exact fp32) with
            error feedback, and every rank loads the new θ_outer.
        osp_deferred_fraction: with ``sync="osp"``: ``None`` follows the S(Gu) schedule; a number in
            [0, 0.8] pins the fraction of the model's elements deferred per step.
        osp_round_steps: with ``sync="osp"`` and the schedule: optimizer steps per round (round 1
            is synchronous and measures the reference loss).
        osp_deferred_compressor: with ``sync="osp"``: how the deferred stage is sent, ``"dense"``
            (default) or a compressor name (``"topk"``, ``"qsgd"``, ``"bf16"``, ...; error
            feedback per layer where the compressor uses it). Compress it when the routine stage
            is compressed: a dense deferred stage otherwise carries most of the bytes.
        osp_deferred_ratio: the ratio of ``osp_deferred_compressor`` (``None``: its default).
        diloco_inner_steps: with ``sync="diloco"``: H, local optimizer steps per outer step.
        diloco_outer_optimizer: with ``sync="diloco"``: the outer optimizer, a ``torch.optim`` class
            name (``"SGD"``, ``"AdamW"``, ...) or a dotted path to an Optimizer subclass.
        diloco_outer_args: with ``sync="diloco"``: its keyword arguments (``None``: for SGD the
            published ``lr=0.7, momentum=0.9, nesterov=True``; the optimizer's defaults otherwise).
        diloco_fragments, diloco_overlap_steps, diloco_mixing: Streaming DiLoCo with
            ``sync="diloco"``: F fragments synchronised in turn, each exchange overlapped with the
            next τ inner steps on a worker thread, merged as ``α·θ_local + (1 − α)·θ_outer``
            (defaults 1, 0, 0: plain DiLoCo). See docs/diloco.md.
        diloco_error_decay: with ``sync="diloco"`` and a compressed Δ: SparseLoCo's β, the error
            memory is scaled by it before it is added to the next Δ (1.0: plain error feedback;
            SparseLoCo: 0.95 with outer SGD lr 1 and no momentum).
        diloco_compressor, diloco_compressor_args: with ``sync="diloco"``: ``"sparseloco"`` sends Δ as
            SparseLoCo does (chunked Top-k, 2/4-bit values, per-rank error feedback, allgathered; outer
            SGD lr 1 without momentum unless ``diloco_outer_args`` is given) with these options
            (``density``, ``chunk``, ``bits``, ``rounding``). See docs/diloco.md.
        config: the whole configuration as one tree (:class:`~lightning_gc.config.GCConfig`, e.g.
            ``GCConfig.from_flat(compressor="topk", ratio=0.01)``) instead of the flat keywords above,
            which are then refused if set: the configuration comes from one place.
        process_group_backend, timeout, start_method: as in ``DDPStrategy``.
        **kwargs: passed to ``torch.nn.parallel.DistributedDataParallel`` (e.g. ``bucket_cap_mb``;
            with a plan other than ``"model"`` it defaults to 1 MB instead of DDP's 25 MB, so that
            groups complete, and their exchanges start, while backward is still running;
            ``find_unused_parameters``); a name DDP does not take is refused here, naming the
            closest valid one. Models with parameters unused in ``training_step`` need
            ``find_unused_parameters=True`` (or the alias ``gc_<compressor>_find_unused_parameters_true``).
    """

    strategy_name = "gc"

    def __init__(
        self,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        ddp_comm_state: object | None = None,
        ddp_comm_hook: Callable | None = None,
        ddp_comm_wrapper: Callable | None = None,
        model_averaging_period: int | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        *,
        compressor: str = "topk",
        ratio: float | None = None,
        compressor_args: dict[str, Any] | None = None,
        collective: str = "auto",
        plan: str = "model",
        plan_threshold: int = 8192,
        min_compress_numel: int = 1024,
        warmup_steps: int = 1,
        error_feedback: bool | None = None,
        check_finite: bool = True,
        nonfinite: Literal["skip", "propagate"] = "skip",
        seed: int = 0,
        monitor: bool = True,
        network_alpha_s: float | None = None,
        network_beta_s_per_byte: float | None = None,
        probe_every: int = 1000,
        probe_drift: float = 0.5,
        probe_patience: int = 5,
        overlap: bool = True,
        check_every: int = 50,
        report_rides: bool = True,
        omgs: OMGSConfig | dict | None = None,
        auto: AutoConfig | dict | None = None,
        sync: Literal["bsp", "osp", "diloco"] = "bsp",
        topology: Literal["flat", "nodes", "auto"] = "flat",
        topology_ranks_per_node: int | None = None,
        topology_intra_dtype: Literal["fp32", "bf16"] = "fp32",
        topology_auto_ratio: float = 4.0,
        osp_deferred_fraction: float | None = None,
        osp_round_steps: int = 50,
        osp_deferred_compressor: str = "dense",
        osp_deferred_ratio: float | None = None,
        diloco_inner_steps: int = 50,
        diloco_outer_optimizer: str = "SGD",
        diloco_outer_args: dict[str, Any] | None = None,
        diloco_fragments: int = 1,
        diloco_overlap_steps: int = 0,
        diloco_mixing: float = 0.0,
        diloco_error_decay: float = 1.0,
        diloco_compressor: str | None = None,
        diloco_compressor_args: dict[str, Any] | None = None,
        config: GCConfig | None = None,
        **kwargs: Any,
    ) -> None:
        # the flat keywords above are FLAT_FIELDS' names; their place in the typed tree is that table's alone
        arguments = locals()
        flat = {name: arguments[name] for name in FLAT_FIELDS}
        if isinstance(accelerator, str) and accelerator not in AcceleratorRegistry:
            # GCStrategy("qsgd") would otherwise become accelerator="qsgd" and fail at Trainer setup
            raise ValueError(positional_string_message(
                accelerator, AcceleratorRegistry.available_accelerators(), available_compressors()))
        forbidden = {"ddp_comm_state": ddp_comm_state, "ddp_comm_hook": ddp_comm_hook,
                     "ddp_comm_wrapper": ddp_comm_wrapper, "model_averaging_period": model_averaging_period}
        for key, value in forbidden.items():
            if value is not None:
                raise ValueError(
                    f"GCStrategy installs its own DDP communication hook, so {key}= cannot be used. "
                    "Use lightning's DDPStrategy for a custom hook, or pick a lightning_gc compressor."
                )
        _check_ddp_kwargs(kwargs)
        if plan != "model" and "bucket_cap_mb" not in kwargs:
            # DDP hands the hook a bucket only when every gradient in it is ready; with its default
            # 25 MB buckets a ResNet-18 step has two or three buckets, so per-layer groups could not
            # start before half of backward was over. Small buckets let pipelined plans overlap.
            kwargs["bucket_cap_mb"] = PIPELINED_BUCKET_CAP_MB
        self._config = _config_from(config, flat)
        self._compressor_name = self._config.diloco.compressor or self._config.to_flat()["compressor"]
        self._failed = False
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            **kwargs,
        )

    # ------------------------------------------------------------------ public
    @property
    def auto(self) -> AutoChooser | None:
        """The run-time method chooser of ``compressor="auto"`` (``None`` otherwise or before setup)."""
        return self._assembly.auto if self._assembly is not None else None

    @property
    def omgs(self) -> OMGSController | None:
        """The OMGS profiler/planner (``None`` unless ``plan="omgs"``/``"omgs_paper"`` or ``omgs=`` given)."""
        return self._assembly.omgs if self._assembly is not None else None

    @property
    def osp(self) -> OSPSync | None:
        """The two-stage synchroniser with ``sync="osp"`` (``None`` before setup or with BSP)."""
        return self._assembly.osp if self._assembly is not None else None

    @property
    def ddp_kwargs(self) -> dict[str, Any]:
        """The keyword arguments passed on to ``DistributedDataParallel`` (validated; a copy)."""
        return dict(self._ddp_kwargs)

    @property
    def engine_config(self) -> EngineConfig:
        return self._config.engine

    def summary(self) -> GCSummary | None:
        """What compression did in this process so far (``None`` before the model is wrapped).

        Computed from :meth:`GCEngine.totals` (this rank's counters) and ``skipped_steps``; the
        :class:`~lightning_gc.callbacks.GCMonitor` prints it on rank zero at the end of ``fit``.
        """
        if self._engine is None:
            return None
        return summarize(self._engine, self._compressor_name, self.skipped_steps, self.diloco, self.auto,
                         osp=self.osp)

    # ------------------------------------------------------------------ lifecycle
    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        destroy_default_group_at_exit()  # an orderly gloo exit (lightning_gc/engine/exit.py)

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if type(self._launcher) is _MultiProcessingLauncher:  # spawn/fork workers: an orderly exit too
            self._launcher = ExitCleanMultiProcessingLauncher(self, start_method=self._start_method)

    @override
    def setup(self, trainer: Any) -> None:
        from .callbacks.session_hooks import put_first

        if self._config.monitor:
            from .callbacks.monitor import GCMonitor

            if not any(isinstance(cb, GCMonitor) for cb in trainer.callbacks):
                trainer.callbacks.append(GCMonitor())
        check_trainer_setup(self._config, trainer.callbacks)
        put_first(trainer.callbacks)  # the session's evaluation view and end of training, before every callback
        super().setup(trainer)
        check_setup(self._config, self.optimizers, fp16_scaler=self._scaler is not None,
                    automatic_optimization=self.lightning_module.automatic_optimization)
        self._route_clipping()
        if self._engine is not None:  # the error-feedback default and the algorithm's advice, knowing the optimizers
            adopt_defaults(self._config, self._engine, self.optimizers)

    def _route_clipping(self) -> None:
        """Send every clipping of the gradients (``gradient_clip_val`` and ``configure_gradient_clipping``
        overrides alike reach the precision plugin's ``clip_gradients``) through the session, whose
        participants may clip otherwise (OSP clips by a transform identical on every rank while part of
        the gradient is still local, :meth:`~lightning_gc.sync.OSPSync.clip_gradients`)."""
        plugin = self.precision_plugin
        clip_gradients = plugin.clip_gradients
        if getattr(clip_gradients, "lightning_gc_session", False):
            return

        def clip_through_session(optimizer: Any, clip_val: Any = 0.0, gradient_clip_algorithm: Any = "norm") -> None:
            def plain() -> None:
                clip_gradients(optimizer, clip_val, gradient_clip_algorithm)

            if self._session is None or not clip_val or clip_val <= 0:  # the plugin returns early for clip_val <= 0
                return plain()
            algorithm = getattr(gradient_clip_algorithm, "value", gradient_clip_algorithm)
            return self._session.clip_gradients(optimizer, float(clip_val), str(algorithm), plain)

        clip_through_session.lightning_gc_session = True  # type: ignore[attr-defined]
        plugin.clip_gradients = clip_through_session  # type: ignore[method-assign]

    @property
    def _scaler(self) -> Any:
        """The AMP GradScaler of fp16 mixed precision, if any."""
        plugin = self.precision_plugin
        return getattr(plugin, "scaler", None) if isinstance(plugin, MixedPrecision) else None

    @override
    def _register_ddp_hooks(self) -> None:
        # Lightning registers hooks only on CUDA; the engine must run on every device type.
        assert isinstance(self.model, DistributedDataParallel)
        self._assemble(self.model, self._scaler)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        super().load_optimizer_state_dict(checkpoint)
        if self._session is not None:  # e.g. DiLoCo: Lightning restored rank 0's inner state everywhere
            self._session.on_optimizer_state_loaded(self.optimizers)

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """Every optimizer step — Lightning's and the adaptive controller's rollback steps — goes
        through the step session (engine and participants, in their order)."""
        if self._session is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        return self._session.optimizer_step(
            optimizer, closure, lambda c: super(GCStrategy, self).optimizer_step(optimizer, c, model, **kwargs))

    @override
    def teardown(self) -> None:
        if self._session is not None and not self._failed:
            # what on_train_end would have done, if it did not run: Lightning skips the training loop (and
            # on_train_end) when a run resumed at its last step has nothing left to train (DiLoCo's last round)
            self._session.finish()
        # stop the exchange workers and release their process groups before DDP and the default
        # process group go away: an orderly exit instead of threads dying with the interpreter
        if self._session is not None:
            self._session.close(timeout=60.0)
        super().teardown()

    def drain(self, timeout: float | None = None) -> bool:
        """Finish the participants' work in flight (OSP's deferred exchange and its correction) so
        that parameters are final; called before checkpoints, evaluation and at the end of fit
        (:class:`~lightning_gc.callbacks.session_hooks.SessionHooks`)."""
        return self._session.drain(timeout) if self._session is not None else True

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        # Lightning reads the model and optimizer state for a checkpoint before save_checkpoint
        if self._session is None:
            return super().lightning_module_state_dict()
        self.drain()
        with self._session.evaluation_view() as swapped:  # DiLoCo: a checkpoint's weights are θ_outer
            state = super().lightning_module_state_dict()
            return {k: v.clone() for k, v in state.items()} if swapped else state

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        if self._session is not None:
            self._session.on_train_start()

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        if self._session is not None:
            self._session.on_validation_start()

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self._session is not None:
            self._session.on_train_batch_start(batch_idx)

    @override
    def on_validation_end(self) -> None:
        super().on_validation_end()
        if self._session is not None:
            self._session.on_validation_end()

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._failed = True  # teardown must not start collectives peers may never join
        if self._session is not None:
            try:  # peers may be gone: wait a bounded time, never hang the error path
                self._session.drain(timeout=30.0)
            except Exception as e:  # noqa: BLE001 - the original exception matters more
                log.warning("lightning_gc: pending deferred synchronisation lost on exception: %r", e)
        # Lightning's DDPStrategy suggests ddp_find_unused_parameters_true / DDPStrategy(...), which
        # would silently replace lightning_gc by plain DDP: say how to do it with GCStrategy instead.
        for pattern in _UNUSED_PATTERNS:
            _augment_message(exception, pattern=pattern, new_message=_unused_help(self._compressor_name))

    # ------------------------------------------------------------------ checkpoints
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if self._session is not None:
            checkpoint[CHECKPOINT_KEY] = self._gather_state()
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        if self._session is not None:  # saved between steps (auto: in the next step's wall)
            self._session.on_checkpoint_saved()

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        state = checkpoint.get(CHECKPOINT_KEY)
        if state is not None:
            self._apply_state(state)
        return checkpoint

    def _gather_state(self) -> dict[str, Any]:
        assert self._session is not None
        return {**self._session.state_dict(), "compressor": self._compressor_name}

    # ------------------------------------------------------------------ registry
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        register_compressor_aliases(strategy_registry, cls, "lightning_gc")
        if "gc_auto" not in strategy_registry:
            strategy_registry.register(
                "gc_auto", cls, compressor="auto",
                description="lightning_gc: choose the method at run time (fp32/16-bit DDP, lowrank, Top-k, QSGD, "
                            "EF-signSGD) from measured costs (docs/auto.md)")
        if "gc_omgs" not in strategy_registry:  # a plan, not a compressor: Top-k with the OMGS merge plan
            strategy_registry.register(
                "gc_omgs", cls, description="lightning_gc: Top-k with the OMGS merge plan (docs/omgs.md)",
                compressor="topk", plan="omgs",
            )
        register_sync_aliases(strategy_registry, cls, "osp", "lightning_gc: OSP two-stage synchronisation, "
                              "routine layers with {}")
        register_sync_aliases(strategy_registry, cls, "diloco", "lightning_gc: DiLoCo (local inner steps, outer step "
                              "on Δ), Δ sent with {}")


def register_compressor_aliases(registry: Any, cls: type, label: str) -> None:
    """``gc_<compressor>`` and ``gc_<compressor>_find_unused_parameters_true`` for every compressor, in
    ``registry`` for ``cls`` (GCStrategy or GCFabricStrategy); ``label`` opens the descriptions."""
    for name in available_compressors():
        alias, summary = f"gc_{name}", get_entry(name).summary
        if alias not in registry:
            registry.register(alias, cls, description=f"{label}: {summary}", compressor=name)
        if alias + UNUSED_PARAMETERS_SUFFIX not in registry:
            registry.register(alias + UNUSED_PARAMETERS_SUFFIX, cls, compressor=name, find_unused_parameters=True,
                              description=f"{label}: {summary}; find_unused_parameters=True")


def register_sync_aliases(registry: Any, cls: type, sync: str, description: str) -> None:
    """``gc_<sync>`` (a dense exchange) and ``gc_<compressor>_<sync>`` (``description`` formats the
    compressor's name; OSP: the routine stage's compressor, DiLoCo: the pseudo-gradient's)."""
    aliases = {f"gc_{sync}": "dense", **{f"gc_{name}_{sync}": name for name in available_compressors()}}
    for alias, name in aliases.items():
        if alias not in registry:
            registry.register(alias, cls, description=description.format(name), compressor=name, sync=sync)


def register_aliases() -> None:
    """Register ``gc_<compressor>`` for every known compressor in Lightning's strategy registry; a
    misspelt ``gc_`` name is then refused with the closest alias (``_names.guard_registry``)."""
    GCStrategy.register_strategies(StrategyRegistry)
    guard_registry(StrategyRegistry)
