"""Alias kept for code written against the earlier layout: Marsit's exchange now lives in
:mod:`lightning_gc.compressors.marsit.exchange` (the whole method is the package
:mod:`lightning_gc.compressors.marsit`). Importing this module gives that very module, so
attributes read or patched here are the exchange's own.
"""

import sys

from ..compressors.marsit import exchange as _exchange

sys.modules[__name__] = _exchange
