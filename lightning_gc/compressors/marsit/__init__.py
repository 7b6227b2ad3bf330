"""Marsit (Wu et al., DAC 2022), in one package.

* :mod:`.codec` — the configuration and the bit arithmetic of the unbiased merge (Eq. 2):
  :func:`transient_bits` and :func:`merge_packed`. Its docstring describes the method, the
  decisions taken where the paper is vague, and how to tune it.
* :mod:`.compressor` — :class:`MarsitCompressor`: sign bits, the local scale, the full-precision
  schedule (every K steps), the per-hop transient generators and the advice printed at setup
  (momentum, error feedback).
* :mod:`.exchange` — :class:`MarsitExchange`, the one-bit ring allreduce that merges bits hop by
  hop, and its exact byte count.

``lightning_gc.comm.marsit`` is kept as an alias of :mod:`.exchange` for code written against
the earlier layout.
"""

from .codec import MarsitConfig, merge_packed, transient_bits
from .compressor import MarsitCompressor
from .exchange import MarsitExchange, marsit_one_bit_bytes

__all__ = [
    "MarsitCompressor",
    "MarsitConfig",
    "MarsitExchange",
    "marsit_one_bit_bytes",
    "merge_packed",
    "transient_bits",
]
