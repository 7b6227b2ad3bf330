"""The ``lightning-gc`` command.

``lightning-gc fit|validate|test|predict --config recipes/<recipe>.yaml`` is Lightning's own
LightningCLI (jsonargparse): any LightningModule / LightningDataModule / Strategy class can be
named by ``class_path`` in the YAML, and the ``gc_*`` strategy aliases are registered because this
module imports lightning_gc.

The other commands (``bench``, ``advise``, ``list``, ``--version``) are listed by :func:`help_text`,
which also names every compressor, plan, synchronisation model and page of docs/ (tests/test_docs.py
keeps them equal).
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from typing import Any

import lightning_gc  # noqa: F401  (registers the gc_* strategy aliases)

LIGHTNING_COMMANDS = ("fit", "validate", "test", "predict")

def _recipes_dir() -> Path | None:
    """The recipes of a source checkout (they are not part of the installed package)."""
    d = Path(lightning_gc.__file__).resolve().parents[1] / "recipes"
    return d if d.is_dir() else None


#: the recipes beside the one per compressor (``recipes/<compressor>.yaml``), one line each;
#: tests/test_newcomer.py checks that this and the compressors name every file of recipes/
RECIPES = {
    "quickstart.yaml": "start here: Top-k keeping 1% with error feedback, 2 CPU processes",
    "auto.yaml": "compressor='auto': the method chosen at run time",
    "auto_diloco.yaml": "compressor='auto' with DiLoCo among its choices, decided by a trial on the loss",
    "adaptive.yaml": "AdaptiveRatio, the run-time compression-ratio controller",
    "omgs.yaml": "OMGS merge plan (plan='omgs')",
    "osp.yaml": "OSP two-stage synchronisation (sync='osp')",
    "diloco.yaml": "DiLoCo, rare outer steps (sync='diloco')",
    "diloco_sparseloco.yaml": "DiLoCo with SparseLoCo's 2-bit chunked Top-k pseudo-gradient (diloco_compressor='sparseloco')",
    "topology.yaml": "topology='nodes': QSGD only between nodes (2 emulated nodes on one machine)",
    "diloco_nodes.yaml": "DiLoCo with nodes as its workers: DDP inside a node, outer steps between nodes (topology='nodes')",
    "fsdp.yaml": "FSDP2 (HSDP): GCModelParallelStrategy, QSGD between replicas, gpt (4 processes: 2 nodes of 2)",
    "gpt.yaml": "the gpt workload, a small byte-level transformer",
}


#: every page of docs/, one line each (tests/test_docs.py checks this against the directory)
DOC_PAGES = {
    "index.md": "the table of contents",
    "getting-started.md": "install, quickstart, GCStrategy in a script or a LightningCLI config, every argument",
    "choosing.md": "which method for which network, model, optimizer and world size (measured)",
    "auto.md": "compressor='auto': the method chosen at run time; lightning-gc advise",
    "auto-diloco.md": "auto={'diloco': [...]}: per-step methods or DiLoCo, decided by a trial on the loss",
    "concepts.md": "the engine, merge plans, error feedback, checkpointed state, what combines with what",
    "compressors.md": "one entry per compressor: what it sends, bytes per element, tuning, measurements",
    "monitoring.md": "GCMonitor's TensorBoard tags, the compression gain, the end-of-fit summary",
    "multi-node.md": "several machines: torchrun, SLURM, network interfaces, what gc/bytes_* mean there",
    "topology.md": "topology='nodes': dense inside a node, compressed only between nodes; byte model, launch",
    "fsdp.md": "FSDP2 models (HSDP): GCModelParallelStrategy / gc_fsdp_*, compressed exchange between nodes",
    "fabric.md": "Lightning Fabric: GCFabricStrategy, checkpoints, logging the gc/* tags",
    "workloads.md": "the demo models and data of the recipes and the benchmark",
    "bench.md": "lightning-gc bench: emulated cluster, methods, reading the results",
    "cost_model.md": "the alpha-beta network model and the network probe",
    "omgs.md": "OMGS merge plans (plan='omgs')",
    "lowbit.md": "compressor='lowbit': a 4/8-bit ring allreduce whose bytes per rank do not grow with N",
    "diloco.md": "DiLoCo (sync='diloco'): rare outer steps on a compressed pseudo-gradient, for the slowest links",
    "osp.md": "OSP two-stage synchronisation (sync='osp')",
    "adaptive.md": "AdaptiveRatio, the run-time compression-ratio controller",
    "gpu.md": "the CUDA path on a GPU: what ran on an H200, what was fixed, codec throughput; .ci/gpu",
}


def sync_models() -> list[str]:
    """The values of ``GCStrategy(sync=...)``, read from its signature."""
    import inspect
    import re

    from .strategy import GCStrategy

    annotation = str(inspect.signature(GCStrategy.__init__).parameters["sync"].annotation)
    return re.findall(r"[\"']([a-z_]+)[\"']", annotation)


def help_text() -> str:
    import lightning
    import torch

    from .compressors import compressor_choices
    from .plans import planner_summaries

    recipes = _recipes_dir()
    where = (f"{recipes} ({len(list(recipes.glob('*.yaml')))} recipes)" if recipes
             else "recipes/ in the lightning_gc source repository")
    compressors = textwrap.fill(", ".join(compressor_choices()), width=96, subsequent_indent=" " * 16)
    recipe_width = max(len(n) for n in RECIPES) + 2
    recipe_lines = "\n".join(f"  {name:<{recipe_width}}{what}" for name, what in RECIPES.items())
    plans = ", ".join(planner_summaries())
    syncs = ", ".join(sync_models())
    width = max(len(n) for n in DOC_PAGES) + 2
    pages = "\n".join(f"  {name:<{width}}{what}" for name, what in DOC_PAGES.items())
    return f"""usage: lightning-gc COMMAND [ARGS]

lightning-gc {lightning_gc.__version__}: communication-efficient data-parallel training for PyTorch
Lightning. lightning_gc.GCStrategy runs gradient compression with error feedback inside DDP;
strategy aliases gc_<compressor> work in any Trainer after `import lightning_gc`, and
lightning_gc.fabric.GCFabricStrategy does the same for Lightning Fabric; FSDP2 models use
lightning_gc.GCModelParallelStrategy (strategy="gc_fsdp_<compressor>", docs/fsdp.md).

  compressors   {compressors}
                (Top-k family, RandomK, QSGD, signSGD / EF-signSGD, fp16/bf16, Marsit, GradiVeQ,
                low-rank, AR-Topk STAR / VAR and artopk_auto; GCStrategy(compressor=NAME);
                auto: the method chosen at run time among DDP, fp16 and compressors)
  merge plans   {plans} (GCStrategy(plan=NAME); OMGS: plan='omgs')
  sync models   {syncs} (GCStrategy(sync=NAME); OSP: sync='osp'; DiLoCo: sync='diloco')
  controller    lightning_gc.AdaptiveRatio, a callback that keeps choosing the compression ratio

commands:
  fit, validate, test, predict   LightningCLI with a YAML recipe, e.g.
                                   lightning-gc fit --config recipes/quickstart.yaml
                                 (`lightning-gc fit --help` lists every option)
  bench                          compare methods against DDP on an emulated cluster with shaped
                                 links (`lightning-gc bench --help`, docs/bench.md)
  advise                         predict each compressor='auto' candidate's step for a workload on N ranks
                                 over a given link and name the pick (`lightning-gc advise --help`)
  list                           compressors, collectives, plans and strategy aliases, one line each
  --version                      versions of lightning-gc, Lightning and PyTorch
  --help                         this text

recipes: {where}; one per compressor (<compressor>.yaml), and
{recipe_lines}
The `trainer.strategy` block of a recipe can be copied into any LightningCLI config.
which method to use: docs/choosing.md.
docs (docs/ in the source repository):
{pages}
installed with Lightning {lightning.__version__}, PyTorch {torch.__version__}.
"""


def version_text() -> str:
    import lightning
    import torch

    return f"lightning-gc {lightning_gc.__version__} (lightning {lightning.__version__}, torch {torch.__version__})"


def list_text() -> str:
    """Compressors, collectives, plans and strategy aliases, one line each."""
    from .compressors import AUTO, AUTO_SUMMARY, available_compressors, build_compressor, get_entry
    from .exchanges.registry import available_collectives, validate_collective
    from .plans import planner_summaries

    lines = ["which to choose for your network, model, optimizer and world size: docs/choosing.md",
             "compressors (GCStrategy(compressor=NAME); default collective in brackets):"]
    names = available_compressors()
    width = max(len(n) for n in [*names, AUTO]) + 2
    for name in names:
        comp = build_compressor(name)
        default = validate_collective(comp, "auto")
        lines.append(f"  {name:<{width}}{get_entry(name).summary} [{default}]")
    lines.append(f"  {AUTO:<{width}}{AUTO_SUMMARY}")
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


def _gc_strategy_class(class_path: Any) -> type | None:
    """The :class:`~lightning_gc.GCStrategy` or :class:`~lightning_gc.GCModelParallelStrategy`
    (sub)class ``class_path`` names, else ``None``."""
    import importlib

    from .model_parallel import GCModelParallelStrategy
    from .strategy import GCStrategy

    if not isinstance(class_path, str) or "." not in class_path:
        return None
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None  # jsonargparse names the class it cannot import
    return cls if isinstance(cls, type) and issubclass(cls, (GCStrategy, GCModelParallelStrategy)) else None


def _refusal(cls: type, kwargs: dict[str, Any]) -> str | None:
    try:
        cls(**kwargs)
    except ValueError as e:
        return str(e)
    except Exception:  # noqa: BLE001 - not a lightning_gc refusal: jsonargparse reports it as before
        return None
    return None


def strategy_refusal(strategy: Any) -> str | None:
    """lightning_gc's own refusal of a parsed ``trainer.strategy`` (``class_path`` + ``init_args``),
    or ``None`` when it is not a :class:`~lightning_gc.GCStrategy` (or :class:`~lightning_gc.GCModelParallelStrategy`)
    or the strategy accepts it.

    Why: jsonargparse builds the strategy while resolving the Trainer's ``str | Strategy`` union, and
    reports a refusal as "Expected a <class 'str'>" with the project's message some fifty lines
    below. Building the strategy here first, from the same values, puts that message first. Options
    that are objects themselves (``cluster_environment``, ...) keep their defaults here: jsonargparse
    builds and checks those."""
    from jsonargparse import Namespace

    cls = _gc_strategy_class(strategy.get("class_path")) if isinstance(strategy, Namespace) else None
    if cls is None:
        return None
    given = strategy.get("init_args") or Namespace()
    return _refusal(cls, {k: (v.as_dict() if isinstance(v, Namespace) else v) for k, v in vars(given).items()
                          if not (isinstance(v, Namespace) and "class_path" in v)})


def unknown_option_refusal(strategy: Any) -> str | None:
    """The refusal of an option name the strategy does not take, from a YAML's raw ``trainer.strategy``
    block (jsonargparse refuses it while parsing, under its usage text): only the unknown names are
    passed, so YAML's own reading of the values cannot give a false refusal."""
    import inspect

    if not isinstance(strategy, dict) or not isinstance(strategy.get("init_args"), dict):
        return None
    cls = _gc_strategy_class(strategy.get("class_path"))
    if cls is None:
        return None
    known = inspect.signature(cls.__init__).parameters
    unknown = {k: v for k, v in strategy["init_args"].items() if k not in known}
    return _refusal(cls, unknown) if unknown else None


def _config_paths(args: Any) -> list[str]:
    """The files given with ``--config``/``-c`` in a command line."""
    if not isinstance(args, (list, tuple)):
        return []
    out = []
    for i, a in enumerate(args):
        if a in ("--config", "-c") and i + 1 < len(args):
            out.append(args[i + 1])
        elif isinstance(a, str) and a.startswith("--config="):
            out.append(a.split("=", 1)[1])
    return out


def _refuse(problem: str, where: str) -> None:
    print(f"lightning-gc: {problem}\n  (trainer.strategy.init_args{' of ' + where if where else ''}: "
          "fix the value there, or override it with --trainer.strategy.init_args.NAME=VALUE; "
          "`lightning-gc list` names every compressor, docs/getting-started.md every argument.)", file=sys.stderr)
    sys.exit(2)


def _check_config_files(args: Any) -> None:
    import yaml

    for path in _config_paths(sys.argv[1:] if args is None else args):
        try:
            cfg = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError):
            continue  # jsonargparse says what is wrong with the file
        strategy = (cfg.get("trainer") or {}).get("strategy") if isinstance(cfg, dict) else None
        problem = unknown_option_refusal(strategy)
        if problem is not None:
            _refuse(problem, path)


def lightning_cli_class() -> type:
    """Lightning's ``LightningCLI`` whose refusal of a bad lightning_gc strategy option or value is
    printed first (:func:`unknown_option_refusal`, :func:`strategy_refusal`), as ``lightning-gc
    fit|validate|test|predict`` runs it."""
    from lightning.pytorch.cli import LightningCLI

    class GCLightningCLI(LightningCLI):
        def parse_arguments(self, parser: Any, args: Any) -> None:
            _check_config_files(args)
            super().parse_arguments(parser, args)
            sub = self.config.get("subcommand")
            node = self.config.get(sub) if sub else self.config
            problem = strategy_refusal(node.get("trainer.strategy")) if node is not None else None
            if problem is not None:
                _refuse(problem, ", ".join(str(c) for c in (node.get("config") or ())))

    return GCLightningCLI


def _lightning_cli(argv: list[str] | None) -> int:
    lightning_cli_class()(args=argv, save_config_kwargs={"overwrite": True})
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
    if first == "advise":
        from .bench.advise import main as advise_main

        return advise_main(args[1:])
    if first not in LIGHTNING_COMMANDS and not first.startswith("-"):
        print(f"lightning-gc: unknown command {first!r}; use one of {[*LIGHTNING_COMMANDS, 'bench', 'advise', 'list']} "
              "(lightning-gc --help).", file=sys.stderr)
        return 2
    # LightningCLI reads sys.argv itself when args is None (and warns if given both)
    return _lightning_cli(None if argv is None else args)


if __name__ == "__main__":
    sys.exit(main())
