"""The ``lightning-gc`` command.

``lightning-gc fit|validate|test|predict --config recipes/<recipe>.yaml`` is Lightning's own
LightningCLI (jsonargparse): any LightningModule / LightningDataModule / Strategy class can be
named by ``class_path`` in the YAML, and the ``gc_*`` strategy aliases are registered because this
module imports lightning_gc.

``lightning-gc bench ...`` runs the benchmark (see docs/bench.md); ``lightning-gc list`` prints
the compressors, collectives, plans and strategy aliases, one line each; ``lightning-gc --help``
and ``lightning-gc --version`` say what the tool is and which version is installed.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning_gc  # noqa: F401  (registers the gc_* strategy aliases)

LIGHTNING_COMMANDS = ("fit", "validate", "test", "predict")

# one line per collective (``collective=...`` of GCStrategy); a collective registered without a
# line here is listed with its wire formats only

def _recipes_dir() -> Path | None:
    """The recipes of a source checkout (they are not part of the installed package)."""
    d = Path(lightning_gc.__file__).resolve().parents[1] / "recipes"
    return d if d.is_dir() else None


def help_text() -> str:
    import lightning
    import torch

    recipes = _recipes_dir()
    where = (f"{recipes} ({len(list(recipes.glob('*.yaml')))} recipes)" if recipes
             else "recipes/ in the lightning_gc source repository")
    return f"""usage: lightning-gc COMMAND [ARGS]

lightning-gc {lightning_gc.__version__}: communication-efficient data-parallel training for PyTorch
Lightning. Gradient compression (Top-k, RandomK, QSGD, signSGD, fp16/bf16, AR-Topk) with error
feedback runs inside DDP through lightning_gc.GCStrategy; strategy aliases gc_<compressor> work in
any Trainer after `import lightning_gc`.

commands:
  fit, validate, test, predict   LightningCLI with a YAML recipe, e.g.
                                   lightning-gc fit --config recipes/quickstart.yaml
                                 (`lightning-gc fit --help` lists every option)
  bench                          compare methods against DDP on an emulated cluster with shaped
                                 links (`lightning-gc bench --help`, docs/bench.md)
  list                           compressors, collectives, plans and strategy aliases, one line each
  --version                      versions of lightning-gc, Lightning and PyTorch
  --help                         this text

recipes: {where}; one per compressor plus quickstart.yaml. The `trainer.strategy` block of a
recipe can be copied into any LightningCLI config.
docs: docs/index.md (getting started, concepts, compressors, monitoring, benchmark, cost model).
installed with Lightning {lightning.__version__}, PyTorch {torch.__version__}.
"""


def version_text() -> str:
    import lightning
    import torch

    return f"lightning-gc {lightning_gc.__version__} (lightning {lightning.__version__}, torch {torch.__version__})"


def list_text() -> str:
    """Compressors, collectives, plans and strategy aliases, one line each."""
    from .comm.registry import available_collectives, validate_collective
    from .compressors import available_compressors, build_compressor, get_entry
    from .plans import planner_summaries

    lines = ["compressors (GCStrategy(compressor=NAME); default collective in brackets):"]
    names = available_compressors()
    width = max(len(n) for n in names) + 2
    for name in names:
        comp = build_compressor(name)
        default = validate_collective(comp, "auto")
        lines.append(f"  {name:<{width}}{get_entry(name).summary} [{default}]")
    lines.append("collectives (GCStrategy(collective=NAME); 'auto' = the compressor's default):")
    collectives = available_collectives()
    width = max(len(n) for n in collectives) + 2
    for name, summary in collectives.items():
        lines.append(f"  {name:<{width}}{summary}")
    lines.append("plans (GCStrategy(plan=NAME)):")
    for name, summary in planner_summaries().items():
        lines.append(f"  {name:<11}{summary}".rstrip())
    lines.append("strategy aliases (Trainer(strategy=NAME) after `import lightning_gc`):")
    from lightning.pytorch.strategies import StrategyRegistry

    from .strategy import GCStrategy

    aliases = {n: e for n, e in StrategyRegistry.items()
               if isinstance(e.get("strategy"), type) and issubclass(e["strategy"], GCStrategy)}
    width = max((len(n) for n in aliases), default=0) + 2
    for name, e in aliases.items():
        args = ", ".join(f"{k}={v!r}" for k, v in e.get("init_params", {}).items())
        lines.append(f"  {name:<{width}}GCStrategy({args})")
    return "\n".join(lines)


def _lightning_cli(argv: list[str] | None) -> int:
    from lightning.pytorch.cli import LightningCLI

    LightningCLI(args=argv, save_config_kwargs={"overwrite": True})
    return 0


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print(help_text(), file=sys.stderr)
        return 2
    first = args[0]
    if first in ("-h", "--help", "help"):
        print(help_text())
        return 0
    if first in ("-V", "--version", "version"):
        print(version_text())
        return 0
    if first == "list":
        print(list_text())
        return 0
    if first == "bench":
        from .bench.cli import main as bench_main

        return bench_main(args[1:])
    if first not in LIGHTNING_COMMANDS and not first.startswith("-"):
        print(f"lightning-gc: unknown command {first!r}; use one of {[*LIGHTNING_COMMANDS, 'bench', 'list']} "
              "(lightning-gc --help).", file=sys.stderr)
        return 2
    # LightningCLI reads sys.argv itself when args is None (and warns if given both)
    return _lightning_cli(None if argv is None else args)


if __name__ == "__main__":
    sys.exit(main())
