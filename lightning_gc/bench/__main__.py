"""``python -m lightning_gc.bench ...`` is the same as ``lightning-gc bench ...``."""

import sys

from lightning_gc.bench.cli import main

sys.exit(main())
