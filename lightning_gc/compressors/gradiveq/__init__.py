"""GradiVeQ (Yu et al., NeurIPS 2018), in one package.

* :mod:`.codec` — the configuration, the slicing rule (the paper's §3 parameter selection), the
  per-group basis and the PCA fit of Eq. 6: pure tensor math, no communication. Its docstring
  describes the method, the decisions taken where the paper is vague, and how to tune it.
* :mod:`.compressor` — :class:`GradiVeQCompressor`: the warm-up / sample / compress schedule,
  the sampled statistics, the fitted bases, their checkpoint state, and the advice printed at
  setup (error feedback, optimizer).
* :mod:`.exchange` — the two exchanges: the simple allreduce of coefficients and the ring of
  Algorithm 1 that compresses the next segment while the previous one travels, with the
  cross-rank basis digest check.

``lightning_gc.comm.gradiveq`` is kept as an alias of :mod:`.exchange` for code written
against the earlier layout.
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
from .exchange import GradiVeQExchange, GradiVeQRingExchange, Piece, chunk_plan, pieces_of

__all__ = [
    "COEF_DTYPES",
    "PHASES",
    "Block",
    "GradiVeQCompressor",
    "GradiVeQConfig",
    "GradiVeQExchange",
    "GradiVeQRingExchange",
    "GroupBasis",
    "LayerSlicing",
    "Piece",
    "SampleStats",
    "block_ranges",
    "choose_dim",
    "chunk_plan",
    "group_key",
    "layout",
    "pieces_of",
    "principal_axes",
    "sampled_rows",
    "slice_rule",
]
