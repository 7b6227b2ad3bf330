"""Low-rank gradient compression of the PowerSGD family (Vogels et al., NeurIPS 2019), in one package.

* :mod:`.codec` — the configuration, which tensors are compressed, the initial ``Q`` and the
  orthogonalisation: pure tensor math. Its docstring describes the method, the decisions taken
  where the paper and torch's hook differ (error feedback, which tensors, warm-start state), and
  how to tune it.
* :mod:`.compressor` — :class:`LowRankCompressor`: the blocks of a group and a one-rank
  compress/decompress (codec micro-benchmark).

Its exchange, the two allreduces with warm start and error feedback, lives with the other
exchanges: :class:`lightning_gc.exchanges.lowrank.LowRankExchange`.
"""

from .codec import Block, LowRankConfig, initial_q, matrix_shape, orthonormal, plan_blocks, project, project_t
from .compressor import LowRankCompressor

__all__ = ["Block", "LowRankCompressor", "LowRankConfig", "initial_q", "matrix_shape",
           "orthonormal", "plan_blocks", "project", "project_t"]
