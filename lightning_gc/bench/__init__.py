"""``lightning-gc bench``: every method against DDP on an emulated, shaped network.

Modules: :mod:`~lightning_gc.bench.netns` (namespaces, bridge, tc shaping, counters, cleanup),
:mod:`~lightning_gc.bench.schedule` (rates and bandwidth schedules), :mod:`~lightning_gc.bench.methods`
(method name -> strategy), :mod:`~lightning_gc.bench.workloads`, :mod:`~lightning_gc.bench.worker`
(one rank), :mod:`~lightning_gc.bench.runner` (orchestration and aggregation),
:mod:`~lightning_gc.bench.report` (JSON, Markdown, PNG) and :mod:`~lightning_gc.bench.cli`.
See docs/bench.md.
"""
