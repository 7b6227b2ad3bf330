"""Alias kept for code written against the earlier layout: GradiVeQ's exchange now lives in
:mod:`lightning_gc.compressors.gradiveq.exchange` (the whole method is the package
:mod:`lightning_gc.compressors.gradiveq`). Importing this module gives that very module, so
attributes read or patched here are the exchange's own.
"""

import sys

from ..compressors.gradiveq import exchange as _exchange

sys.modules[__name__] = _exchange
