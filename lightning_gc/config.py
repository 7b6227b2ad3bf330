"""One configuration tree for lightning_gc, and the one mapping from flat names to it.

Users write flat keyword arguments — ``GCStrategy(compressor="topk", ratio=0.01, sync="osp",
osp_round_steps=50, ...)``, the same names under ``init_args`` in a LightningCLI YAML, and
``NAME:KEY=VALUE`` options in ``lightning-gc bench --methods``. The code reads a typed tree::

    GCConfig
    ├── compression: CompressionConfig   compressor, ratio, compressor_args, collective, error_feedback
    ├── engine:      EngineConfig        plan, plan_threshold, min_compress_numel, warmup_steps, ...
    ├── sync:        "bsp" | "osp" | "diloco"
    ├── osp:         OSPConfig           deferred_fraction, round_steps, deferred_compressor, deferred_ratio
    ├── diloco:      DiLoCoConfig        inner_steps, outer_optimizer, outer_args, fragments, overlap_steps, mixing, error_decay,
    │                                    compressor, compressor_args (SparseLoCo's Δ)
    ├── omgs:        OMGSConfig | None   profile_steps, ... (None: no OMGS)
    ├── auto:        AutoConfig | None   compressor="auto": candidates, progress_weight, ... (docs/auto.md)
    ├── topology:    TopologyConfig      kind ("flat" | "nodes"), ranks_per_node, intra_dtype (docs/topology.md)
    ├── nonfinite:   "skip" | "propagate"
    └── monitor:     bool

:data:`FLAT_FIELDS` is the single table from a flat name to its place in the tree (``omgs_<field>``
reaches an :class:`~lightning_gc.engine.omgs.OMGSConfig` field, as the bench spells it), and
:meth:`GCConfig.from_flat` is the one function that applies it: :class:`~lightning_gc.GCStrategy`
and the bench both build their configuration through it, so a field is validated, documented and
defaulted in exactly one place (its dataclass). Each section validates its own fields at
construction; :class:`GCConfig` checks the rules that span sections (OSP or DiLoCo options without
that synchronisation model, two owners of the merge plan, OMGS's profiling steps).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from ._validation import check_bool
from .auto.config import AutoConfig
from .comm.hierarchy import TopologyConfig, refusal
from .compressors import build_config, get_entry
from .engine.config import EngineConfig
from .engine.omgs import OMGS_PLANS, OMGSConfig
from .sync.diloco import DiLoCoConfig
from .sync.osp import OSPConfig


@dataclass(frozen=True)
class CompressionConfig:
    """Which compressor, with which options, over which collective.

    Attributes:
        compressor: a registered compressor name (``lightning-gc list``; docs/compressors.md).
        ratio: fraction of elements kept, in (0, 1], for compressors that take one (Top-k family,
            RandomK, AR-Topk); ``None``: the compressor's default (0.01).
        compressor_args: further options of the compressor, e.g. ``{"levels": 15}`` for QSGD.
        collective: ``"auto"`` (the compressor's natural collective) or an explicit compatible one.
        error_feedback: ``None`` uses the compressor's default (on for Top-k and EF-signSGD, off for
            unbiased QSGD/RandomK, majority-vote signSGD and GradiVeQ).
    """

    compressor: str = "topk"
    ratio: float | None = None
    compressor_args: Mapping[str, Any] | None = field(default_factory=dict)
    collective: str = "auto"
    error_feedback: bool | None = None

    def __post_init__(self) -> None:
        if self.compressor_args is None:
            object.__setattr__(self, "compressor_args", {})
        check_bool("error_feedback", self.error_feedback, "None uses the compressor's default.", allow_none=True)
        from .exchanges.registry import validate_collective

        probe = get_entry(self.compressor).compressor_cls(self.compressor_config())  # validates name and options
        validate_collective(probe, self.collective)

    def compressor_config(self) -> Any:
        """The compressor's own validated config (a new object each call)."""
        return build_config(self.compressor, self.ratio, dict(self.compressor_args) or None)

    def resolved(self) -> tuple[str, bool]:
        """(collective name with ``"auto"`` resolved, error feedback with ``None`` resolved)."""
        from .exchanges.registry import validate_collective

        probe = get_entry(self.compressor).compressor_cls(self.compressor_config())
        ef = probe.default_error_feedback if self.error_feedback is None else bool(self.error_feedback)
        return validate_collective(probe, self.collective), ef


#: flat name → (section, field); ``field`` None: the section itself is the value
FLAT_FIELDS: dict[str, tuple[str, str | None]] = {
    **{n: ("compression", n) for n in ("compressor", "ratio", "compressor_args", "collective", "error_feedback")},
    **{n: ("engine", n) for n in ("plan", "plan_threshold", "min_compress_numel", "warmup_steps", "check_finite",
                                  "seed", "network_alpha_s", "network_beta_s_per_byte", "probe_every",
                                  "probe_drift", "probe_patience", "overlap", "check_every",
                                  "report_rides")},
    **{f"osp_{n}": ("osp", n) for n in ("deferred_fraction", "round_steps", "deferred_compressor", "deferred_ratio")},
    **{f"diloco_{n}": ("diloco", n) for n in ("inner_steps", "outer_optimizer", "outer_args", "fragments",
                                              "overlap_steps", "mixing", "error_decay", "compressor",
                                              "compressor_args")},
    "topology": ("topology", "kind"),
    **{f"topology_{n}": ("topology", n) for n in ("ranks_per_node", "intra_dtype", "auto_ratio")},
    "sync": ("sync", None),
    "omgs": ("omgs", None),
    "auto": ("auto", None),
    "nonfinite": ("nonfinite", None),
    "monitor": ("monitor", None),
}
#: prefix → section, for the fields of a section given one by one (the bench's ``omgs_profile_steps=5``)
FLAT_PREFIXES: dict[str, str] = {"omgs_": "omgs", "auto_": "auto"}
#: what ``compressor="auto"`` runs in the engine's default slot: a compressor whose collective keeps the
#: network model, so every candidate's slot can be built (the chooser replaces it after the warm-up)
AUTO_ENGINE_DEFAULT = {"compressor": "artopk_auto"}


def _check_diloco_compressor(compression: CompressionConfig, name: str) -> None:
    """``diloco_compressor`` sends Δ itself: the per-step compressor options would name a second
    compressor of Δ. ``compressor`` may stay at its default (``"topk"``, unused) or be ``"dense"``;
    its error feedback cannot be switched off (SparseLoCo's memory is part of the method)."""
    given = {k: v for k, v in (("ratio", compression.ratio), ("collective", compression.collective),
                               ("compressor_args", dict(compression.compressor_args or {})))
             if v not in (None, "auto", {})}
    if compression.compressor not in ("topk", "dense"):
        given = {"compressor": compression.compressor, **given}
    if given:
        raise ValueError(
            f"diloco_compressor={name!r} sends the pseudo-gradient itself, so "
            f"{', '.join(f'{k}={v!r}' for k, v in given.items())} would name a second compressor of Δ. Give its "
            "options as diloco_compressor_args={'density': ..., 'chunk': ..., 'bits': ...}, and drop these "
            "(or drop diloco_compressor to send Δ with compressor=).")
    if compression.error_feedback is False:
        raise ValueError(
            f"diloco_compressor={name!r} with error_feedback=False: SparseLoCo's per-rank error memory is part of "
            "the method (what is not sent now is sent later). Drop error_feedback, or use another compressor.")


def is_flat_name(name: str) -> bool:
    """Whether ``name`` is a configuration name :meth:`GCConfig.from_flat` accepts."""
    return name in FLAT_FIELDS or any(name.startswith(p) for p in FLAT_PREFIXES)


@dataclass(frozen=True)
class GCConfig:
    """Everything lightning_gc adds to DDP, as one validated tree (see the module docstring).

    Build it from the flat names with :meth:`from_flat`; ``GCStrategy`` does, and exposes the result
    as ``GCStrategy.config``. Cross-section rules, refused with the value, the reason and the fix:
    OSP options without ``sync="osp"`` and DiLoCo options without ``sync="diloco"``; ``sync="osp"`` or
    ``sync="diloco"`` with OMGS (OSP and OMGS both own the merge plan; DiLoCo has none); OMGS's
    profile is taken on compressed steps by default and adds no dense step; with
    ``OMGSConfig.profile_on="dense"`` (or ``overlap=False``, which switches to it) ``engine.warmup_steps``
    is raised to cover it (said once).
    """

    compression: CompressionConfig = field(default_factory=CompressionConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    sync: Literal["bsp", "osp", "diloco"] = "bsp"
    osp: OSPConfig = field(default_factory=OSPConfig)
    diloco: DiLoCoConfig = field(default_factory=DiLoCoConfig)
    omgs: OMGSConfig | None = None
    auto: AutoConfig | None = None
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    nonfinite: Literal["skip", "propagate"] = "skip"
    monitor: bool = True

    def __post_init__(self) -> None:
        check_bool("monitor", self.monitor, "True adds a GCMonitor callback if the Trainer has none.")
        if self.nonfinite not in ("skip", "propagate"):
            raise ValueError(f"nonfinite={self.nonfinite!r} is invalid: use 'skip' or 'propagate'.")
        if self.sync not in ("bsp", "osp", "diloco"):
            raise ValueError(f"sync={self.sync!r} is invalid: use 'bsp' (synchronise every layer before the step), "
                             "'osp' (two-stage synchronisation, docs/osp.md) or 'diloco' (local inner steps, an "
                             "outer step every diloco_inner_steps, docs/diloco.md).")
        if self.sync != "osp":
            default = OSPConfig()
            for f in ("deferred_fraction", "deferred_compressor", "deferred_ratio"):
                value = getattr(self.osp, f)
                if value != getattr(default, f):
                    raise ValueError(f"osp_{f}={value!r} only applies with sync='osp'; pass sync='osp' too, "
                                     "or drop it.")
        if self.sync != "diloco" and self.diloco != DiLoCoConfig():
            changed = [f"diloco_{f.name}={getattr(self.diloco, f.name)!r}" for f in dataclasses.fields(DiLoCoConfig)
                       if getattr(self.diloco, f.name) != getattr(DiLoCoConfig(), f.name)]
            raise ValueError(f"{', '.join(changed)} only applies with sync='diloco'; pass sync='diloco' too, or drop it.")
        if self.sync == "diloco" and self.omgs is not None:
            raise ValueError(
                f"sync='diloco' with plan={self.engine.plan!r}/omgs= is not supported: inner steps send no gradients, "
                "so there is no merge plan to optimise, and the outer step sends the model's Δ as one group. Drop "
                "plan='omgs'/omgs=, or use sync='bsp'."
            )
        if self.auto is not None:
            if self.sync != "bsp":
                raise ValueError(f"compressor='auto' with sync={self.sync!r} is not supported: auto chooses the method of "
                                 "BSP steps. Use sync='bsp', or pick the compressor of the OSP/DiLoCo exchange yourself.")
            if self.omgs is not None or self.engine.plan != "model":
                raise ValueError(f"compressor='auto' with plan={self.engine.plan!r} is not supported: its model predicts "
                                 "the one-group plan (and DDP's own buckets for the dense candidates). Use plan='model'.")
        if self.sync == "osp" and self.omgs is not None:
            raise ValueError(
                f"sync='osp' with plan={self.engine.plan!r} (OMGS) is not supported: OSP re-plans every step to "
                "leave the deferred layers out, OMGS installs its own merge plan. Use one of them: sync='osp' "
                "with plan='model'/'layer'/'threshold', or plan='omgs' with sync='bsp'."
            )
        collective, ef = self.compression.resolved()
        if self.topology.kind == "nodes" and self.topology_refusal() is not None:
            raise ValueError(self.topology_refusal())
        if self.sync == "diloco" and self.diloco.compressor is not None:
            _check_diloco_compressor(self.compression, self.diloco.compressor)
        elif self.sync == "diloco" and self.diloco.error_decay != 1.0 and (self.compression.compressor == "dense" or not ef):
            raise ValueError(
                f"diloco_error_decay={self.diloco.error_decay!r} with compressor={self.compression.compressor!r} and "
                f"error_feedback={ef}: the decay applies to the error memory of a compressed pseudo-gradient, and there is "
                "none. Use a compressor with error_feedback=True (e.g. compressor='topk'), or drop diloco_error_decay."
            )
        if (self.engine.collective, self.engine.error_feedback) != (collective, ef):
            object.__setattr__(self, "engine", dataclasses.replace(self.engine, collective=collective,
                                                                   error_feedback=ef))

    def topology_refusal(self) -> str | None:
        """Why ``topology="nodes"`` cannot run this configuration, with the fix (None: it can). Under
        ``topology="auto"`` such a configuration is flat, without measuring."""
        collective, _ = self.compression.resolved()
        sent = "allgather" if self.sync == "diloco" and self.diloco.compressor is not None else collective  # SparseLoCo
        return refusal(collective=sent, sync=self.sync, omgs=self.omgs is not None, auto=self.auto is not None,
                       intra_dtype=self.topology.intra_dtype)

    @classmethod
    def from_flat(cls, **flat: Any) -> GCConfig:
        """Build the tree from flat names (:data:`FLAT_FIELDS`, ``omgs_<field>``); an unknown name is
        refused naming the closest valid one. Omitted names take their section's default."""
        import difflib

        sections: dict[str, dict[str, Any]] = {"compression": {}, "engine": {}, "osp": {}, "diloco": {},
                                               "topology": {}}
        top: dict[str, Any] = {}
        omgs_fields: dict[str, Any] = {}
        auto_fields: dict[str, Any] = {}
        for name, value in flat.items():
            if name in FLAT_FIELDS:
                section, fld = FLAT_FIELDS[name]
                if fld is None:
                    top[section] = value
                else:
                    sections[section][fld] = value
            elif name.startswith("omgs_"):
                omgs_fields[name[len("omgs_"):]] = value
            elif name.startswith("auto_"):
                auto_fields[name[len("auto_"):]] = value
            else:
                close = difflib.get_close_matches(name, list(FLAT_FIELDS), n=1, cutoff=0.6)
                hint = f" Did you mean {close[0]}?" if close else ""
                raise ValueError(f"{name}={value!r} is not a lightning_gc option (see lightning_gc.config.FLAT_FIELDS)."
                                 f"{hint}")
        plan = sections["engine"].get("plan", EngineConfig.plan)
        omgs_value = top.pop("omgs", None)
        if omgs_fields:
            base = dataclasses.asdict(OMGSConfig.coerce(omgs_value)) if omgs_value is not None else {}
            omgs_value = {**base, **omgs_fields}
        omgs = OMGSConfig.coerce(omgs_value) if (omgs_value is not None or plan in OMGS_PLANS) else None
        auto_value = top.pop("auto", None)
        if sections["compression"].get("compressor") == "auto":
            given = {k: v for k, v in sections["compression"].items()
                     if k != "compressor" and v not in (None, {}, "auto")}
            if given:
                raise ValueError(f"compressor='auto' chooses the compressor, its ratio and collective itself, so "
                                 f"{', '.join(f'{k}={v!r}' for k, v in given.items())} cannot be given; restrict or "
                                 "reorder what it picks from with auto={'candidates': [...]} (docs/auto.md).")
            sections["compression"] = dict(AUTO_ENGINE_DEFAULT)
            if auto_fields:
                base = AutoConfig.coerce(auto_value).as_dict() if auto_value is not None else {}
                auto_value = {**base, **auto_fields}
            auto = AutoConfig.coerce(auto_value)
        elif auto_value is not None or auto_fields:
            raise ValueError(f"auto options ({auto_value if auto_value is not None else auto_fields!r}) only apply with "
                             "compressor='auto'; pass compressor='auto' too, or drop them.")
        else:
            auto = None
        compression = CompressionConfig(**sections["compression"])
        engine_fields = sections["engine"]
        if auto is not None and engine_fields.get("warmup_steps", EngineConfig.warmup_steps) < auto.dense_steps_needed:
            engine_fields["warmup_steps"] = auto.dense_steps_needed  # the chooser profiles these dense steps
        if omgs is not None and omgs.profile_on == "compressed" and not engine_fields.get("overlap", EngineConfig.overlap):
            from lightning.pytorch.utilities.rank_zero import rank_zero_info

            # overlap=False runs the exchanges inside backward: compressed steps cannot be profiled
            rank_zero_info("lightning_gc: overlap=False runs every compressed exchange inside backward, so OMGS "
                           "profiles backward on dense steps (OMGSConfig.profile_on='dense').")
            omgs = dataclasses.replace(omgs, profile_on="dense")
        if omgs is not None and engine_fields.get("warmup_steps", EngineConfig.warmup_steps) < omgs.dense_steps_needed:
            from lightning.pytorch.utilities.rank_zero import rank_zero_info

            # only with profile_on="dense": the default profiles the provisional plan's compressed steps
            rank_zero_info(
                f"lightning_gc: OMGS profiles backward on dense steps (profile_on='dense'), so warmup_steps="
                f"{engine_fields.get('warmup_steps', EngineConfig.warmup_steps)} is raised to "
                f"{omgs.dense_steps_needed} (1 + profile_skip_steps + profile_steps of OMGSConfig)."
            )
            engine_fields["warmup_steps"] = omgs.dense_steps_needed
        collective, ef = compression.resolved()
        engine = EngineConfig(**{**engine_fields, "collective": collective, "error_feedback": ef})
        osp = OSPConfig(**sections["osp"])
        diloco = DiLoCoConfig(**sections["diloco"])
        topology = TopologyConfig(**sections["topology"])
        return cls(compression=compression, engine=engine, osp=osp, diloco=diloco, omgs=omgs, auto=auto,
                   topology=topology, **top)

    def to_flat(self) -> dict[str, Any]:
        """The flat names that rebuild this tree with :meth:`from_flat` (round trip)."""
        out: dict[str, Any] = {}
        for name, (section, fld) in FLAT_FIELDS.items():
            value = getattr(self, section)
            if fld is not None:
                value = getattr(value, fld)
            if name == "omgs" and value is not None:
                value = dataclasses.asdict(value)
            if name == "auto" and value is not None:
                value = value.as_dict()
            out[name] = dict(value) if name == "compressor_args" or (name == "diloco_outer_args" and value) else value
        if self.auto is not None:  # the engine's default slot is auto's, not the user's
            out.update(compressor="auto", ratio=None, compressor_args={}, collective="auto", error_feedback=None)
        return out
