"""Benchmark methods: a name (plus options) -> a Lightning strategy, and how its bytes are counted.

Method list syntax (``--methods``): comma-separated entries ``NAME[:KEY=VALUE[:KEY=VALUE...]]``::

    ddp,powersgd:rank=4,fp16,topk,topk:ratio=0.001,qsgd:levels=16

* ``ddp`` - plain Lightning ``DDPStrategy`` (dense fp32 allreduce, gloo on CPU).
* ``powersgd`` - torch's ``powerSGD_hook`` (options: ``rank`` (1), ``start_iter`` (2),
  ``min_compression_rate`` (2), ``error_feedback`` (true), ``warm_start`` (true)).
* ``fp16`` - torch's ``fp16_compress_hook``.
* any lightning_gc compressor name (``topk``, ``lwtopk``, ``mstopk``, ``randomk``, ``qsgd``, ``signsgd``,
  ``efsignsgd``, ...: the strategy alias without ``gc_``) -> ``GCStrategy(compressor=NAME, ...)``.
  Where a compressor shares its name with a torch baseline (``fp16``), the bare name is the torch
  baseline and ``gc_fp16`` is lightning_gc's compressor; ``gc_NAME`` is accepted for every compressor.
  ``ratio`` defaults to ``--ratio`` for compressors that take one; ``plan``, ``warmup_steps``,
  ``error_feedback``, ``monitor``, ``collective`` (e.g. ``star_topk:collective=art_ring``), the
  network-model keys (``network_alpha_s``, ``network_beta_s_per_byte``, ``probe_*``) and the other
  GCStrategy engine keys go to ``GCStrategy``; ``omgs_<field>`` keys go to ``GCStrategy(omgs={field: ...})``
  (:class:`~lightning_gc.engine.omgs.OMGSConfig`, e.g. ``topk:plan=omgs:omgs_profile_steps=5``; given with
  another plan they make the run profile and predict without changing its plan); any other key goes to
  ``compressor_args``.

``sync=diloco`` with ``diloco_inner_steps=H`` (and ``diloco_fragments``, ``diloco_overlap_steps``,
``diloco_mixing``) runs DiLoCo with that compressor on the pseudo-gradient (``dense:sync=diloco`` for
the exact fp32 average); ``diloco_outer_KEY=VALUE`` sets one argument of the outer optimizer over its
defaults (for SGD the published lr 0.7, momentum 0.9, Nesterov), e.g.
``dense:sync=diloco:diloco_inner_steps=10:diloco_outer_momentum=0:diloco_outer_nesterov=false:diloco_outer_lr=1``.
``diloco_compressor=sparseloco`` sends the pseudo-gradient as SparseLoCo does (outer SGD lr 1 without
momentum unless ``diloco_outer_*`` is given), its options as ``diloco_sparseloco_KEY=VALUE``, e.g.
``dense:sync=diloco:diloco_inner_steps=10:diloco_compressor=sparseloco:diloco_sparseloco_bits=4:diloco_error_decay=0.95``.

``adaptive=shadow`` or ``adaptive=rollback`` on any compressor that takes a ratio adds the
adaptive-ratio controller (:class:`lightning_gc.AdaptiveRatio`, docs/adaptive.md) in that mode;
``adaptive_KEY=VALUE`` passes ``KEY`` to it, e.g.
``artopk_auto:adaptive=shadow,topk:adaptive=rollback:adaptive_steps_per_candidate=3``. The
method's ``ratio`` is then only the ratio in force until the first decision.

``marsit`` (Marsit's one-bit ring) takes two short options besides its compressor options:
``K`` (= ``full_precision_every``, the period of full-precision rounds, 0 = never) and
``cascade=true``, which runs the paper's foil instead — SSDM re-compression at every ring hop
(``collective=marsit_cascade``) with the same schedule and compensation, e.g.
``marsit:K=0,marsit:K=100,marsit:K=0:cascade=true``.

``gradiveq`` takes ``Lt`` (= ``sample_steps``) and ``Lc`` (= ``compress_steps``) besides its
compressor options, e.g. ``gradiveq:warmup=10:Lt=10:Lc=80``; ``collective=gradiveq_allreduce``
runs the simple compress–allreduce–decompress path instead of the ring of Algorithm 1.

``auto`` -> ``GCStrategy(compressor="auto", auto={...})`` (:mod:`lightning_gc.auto`). Its options
are the :class:`~lightning_gc.auto.chooser.AutoConfig` fields, bare or as ``auto_<field>``;
``candidates`` joins names with ``+``, e.g. ``auto:progress_weight=0.5:candidates=ddp+fp16+topk``; so
does ``diloco``, e.g. ``auto:diloco=diloco10+diloco50``.
GCStrategy's engine keys go to ``GCStrategy`` as for any compressor. What auto picks itself
(``ratio``, ``collective``, ``error_feedback``, compressor options) is refused, as is anything else
``GCStrategy(compressor="auto")`` would refuse, when the list is parsed. ``all`` expands to every
*fixed* method, without ``auto``: name it explicitly, with ``--warmup`` at least its dense profile
(:func:`auto_config`).

Each entry is labelled by its full spec (``topk:ratio=0.001``), with the default ratio made explicit.

The torch baselines run on :class:`TorchHookDDPStrategy` (Lightning registers comm hooks on CUDA
only); the worker checks that the hook really ran (``DistributedDataParallel._get_ddp_logging_data()``).

Bytes per rank per step for the torch baselines (no engine counts them) follow the ring-allreduce
model used for dense DDP, ``2 (N - 1) / N`` times the message size for ``N`` ranks:

* ``ddp``:      ``2(N-1)/N * 4 * D``       (D = number of gradient elements)
* ``fp16``:     ``2(N-1)/N * 2 * D``
* ``powersgd``: ``2(N-1)/N * 4 * (U + sum_i (n_i + m_i) r)``, three allreduces per bucket: the
  uncompressed tensors (U elements: 1-D tensors and matrices that are not worth compressing,
  ``(n+m) r * min_compression_rate >= n m``), the P factors (``n_i r``) and the Q factors
  (``m_i r``). The counts are read from ``PowerSGDState.total_numel_after_compression`` over the
  measured steps, so they are exactly what the hook reduced.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from lightning.pytorch.strategies import DDPStrategy

from ..auto.chooser import AutoConfig
from ..compressors import available_compressors, takes_ratio
from ..config import FLAT_FIELDS, FLAT_PREFIXES
from .workloads import parse_value

__all__ = [
    "MethodError",
    "MethodSpec",
    "BASELINES",
    "AUTO",
    "parse_methods",
    "auto_config",
    "available_methods",
    "build_strategy",
    "build_callbacks",
    "TorchHookDDPStrategy",
    "ring_factor",
    "dense_grad_elements",
    "analytic_bytes_per_step",
    "powersgd_elements",
    "hook_marker",
]

BASELINES = ("ddp", "powersgd", "fp16", "hsdp", "hsdp_bf16")  # the last two: FSDP2's native HSDP (bench/fsdp.py)
SINGLE_BUCKET_MB = 1_000_000  # larger than any model: DDP puts every gradient into one bucket
_POWERSGD_KEYS = {"rank", "start_iter", "min_compression_rate", "error_feedback", "warm_start"}
# GCStrategy's own options: the configuration's flat names (lightning_gc/config.py, the one mapping) and
# DDP's bucket size; every other key is a compressor option
_GC_STRATEGY_KEYS = (set(FLAT_FIELDS) - {"compressor", "compressor_args", "omgs", "auto"}) | {"bucket_cap_mb"}
#: the run-time chooser (GCStrategy(compressor="auto")); not a compressor, so no ratio and no compressor options
AUTO = "auto"
_AUTO_FIELDS = tuple(f.name for f in fields(AutoConfig))
# what auto picks itself: refused as options of the auto method
_AUTO_PICKS = {"ratio", "collective", "error_feedback", "compressor_args"}


# short bench spellings of compressor options, per compressor
_OPTION_ALIASES = {"marsit": {"K": "full_precision_every"},
                   "gradiveq": {"Lt": "sample_steps", "Lc": "compress_steps"}}


class MethodError(ValueError):
    """An unknown method or a bad method option; the message names the value, the reason and the fix."""


@dataclass(frozen=True)
class MethodSpec:
    name: str  # torch baseline name or lightning_gc compressor name
    options: dict = field(default_factory=dict)
    gc: bool = False  # True: a lightning_gc compressor through GCStrategy

    @property
    def method(self) -> str:
        """Name as written in results: baseline name, compressor name, or ``gc_NAME`` on a clash."""
        return f"gc_{self.name}" if self.gc and self.name in BASELINES else self.name

    @property
    def label(self) -> str:
        return self.method + "".join(f":{k}={_fmt(v)}" for k, v in self.options.items())

    def to_json(self) -> dict:
        return {"method": self.method, "label": self.label, "compressor": self.name if self.gc else None,
                "options": dict(self.options)}


def _fmt(v: Any) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)  # true/false, as written in a method entry


def available_methods() -> list[str]:
    """Every method name: the torch baselines, every compressor, then ``auto``."""
    return list(BASELINES) + [f"gc_{n}" if n in BASELINES else n for n in available_compressors()] + [AUTO]


def _auto_candidates(entry: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str) and value.strip():
        return tuple(c.strip().lower() for c in value.split("+") if c.strip())
    if isinstance(value, (list, tuple)) and value:
        return tuple(str(c).strip().lower() for c in value)
    raise MethodError(f"method {entry!r}: candidates={value!r} must be candidate names joined by '+', "
                      f"e.g. 'auto:candidates=ddp+fp16+topk'")


def _auto_kwargs(entry: str, options: dict) -> dict[str, Any]:
    """GCStrategy keyword arguments (``compressor`` excluded) of an ``auto`` method's options."""
    auto: dict[str, Any] = {}
    kwargs: dict[str, Any] = {}
    for key, value in options.items():
        name = key[len("auto_"):] if key.startswith("auto_") else key
        if name in _AUTO_FIELDS:
            if name in auto:
                raise MethodError(f"method {entry!r}: {name} is given twice (as {name} and auto_{name}); give it once")
            auto[name] = _auto_candidates(entry, value) if name in ("candidates", "diloco") else value
        elif key in _AUTO_PICKS:
            raise MethodError(
                f"method {entry!r}: auto chooses the compressor, its ratio and collective itself, so {key}={value!r} "
                f"cannot be given; restrict what it picks from instead, e.g. 'auto:candidates=ddp+fp16+topk'"
            )
        elif key in _GC_STRATEGY_KEYS:
            kwargs[key] = value
        else:
            raise MethodError(
                f"method {entry!r}: unknown auto option {key!r}; valid: its own {', '.join(_AUTO_FIELDS)} (also as "
                f"auto_<name>), and GCStrategy's engine keys such as warmup_steps, seed, network_alpha_s, "
                f"network_beta_s_per_byte; e.g. 'auto:progress_weight=0.5:candidates=ddp+fp16+topk'"
            )
    if auto:
        kwargs["auto"] = auto
    return kwargs


def _check_auto(entry: str, options: dict) -> None:
    """Refuse, when the list is parsed, what ``GCStrategy(compressor="auto", ...)`` would refuse in the workers."""
    from ..config import GCConfig

    kwargs = _auto_kwargs(entry, options)
    kwargs.pop("bucket_cap_mb", None)  # DDP's, not lightning_gc's
    try:
        GCConfig.from_flat(compressor=AUTO, **kwargs)
    except (TypeError, ValueError) as exc:
        raise MethodError(f"method {entry!r}: {exc}") from exc


def auto_config(spec: MethodSpec) -> AutoConfig:
    """The :class:`~lightning_gc.auto.chooser.AutoConfig` an ``auto`` method runs with. It sends
    ``skip_steps + profile_steps`` steps dense (``AutoConfig.dense_steps_needed``, at least
    ``warmup_steps``) and decides at the end of the last of them, so the runner refuses a
    ``--warmup`` shorter than that: the profile and the decision are not timed."""
    if not (spec.gc and spec.name == AUTO):
        raise MethodError(f"method {spec.label!r} is not auto")
    return AutoConfig.coerce(_auto_kwargs(spec.label, spec.options).get("auto"))


def parse_methods(text: str, *, default_ratio: float | None) -> list[MethodSpec]:
    """Parse ``--methods``; validates names (and option keys of the torch baselines)."""
    if not isinstance(text, str) or not text.strip():
        raise MethodError(f"--methods {text!r} is empty: give a comma-separated list such as 'ddp,topk'")
    entries = [e.strip() for e in text.split(",") if e.strip()]
    gc_names = available_compressors()
    if entries == ["all"]:  # every fixed method; auto is named on its own (see the module docstring)
        entries = [m for m in available_methods() if m != AUTO]
    specs: list[MethodSpec] = []
    for entry in entries:
        name, *opt_parts = entry.split(":")
        name = name.strip().lower()
        gc = name not in BASELINES
        if name.startswith("fsdp_"):  # GCModelParallelStrategy with that compressor (bench/fsdp.py)
            specs.append(_fsdp_spec(entry, name, opt_parts, gc_names))
            continue
        if name.startswith("gc_"):
            name, gc = name[3:], True
        options = _parse_options(entry, opt_parts, "topk:ratio=0.001")
        if gc and name == AUTO:
            _check_auto(entry, options)
        elif gc:
            if name not in gc_names:
                raise MethodError(
                    f"unknown method {name!r}: choose from {', '.join(available_methods())} "
                    f"(see 'lightning-gc bench --list-methods')"
                )
            if "ratio" not in options and default_ratio is not None and takes_ratio(name):
                options = {"ratio": default_ratio, **options}
            if "ratio" in options and options["ratio"] is not None:
                r = options["ratio"]
                if not isinstance(r, (int, float)) or isinstance(r, bool) or not (0 < float(r) <= 1):
                    raise MethodError(
                        f"method {entry!r}: ratio={r!r} must be a number in (0, 1] (fraction of gradient "
                        f"entries kept); e.g. 'topk:ratio=0.01'"
                    )
        elif name == "powersgd":
            bad = set(options) - _POWERSGD_KEYS
            if bad:
                raise MethodError(
                    f"method {entry!r}: unknown PowerSGD option(s) {sorted(bad)}; valid: {sorted(_POWERSGD_KEYS)}"
                )
            rank = options.get("rank", 1)
            if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
                raise MethodError(f"method {entry!r}: rank={rank!r} must be an integer >= 1, e.g. 'powersgd:rank=4'")
            start = options.get("start_iter", 2)
            if not isinstance(start, int) or isinstance(start, bool) or start < 2:
                raise MethodError(
                    f"method {entry!r}: start_iter={start!r} must be an integer >= 2 (torch requires > 1 with error "
                    f"feedback / warm start); e.g. 'powersgd:start_iter=2'"
                )
        elif options:
            raise MethodError(f"method {entry!r}: {name} takes no options; write just '{name}'")
        specs.append(MethodSpec(name, options, gc=gc))
    labels = [s.label for s in specs]
    dup = sorted({lab for lab in labels if labels.count(lab) > 1})
    if dup:
        raise MethodError(f"--methods lists {dup} more than once; give each method/options combination once")
    return specs


class TorchHookDDPStrategy(DDPStrategy):
    """``DDPStrategy`` that registers a torch DDP comm hook on any device (Lightning only does so on CUDA)."""

    def __init__(self, hook_name: str, hook_options: dict | None = None, **kwargs: Any) -> None:
        if hook_name == "powersgd":
            # One DDP bucket: powerSGD_hook issues the Q allreduce of a bucket from the completion callback of
            # its P allreduce, so with several buckets the next bucket's collectives race with it and ranks
            # issue them in different orders - NCCL serialises them on a stream, gloo does not and aborts
            # with a collective size mismatch. An explicit bucket_cap_mb also disables DDP's small first bucket.
            kwargs.setdefault("bucket_cap_mb", SINGLE_BUCKET_MB)
        super().__init__(**kwargs)
        self.hook_name = hook_name
        self.hook_options = dict(hook_options or {})
        self.hook_state: Any = None

    def _register_ddp_hooks(self) -> None:  # noqa: D401 - overrides Lightning's CUDA-only version
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        model = self.model
        if self.hook_name == "fp16":
            model.register_comm_hook(state=None, hook=default_hooks.fp16_compress_hook)
        elif self.hook_name == "powersgd":
            o = self.hook_options
            self.hook_state = powerSGD_hook.PowerSGDState(
                process_group=None,
                matrix_approximation_rank=int(o.get("rank", 1)),
                start_powerSGD_iter=int(o.get("start_iter", 2)),
                min_compression_rate=float(o.get("min_compression_rate", 2)),
                use_error_feedback=bool(o.get("error_feedback", True)),
                warm_start=bool(o.get("warm_start", True)),
            )
            model.register_comm_hook(state=self.hook_state, hook=powerSGD_hook.powerSGD_hook)
        else:
            raise MethodError(f"TorchHookDDPStrategy: unknown hook {self.hook_name!r}; use 'fp16' or 'powersgd'")


def _parse_options(entry: str, parts: list[str], example: str) -> dict[str, Any]:
    """The ``KEY=VALUE`` parts of a method entry as a dict (values through :func:`parse_value`)."""
    options: dict[str, Any] = {}
    for part in parts:
        key, eq, value = part.partition("=")
        if not eq or not key.strip():
            raise MethodError(f"method {entry!r}: option {part!r} is not KEY=VALUE; write e.g. '{example}'")
        options[key.strip()] = parse_value(value)
    return options


def _fsdp_spec(entry: str, name: str, opt_parts: list[str], gc_names: list[str]) -> MethodSpec:
    compressor = name[len("fsdp_"):]
    if compressor not in gc_names:
        raise MethodError(f"method {entry!r}: {compressor!r} is not a lightning_gc compressor; write fsdp_<compressor>, "
                          "e.g. 'fsdp_topk:ratio=0.01' (docs/fsdp.md)")
    return MethodSpec(name, _parse_options(entry, opt_parts, "fsdp_topk:ratio=0.01"), gc=True)


def build_strategy(spec: MethodSpec, **ddp_kwargs: Any):
    """A fresh Lightning strategy for ``spec``."""
    if spec.name in ("hsdp", "hsdp_bf16") or spec.name.startswith("fsdp_"):
        from lightning_gc.bench.fsdp import build_fsdp_strategy

        try:
            return build_fsdp_strategy(spec.name, dict(spec.options))
        except (TypeError, ValueError) as exc:
            raise MethodError(f"method {spec.label!r}: {exc}") from exc
    if not spec.gc and spec.name == "ddp":
        return DDPStrategy(**ddp_kwargs)
    if not spec.gc and spec.name in ("fp16", "powersgd"):
        return TorchHookDDPStrategy(spec.name, spec.options, **ddp_kwargs)
    from lightning_gc.strategy import GCStrategy

    if spec.name == AUTO:
        return GCStrategy(compressor=AUTO, **_auto_kwargs(spec.label, spec.options), **ddp_kwargs)
    kwargs: dict[str, Any] = {}
    compressor_args: dict[str, Any] = {}
    options = dict(spec.options)
    if spec.name == "marsit" and "cascade" in options:
        cascade = options.pop("cascade")
        if not isinstance(cascade, bool):
            raise MethodError(f"method {spec.label!r}: cascade={cascade!r} must be true or false")
        if cascade:
            options["collective"] = "marsit_cascade"
    for k in [k for k in options if k == "adaptive" or k.startswith("adaptive_")]:
        options.pop(k)  # the controller's options: see build_callbacks
    outer = {k[len("diloco_outer_"):]: options.pop(k) for k in list(options)
             if k.startswith("diloco_outer_") and k not in ("diloco_outer_optimizer", "diloco_outer_args")}
    if outer:  # sync=diloco's outer optimizer arguments one by one, over the defaults
        from lightning_gc.sync.diloco import DiLoCoConfig

        base = DiLoCoConfig(outer_optimizer=options.get("diloco_outer_optimizer", "SGD"),
                            compressor=options.get("diloco_compressor")).resolved_args()
        options["diloco_outer_args"] = {**base, **outer}
    delta = {k[len("diloco_sparseloco_"):]: options.pop(k) for k in list(options) if k.startswith("diloco_sparseloco_")}
    if delta:  # diloco_compressor=sparseloco's options one by one (SparseLoCoConfig: density, chunk, bits, rounding)
        options["diloco_compressor_args"] = {**dict(options.get("diloco_compressor_args") or {}), **delta}
    aliases = _OPTION_ALIASES.get(spec.name, {})
    sections: dict[str, dict[str, Any]] = {}
    for k, v in options.items():
        k = aliases.get(k, k)
        prefix = next((p for p in FLAT_PREFIXES if k.startswith(p)), None)
        if prefix is not None:  # a section's field, e.g. topk:plan=omgs:omgs_profile_steps=5 (OMGSConfig)
            sections.setdefault(FLAT_PREFIXES[prefix], {})[k[len(prefix):]] = v
            continue
        (kwargs if k in _GC_STRATEGY_KEYS else compressor_args)[k] = v
    kwargs.update(sections)  # omgs={...}; auto={...} is refused by GCStrategy without compressor="auto"
    if compressor_args:
        kwargs["compressor_args"] = compressor_args
    return GCStrategy(compressor=spec.name, **kwargs, **ddp_kwargs)


def build_callbacks(spec: MethodSpec) -> list:
    """Callbacks the method needs besides its strategy: the adaptive-ratio controller for
    ``adaptive=shadow|rollback`` (its own options as ``adaptive_KEY=VALUE``)."""
    mode = spec.options.get("adaptive")
    extra = {k[len("adaptive_"):]: v for k, v in spec.options.items() if k.startswith("adaptive_")}
    if mode is None:
        if extra:
            raise MethodError(f"method {spec.label!r}: {sorted(extra)} need adaptive=shadow or adaptive=rollback")
        return []
    if not spec.gc or not takes_ratio(spec.name):
        raise MethodError(
            f"method {spec.label!r}: adaptive={mode!r} needs a lightning_gc compressor that takes a ratio "
            "(topk, lwtopk, mstopk, randomk, star_topk, var_topk, artopk_auto)"
        )
    from lightning_gc.adaptive import AdaptiveRatio

    try:
        return [AdaptiveRatio(mode=mode, **extra)]
    except (TypeError, ValueError) as exc:
        raise MethodError(f"method {spec.label!r}: {exc}") from exc


def ring_factor(world_size: int) -> float:
    """Bytes each rank sends per byte of message in a ring allreduce: ``2 (N - 1) / N``."""
    return 0.0 if world_size <= 1 else 2.0 * (world_size - 1) / world_size


def dense_grad_elements(model) -> int:
    return int(sum(p.numel() for p in model.parameters() if p.requires_grad))


def powersgd_elements(model, rank: int = 1, min_compression_rate: float = 2.0) -> int:
    """Elements PowerSGD reduces per step for ``model`` (same per-tensor test as ``powerSGD_hook``)."""
    total = 0
    for p in model.parameters():
        if not p.requires_grad:
            continue
        n = p.shape[0] if p.dim() > 0 else 1
        m = p.numel() // max(n, 1)
        rr = min(n, m, rank)
        total += (n + m) * rr if (n + m) * rr * min_compression_rate < n * m else n * m
    return total


def analytic_bytes_per_step(spec: MethodSpec, world_size: int, num_params: int,
                            powersgd_elements_per_step: float | None = None, hosts: int = 1) -> float:
    """Modelled bytes one rank sends per step for a torch baseline (see the module docstring)."""
    if spec.gc:
        raise MethodError(f"no analytic byte model for {spec.label!r}; its engine counts the bytes")
    if spec.name in ("hsdp", "hsdp_bf16"):
        from lightning_gc.bench.fsdp import hsdp_bytes_per_step

        return hsdp_bytes_per_step(spec.name, hosts, world_size, num_params)
    f = ring_factor(world_size)
    if spec.name == "ddp":
        return f * 4 * num_params
    if spec.name == "fp16":
        return f * 2 * num_params
    if spec.name == "powersgd":
        if powersgd_elements_per_step is None:
            raise MethodError("powersgd: the reduced element count is needed (from PowerSGDState or powersgd_elements)")
        return f * 4 * powersgd_elements_per_step
    raise MethodError(f"no analytic byte model for {spec.name!r}")


def hook_marker(spec: MethodSpec) -> str | None:
    """Substring expected in DDP's logged ``comm_hook`` for the torch baselines."""
    if spec.gc:
        return None
    return {"fp16": "fp16_compress_hook", "powersgd": "powerSGD_hook"}.get(spec.name)
