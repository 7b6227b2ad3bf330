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
COLLECTIVE_LINES = {
    "allreduce": "the backend's allreduce of summable payloads (dense, fp16/bf16, RandomK)",
    "ring": "lightning_gc's point-to-point ring allreduce of summable payloads",
    "tree": "lightning_gc's point-to-point tree allreduce of summable payloads",
    "allgather": "one allgather of every rank's fixed-size packed payload (Top-k family, QSGD, signSGD)",
    "art_allreduce": "AR-Topk: source rank broadcasts its indices, values summed by the backend's allreduce",
    "art_ring": "AR-Topk: index broadcast, values summed by the P2P ring (ART-Ring)",
    "art_tree": "AR-Topk: index broadcast, values summed by the P2P tree (ART-Tree)",
    "auto_sparse": "artopk_auto: Top-k allgather, ART-Ring or ART-Tree per step, chosen by the alpha-beta model",
}
PLAN_LINES = {
    "model": "every compressible tensor in one group: global selection (default)",
    "layer": "one group per tensor: layer-wise selection",
    "threshold": "consecutive tensors merged up to plan_threshold elements per group",
}


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
    from .comm import exchange
    from .compressors import available_compressors, build_compressor, get_entry
    from .engine.plans import PLAN_KINDS

    registry: dict = getattr(exchange, "_EXCHANGES", {})
    lines = ["compressors (GCStrategy(compressor=NAME); default collective in brackets):"]
    names = available_compressors()
    width = max(len(n) for n in names) + 2
    for name in names:
        comp = build_compressor(name)
        default = exchange.validate_collective(comp, "auto")
        lines.append(f"  {name:<{width}}{get_entry(name).summary} [{default}]")
    lines.append("collectives (GCStrategy(collective=NAME); 'auto' = the compressor's default):")
    width = max(len(n) for n in registry) + 2 if registry else 0
    for name, (_, formats) in registry.items():
        line = COLLECTIVE_LINES.get(name, f"carries wire formats {sorted(formats)}")
        lines.append(f"  {name:<{width}}{line}")
    lines.append("plans (GCStrategy(plan=NAME)):")
    for name in PLAN_KINDS:
        lines.append(f"  {name:<11}{PLAN_LINES.get(name, '')}".rstrip())
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
