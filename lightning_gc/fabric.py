"""Lightning Fabric support: :class:`GCFabricStrategy`, the same engine as :class:`~lightning_gc.GCStrategy`.

Fabric's own ``DDPStrategy`` takes no communication hook, so Fabric users get a strategy of their
own (docs/fabric.md has the loop, the table of what differs from the Trainer, and DiLoCo's
``finish()``). The keyword arguments are validated by ``GCStrategy`` itself, and the session is
built by the same :func:`~lightning_gc.assembly.build_session`, so refusals, defaults, the step
session, the checkpoint state and the ``gc/*`` tags are shared with the Trainer path.

What Fabric has no place for is refused at construction: ``sync="osp"`` (its S(Gu) schedule reads
the loss from Lightning's training-step closure and it must be drained before evaluation and
checkpoints, which the Trainer's callbacks do), OMGS and ``compressor="auto"`` (both time forward
and backward inside the optimizer closure, while Fabric runs backward before ``optimizer.step()``).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Literal

from lightning.fabric.accelerators import ACCELERATOR_REGISTRY
from lightning.fabric.plugins.precision.amp import MixedPrecision
from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from ._names import guard_registry, positional_string_message
from .assembly import SessionAccess, adopt_defaults
from .callbacks.monitor import step_metrics
from .compressors import available_compressors
from .config import GCConfig
from .engine.exit import destroy_default_group_at_exit
from .engine.omgs import OMGS_PLANS
from .strategy import CHECKPOINT_KEY, GCStrategy, register_compressor_aliases, register_sync_aliases
from .summary import GCSummary, summarize

try:  # the default timeout of torch.distributed
    from torch.distributed.constants import default_pg_timeout
except ImportError:  # pragma: no cover
    default_pg_timeout = timedelta(minutes=30)

__all__ = ["GCFabricStrategy", "register_fabric_aliases"]


def _refuse_unsupported(config: GCConfig) -> None:
    """What Fabric's loop cannot serve, refused at construction (reasons in the module docstring)."""
    if config.sync == "osp":
        raise ValueError(
            "GCFabricStrategy(sync='osp') is not supported: OSP's S(Gu) schedule reads the training loss from "
            "Lightning's optimizer closure and its deferred exchange must be drained before evaluation and "
            "checkpoints, which the Trainer's callbacks do and Fabric has no place for. Use sync='bsp' or "
            "sync='diloco' with Fabric, or GCStrategy(sync='osp') with a Lightning Trainer (docs/osp.md)."
        )
    if config.omgs is not None:
        plan = config.engine.plan
        what = f"plan={plan!r}" if plan in OMGS_PLANS else "omgs="
        raise ValueError(
            f"GCFabricStrategy({what}) is not supported: OMGS times backward inside "
            "the optimizer closure, and with Fabric backward runs before optimizer.step(). Use plan='model', 'layer' "
            "or 'threshold' with Fabric, or GCStrategy(plan='omgs') with a Lightning Trainer (docs/omgs.md)."
        )
    if config.auto is not None:
        raise ValueError(
            "GCFabricStrategy(compressor='auto') is not supported: auto profiles forward and backward inside the "
            "optimizer closure to predict each method's step, and with Fabric backward runs before "
            "optimizer.step(). Pick the method for Fabric (`lightning-gc advise` predicts it from a profile of your "
            "job; docs/choosing.md), or use GCStrategy(compressor='auto') with a Lightning Trainer (docs/auto.md)."
        )


class GCFabricStrategy(SessionAccess, FabricDDPStrategy):
    """Lightning Fabric's ``DDPStrategy`` with lightning_gc's engine as DDP's communication hook.

    The positional arguments are Fabric ``DDPStrategy``'s, in its order; every other keyword argument
    is :class:`~lightning_gc.GCStrategy`'s (docs/getting-started.md) or DDP's (``bucket_cap_mb``,
    ``find_unused_parameters``), validated by ``GCStrategy`` with the same refusals. ``sync="osp"``,
    OMGS and ``compressor="auto"`` are refused (see the module docstring).
    """

    def __init__(
        self,
        accelerator: Any = None,
        parallel_devices: Any = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision: Any = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **kwargs: Any,
    ) -> None:
        if isinstance(accelerator, str) and accelerator not in ACCELERATOR_REGISTRY:
            raise ValueError(positional_string_message(
                accelerator, list(ACCELERATOR_REGISTRY.available_accelerators()), available_compressors()
            ).replace("GCStrategy(", "GCFabricStrategy(").replace("Trainer(accelerator=", "Fabric(accelerator="))
        # the Trainer strategy validates every argument and works out the DDP keywords: one code path
        spec = GCStrategy(process_group_backend=process_group_backend, timeout=timeout, start_method=start_method,
                          **kwargs)
        _refuse_unsupported(spec.config)
        self._config = spec.config
        self._compressor_name = spec.compressor_name
        self._ddp: DistributedDataParallel | None = None
        self._closed = False
        self._optimizers_seen: list = []
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            **spec.ddp_kwargs,
        )

    # ------------------------------------------------------------------ public
    @property
    def ddp_model(self) -> DistributedDataParallel | None:
        """The DDP-wrapped module whose communication hook is the engine (``None`` before setup)."""
        return self._ddp

    def metrics(self) -> dict[str, float]:
        """The ``gc/*`` tags of the last optimizer step (what GCMonitor logs with a Trainer; empty
        before the first step): ``fabric.log_dict(fabric.strategy.metrics(), step=step)``."""
        if self._engine is None or self._engine.last_step is None:
            return {}
        return step_metrics(self._engine, self._engine.last_step)

    def summary(self) -> GCSummary | None:
        """What compression did on this rank so far (``None`` before ``fabric.setup``)."""
        if self._engine is None:
            return None
        return summarize(self._engine, self._compressor_name, self.skipped_steps, self.diloco)

    def finish(self) -> None:
        """End of training, on every rank (Fabric has no ``on_train_end``): finish work in flight and
        close an open DiLoCo round with its outer step, so every rank holds θ_outer. Call it after the
        loop, before evaluating, exporting or saving the final model. Idempotent."""
        if self._session is not None:
            self._session.finish()

    def close(self) -> None:
        """:meth:`finish`, then stop the engine's exchange worker and release its process group (call
        once training is over, on every rank, before the process group is destroyed). Idempotent."""
        if self._session is not None and not self._closed:
            self.finish()
            self._session.close(timeout=60.0)
            self._closed = True

    # ------------------------------------------------------------------ Fabric hooks
    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        destroy_default_group_at_exit()  # an orderly gloo exit (lightning_gc/engine/exit.py)

    @override
    def setup_module(self, module: Module) -> DistributedDataParallel:
        ddp = super().setup_module(module)
        if self._session is not None:
            raise RuntimeError(
                "GCFabricStrategy wraps one model: its engine is already set up. Put the parts of your model "
                "in one nn.Module and call fabric.setup once."
            )
        scaler = getattr(self.precision, "scaler", None) if isinstance(self.precision, MixedPrecision) else None
        self._assemble(ddp, scaler)
        self._ddp = ddp
        return ddp

    @override
    def setup_optimizer(self, optimizer: Any) -> Any:
        optimizer = super().setup_optimizer(optimizer)
        if self._engine is not None:  # the error-feedback default and the algorithm's advice, as GCStrategy
            self._optimizers_seen.append(optimizer)
            adopt_defaults(self._config, self._engine, self._optimizers_seen, new=[optimizer])
        return optimizer

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """Through the step session, like the Trainer path: the step is skipped on every rank when
        the gradient was non-finite on any rank (``nonfinite="skip"``, no GradScaler)."""
        if self._session is None:
            return super().optimizer_step(optimizer, **kwargs)
        user_closure = kwargs.pop("closure", None)

        def run(closure: Any) -> Any:
            if user_closure is not None:
                return FabricDDPStrategy.optimizer_step(self, optimizer, closure=closure, **kwargs)
            closure()  # backward already ran (fabric.backward): only the step decision
            return FabricDDPStrategy.optimizer_step(self, optimizer, **kwargs)

        return self._session.optimizer_step(optimizer, user_closure or (lambda: None), run)

    @override
    def save_checkpoint(self, path: Any, state: dict[str, Any], storage_options: Any | None = None,
                        filter: dict[str, Any] | None = None) -> None:
        if self._session is None:
            return super().save_checkpoint(path, state, storage_options=storage_options, filter=filter)
        # a collective: fabric.save calls this on every rank
        state = {**state, CHECKPOINT_KEY: {**self._session.state_dict(), "compressor": self._compressor_name}}
        with self._session.evaluation_view():  # DiLoCo: the model's weights are θ_outer (θ_local per rank above)
            super().save_checkpoint(path, state, storage_options=storage_options, filter=filter)
        self._session.on_checkpoint_saved()

    @override
    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True,
                        weights_only: bool | None = None) -> dict[str, Any]:
        remainder = super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        gc_state = remainder.pop(CHECKPOINT_KEY, None) if state else remainder.get(CHECKPOINT_KEY)
        if gc_state is not None:
            self._apply_state(gc_state)
        optimizers = [v for v in (state or {}).values() if isinstance(v, Optimizer)]
        if self._session is not None and optimizers:  # e.g. DiLoCo: the file holds rank 0's inner state
            self._session.on_optimizer_state_loaded(optimizers)
        return remainder

    @override
    def teardown(self) -> None:
        self.close()
        super().teardown()

    # ------------------------------------------------------------------ registry
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        register_compressor_aliases(strategy_registry, cls, "lightning_gc (Fabric)")
        register_sync_aliases(strategy_registry, cls, "diloco", "lightning_gc (Fabric): DiLoCo, Δ sent with {}")


def register_fabric_aliases() -> None:
    """Register the ``gc_*`` aliases in Fabric's strategy registry (``import lightning_gc`` does it)."""
    GCFabricStrategy.register_strategies(STRATEGY_REGISTRY)
    guard_registry(STRATEGY_REGISTRY)
