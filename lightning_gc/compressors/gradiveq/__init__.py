"""GradiVeQ (Yu et al., NeurIPS 2018), in one package.

* :mod:`.codec` — the configuration, the slicing rule (the paper's §3 parameter selection), the
  per-group basis and the PCA fit of Eq. 6: pure tensor math, no communication. Its docstring
  describes the method, the decisions taken where the paper is vague, and how to tune it.
* :mod:`.compressor` — :class:`GradiVeQCompressor`: the warm-up / sample / compress schedule,
  the sampled statistics, the fitted bases, their checkpoint state, and the advice printed at
  setup (error feedback, optimizer).

Its exchanges (the simple allreduce of coefficients and the ring of Algorithm 1 that compresses
the next segment while the previous one travels, with the cross-rank basis digest check) live
with the other exchanges, above the transport: :mod:`lightning_gc.exchanges.gradiveq`.
"""

from .codec import (
    COEF_DTYPES,
    PHASES,
    Block,
    GradiVeQConfig,
    GroupBasis,
    LayerSlicing,
    SampleStats,
    block_ranges,
    choose_dim,
    group_key,
    layout,
    principal_axes,
    sampled_rows,
    slice_rule,
)
from .compressor import GradiVeQCompressor

__all__ = [
    "COEF_DTYPES",
    "PHASES",
    "Block",
    "GradiVeQCompressor",
    "GradiVeQConfig",
    "GroupBasis",
    "LayerSlicing",
    "SampleStats",
    "block_ranges",
    "choose_dim",
    "group_key",
    "layout",
    "principal_axes",
    "sampled_rows",
    "slice_rule",
]
