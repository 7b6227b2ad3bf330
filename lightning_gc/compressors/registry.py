"""Name → (config dataclass, compressor class), and validated construction from plain values.

Everything a user writes in a recipe is a string, a float and a dict; ``build_compressor`` turns
those into a typed config (rejecting unknown keys and bad values with a message that says which
keys exist) and the compressor instance.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .._names import closest
from .artopk import ARTopKConfig, AutoARTopKCompressor, STARTopKCompressor, VARTopKCompressor
from .base import Compressor
from .cast import BF16Compressor, CastConfig, FP16Compressor
from .dense import DenseCompressor, DenseConfig
from .gradiveq import GradiVeQCompressor, GradiVeQConfig
from .lowbit import LowBitCompressor, LowBitConfig
from .lowrank import LowRankCompressor, LowRankConfig
from .lwtopk import LWTopKCompressor, LWTopKConfig
from .marsit import MarsitCompressor, MarsitConfig
from .mstopk import MSTopKCompressor, MSTopKConfig
from .qsgd import QSGDCompressor, QSGDConfig
from .randomk import RandomKCompressor, RandomKConfig
from .sign import EFSignSGDCompressor, SignConfig, SignSGDCompressor
from .topk import TopKCompressor, TopKConfig


@dataclass(frozen=True)
class CompressorEntry:
    name: str
    config_cls: type
    compressor_cls: type[Compressor]
    summary: str
    fixed_args: tuple[tuple[str, Any], ...] = ()

    @property
    def takes_ratio(self) -> bool:
        return any(f.name == "ratio" for f in dataclasses.fields(self.config_cls))


_ENTRIES = [
    CompressorEntry("dense", DenseConfig, DenseCompressor, "exact allreduce (DDP's own numerics)"),
    CompressorEntry("fp16", CastConfig, FP16Compressor, "every element cast to fp16", (("dtype", "fp16"),)),
    CompressorEntry("bf16", CastConfig, BF16Compressor, "every element cast to bf16", (("dtype", "bf16"),)),
    CompressorEntry("topk", TopKConfig, TopKCompressor, "global Top-k over the group, allgather"),
    CompressorEntry("lwtopk", LWTopKConfig, LWTopKCompressor, "Top-k per layer, allgather"),
    CompressorEntry("mstopk", MSTopKConfig, MSTopKCompressor, "threshold-search Top-k (exactly k), allgather"),
    CompressorEntry("randomk", RandomKConfig, RandomKCompressor, "shared random k, values by allreduce"),
    CompressorEntry("qsgd", QSGDConfig, QSGDCompressor, "stochastic s-level quantisation, allgather"),
    CompressorEntry("lowbit", LowBitConfig, LowBitCompressor,
                    "k-bit (4/8) blocks with fp32 scales, summed in fp32 hop by hop along a P2P ring; bytes flat in N"),
    CompressorEntry("signsgd", SignConfig, SignSGDCompressor, "1-bit signs, majority vote"),
    CompressorEntry("efsignsgd", SignConfig, EFSignSGDCompressor, "1-bit scaled signs with error feedback"),
    CompressorEntry("marsit", MarsitConfig, MarsitCompressor,
                    "1-bit signs merged without bias along a P2P ring, global compensation, full precision every K"),
    CompressorEntry("gradiveq", GradiVeQConfig, GradiVeQCompressor,
                    "PCA per slice (GradiVeQ), coefficients summed in the compressed domain along a ring"),
    CompressorEntry("lowrank", LowRankConfig, LowRankCompressor,
                    "rank-r factors of each gradient matrix (PowerSGD family), two allreduces, warm start"),
    CompressorEntry("star_topk", ARTopKConfig, STARTopKCompressor,
                    "AR-Topk, round-robin source broadcasts indices, values by allreduce", (("selection", "star"),)),
    CompressorEntry("var_topk", ARTopKConfig, VARTopKCompressor,
                    "AR-Topk, max-energy source broadcasts indices, values by allreduce", (("selection", "var"),)),
    CompressorEntry("artopk_auto", ARTopKConfig, AutoARTopKCompressor,
                    "STAR AR-Topk or Top-k allgather, collective chosen by the alpha-beta model", (("selection", "star"),)),
]

COMPRESSORS: dict[str, CompressorEntry] = {e.name: e for e in _ENTRIES}

#: ``GCStrategy(compressor="auto")``: not a compressor of this registry but the run-time chooser
#: (lightning_gc/auto), listed wherever compressors are listed so that a user finds it
AUTO = "auto"
AUTO_SUMMARY = ("the method chosen at run time from measured steps: DDP, fp16 or a compressor "
                "(GCStrategy only; docs/auto.md)")


def register_compressor(entry: CompressorEntry) -> None:
    """Add a compressor (used by modules that add new algorithms, e.g. AR-Topk)."""
    if entry.name in COMPRESSORS and COMPRESSORS[entry.name] is not entry:
        raise ValueError(f"a compressor named {entry.name!r} is already registered")
    COMPRESSORS[entry.name] = entry


def available_compressors() -> list[str]:
    """The registered compressors (``"auto"``, the chooser among them, is not one: see :data:`AUTO`)."""
    return list(COMPRESSORS)


def compressor_choices() -> list[str]:
    """Every value ``GCStrategy(compressor=...)`` takes: the registered compressors, then ``"auto"``."""
    return [*COMPRESSORS, AUTO]


def unknown_compressor_message(name: Any) -> str:
    """The refusal of a compressor name nobody registered, with the closest valid one."""
    near = closest(name, compressor_choices()) if isinstance(name, str) else None
    hint = f" Did you mean {near!r}?" if near else ""
    return (f"unknown compressor {name!r}. Valid compressors: {', '.join(COMPRESSORS)}; and {AUTO!r}, "
            f"{AUTO_SUMMARY}.{hint} `lightning-gc list` describes each.")


def get_entry(name: str) -> CompressorEntry:
    if name == AUTO:  # reached where one concrete compressor is needed (OSP's deferred stage, a codec)
        raise ValueError(
            f"compressor {AUTO!r} is the run-time chooser of GCStrategy(compressor='auto') (with sync='bsp' and "
            f"plan='model'), not one compressor; here name one of: {', '.join(COMPRESSORS)}."
        )
    if not isinstance(name, str) or name not in COMPRESSORS:
        raise ValueError(unknown_compressor_message(name))
    return COMPRESSORS[name]


def takes_ratio(name: str) -> bool:
    return get_entry(name).takes_ratio


def build_config(name: str, ratio: float | None = None, args: dict[str, Any] | None = None) -> Any:
    """Validated config for compressor ``name`` from a ratio and a dict of extra options."""
    entry = get_entry(name)
    args = dict(args or {})
    valid = [f.name for f in dataclasses.fields(entry.config_cls) if f.name not in dict(entry.fixed_args)]
    unknown = sorted(set(args) - set(valid))
    if unknown:
        raise ValueError(
            f"compressor_args {unknown} are not options of compressor {name!r}; "
            f"its options are: {valid or 'none'}."
        )
    if ratio is not None:
        if not entry.takes_ratio:
            raise ValueError(
                f"compressor {name!r} does not take a ratio (got ratio={ratio!r}); leave ratio unset. "
                f"Compressors with a ratio: {[n for n, e in COMPRESSORS.items() if e.takes_ratio]}."
            )
        if "ratio" in args and args["ratio"] != ratio:
            raise ValueError(
                f"ratio given twice with different values (ratio={ratio!r}, compressor_args.ratio="
                f"{args['ratio']!r}); set it once."
            )
        args["ratio"] = ratio
    args.update(dict(entry.fixed_args))
    return entry.config_cls(**args)


def build_compressor(name: str, ratio: float | None = None, args: dict[str, Any] | None = None) -> Compressor:
    entry = get_entry(name)
    return entry.compressor_cls(build_config(name, ratio, args))
