"""Marsit (Wu et al., DAC 2022), in one package.

* :mod:`.codec` — the configuration and the bit arithmetic of the unbiased merge (Eq. 2):
  :func:`transient_bits` and :func:`merge_packed`. Its docstring describes the method, the
  decisions taken where the paper is vague, and how to tune it.
* :mod:`.compressor` — :class:`MarsitCompressor`: sign bits, the local scale, the full-precision
  schedule (every K steps), the per-hop transient generators and the advice printed at setup
  (momentum, error feedback).

Its exchange, the one-bit ring allreduce that merges bits hop by hop, and its exact byte count
live with the other exchanges: :mod:`lightning_gc.exchanges.marsit`.
"""

from .codec import MarsitConfig, merge_packed, transient_bits
from .compressor import MarsitCompressor

__all__ = [
    "MarsitCompressor",
    "MarsitConfig",
    "merge_packed",
    "transient_bits",
]
