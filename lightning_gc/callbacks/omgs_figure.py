"""The OMGS plan as a figure: tensors in backward order, group boundaries, predicted timeline.

Needs matplotlib (the ``plots`` extra: ``pip install lightning-gc[plots]``); without it
:func:`plan_figure` returns ``None`` and GCMonitor logs only the scalars.

How to read it (docs/omgs.md): the x axis is seconds from the start of backward, as modelled.
Lane *backward*: one bar per compressible tensor, from the previous gradient's ready time to its
own, coloured by the group it belongs to. Dotted lines: where a group is complete (its last
tensor ready). Lane *sparsify*: each group's selection; lane *communicate*: each group's exchange.
A gap in *communicate* is the network waiting for backward (merging could save start-ups there);
a queue of back-to-back exchanges ending long after backward is the network limiting the step
(merging more saves α per message; merging too much delays the first exchange).
"""

from __future__ import annotations

from typing import Any


def plan_figure(state: Any) -> Any:
    """A matplotlib Figure of an :class:`~lightning_gc.engine.omgs.OMGSState`, or ``None``."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    if state.plan is None or not state.timeline:
        return None
    fig, ax = plt.subplots(figsize=(10, 3.2))
    colors = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown")
    group_of: list[int] = []
    for gi, g in enumerate(state.timeline):
        group_of += [gi] * g.count
    prev = 0.0
    for i, (_, _, ready) in enumerate(state.ordered):
        ax.broken_barh([(prev, max(ready - prev, 1e-9))], (20, 8), facecolors=colors[group_of[i] % len(colors)])
        prev = max(prev, ready)
    for gi, g in enumerate(state.timeline):
        c = colors[gi % len(colors)]
        ax.broken_barh([(g.sparsify_start_s, g.sparsify_end_s - g.sparsify_start_s)], (10, 8), facecolors=c)
        ax.broken_barh([(g.comm_start_s, g.comm_end_s - g.comm_start_s)], (0, 8), facecolors=c)
        ax.axvline(g.ready_s, color="grey", linestyle=":", linewidth=0.8)
    ax.set_yticks([4, 14, 24], labels=["communicate", "sparsify", "backward"])
    ax.set_xlabel("seconds from the start of backward (modelled)")
    others = ", ".join(f"{k} {1e3 * v:.1f}" for k, v in state.predictions.items())
    ax.set_title(f"plan {state.plan.kind}: {len(state.timeline)} groups, predicted {1e3 * state.predicted_s:.1f} ms "
                 f"(ms: {others})", fontsize=9)
    fig.tight_layout()
    return fig
