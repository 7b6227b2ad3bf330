"""The ``lightning-gc`` command.

``lightning-gc fit|validate|test|predict --config recipes/<recipe>.yaml`` is Lightning's own
LightningCLI (jsonargparse): any LightningModule / LightningDataModule / Strategy class can be
named by ``class_path`` in the YAML, and the ``gc_*`` strategy aliases are registered because this
module imports lightning_gc.

``lightning-gc bench ...`` runs the benchmark (see docs/bench.md).
"""

from __future__ import annotations

import sys

import lightning_gc  # noqa: F401  (registers the gc_* strategy aliases)


def _lightning_cli(argv: list[str] | None) -> int:
    from lightning.pytorch.cli import LightningCLI

    LightningCLI(args=argv, save_config_kwargs={"overwrite": True})
    return 0


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "bench":
        from .bench.cli import main as bench_main

        return bench_main(args[1:])
    # LightningCLI reads sys.argv itself when args is None (and warns if given both)
    return _lightning_cli(None if argv is None else args)


if __name__ == "__main__":
    sys.exit(main())
