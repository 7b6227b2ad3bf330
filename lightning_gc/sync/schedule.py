"""How much of the model OSP defers: the ``S(Gu)`` schedule (OSP Algorithm 1) and its bound.

**The bound on a ring.** The paper bounds the deferred size for a parameter server:
``Umax = b(1+lr)·Tc/N`` (``b`` bandwidth, ``lr`` the *packet-loss rate*, ``N`` workers, ``Tc`` the
compute time of one iteration): the ICS transfer must finish within the next iteration's compute.
Here ICS is a ring allreduce on a process group of its own. Under the alpha-beta model (``α``
seconds per message, ``β`` seconds per byte) a ring allreduce of ``S`` elements of ``s`` bytes
takes ``2(N−1)·α + 2(N−1)/N · S·s·β`` (each rank sends ``2(N−1)/N`` of the message, in
``2(N−1)`` hops). Requiring ``T_ICS ≤ Tc`` gives::

    Umax = N · (Tc − 2(N−1)·α) / (2(N−1) · s · β)      (elements; 0 if Tc ≤ 2(N−1)·α)

then ``Umax ← min(Umax, 0.8 · model elements)`` (the paper's cap: beyond it OSP degenerates into
asynchronous training). There is no loss-rate term: gloo/NCCL run over reliable transports, whose
retransmissions show up in the measured ``β``. ``α``, ``β`` come from the engine's network model
(probed or pinned) or from OSP's own probe; ``Tc`` is measured (end of the optimizer step to the
end of the next backward, averaged over the round and across ranks). The bound ignores that RS
traffic of the next step shares the link; it is an upper bound, as in the paper.

**The schedule.** Rounds of ``round_steps`` optimizer steps (the paper's epochs; Lightning epochs
vary too much in length to be the unit). Round 1 defers nothing (``S = 0``: BSP, while the
importance of every layer is measured) and records ``L``, the round's mean loss (averaged over
ranks). After round ``i ≥ 1`` the next round defers ``S = clip(1 − loss_i / L, 0, 1) · Umax``
elements, with ``loss_i`` the mean loss over the second half of round ``i`` (the recent loss; with
the whole round's mean, round 2 would always defer 0). ``pinned`` (``osp_deferred_fraction``)
replaces all this by a fixed fraction of the model's elements from step 1 on (step 0 has no
importance yet and DDP rebuilds its buckets after it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def ring_umax(tc_s: float, alpha_s: float, beta_s_per_byte: float, world_size: int, bytes_per_element: int) -> float:
    """Largest element count a ring allreduce moves within ``tc_s`` seconds (see module doc)."""
    if world_size <= 1:
        return math.inf
    n = world_size
    spare = tc_s - 2 * (n - 1) * alpha_s
    if spare <= 0:
        return 0.0
    if beta_s_per_byte <= 0:
        return math.inf
    return n * spare / (2 * (n - 1) * bytes_per_element * beta_s_per_byte)


@dataclass
class DeferredSchedule:
    """Element budget of the deferred (ICS) set per step; identical on every rank.

    All inputs of :meth:`end_round` are agreed across ranks (sums all-reduced by the caller), so
    the budget is replicated.
    """

    total_numel: int
    round_steps: int
    pinned_fraction: float | None = None
    cap_fraction: float = 0.8
    first_loss: float | None = None  # L
    umax: float | None = None  # elements, capped
    budget: int = 0  # elements deferred per step in the current round
    rounds_done: int = 0

    def budget_for_step(self, step: int) -> int:
        """Elements to defer at optimizer step ``step`` (0-based)."""
        if self.pinned_fraction is not None:
            return 0 if step == 0 else int(math.floor(self.pinned_fraction * self.total_numel))
        return self.budget

    def round_ends_after(self, step: int) -> bool:
        return self.pinned_fraction is None and (step + 1) % self.round_steps == 0

    def end_round(self, mean_loss: float, recent_loss: float, umax_elements: float) -> int:
        """Close a round: ``mean_loss`` over the round, ``recent_loss`` over its second half
        (both averaged over ranks), ``umax_elements`` the ring bound; returns the next budget."""
        self.rounds_done += 1
        self.umax = min(float(umax_elements), self.cap_fraction * self.total_numel)
        if self.first_loss is None:
            self.first_loss = mean_loss
        if not (math.isfinite(recent_loss) and self.first_loss and math.isfinite(self.first_loss)):
            self.budget = 0
            return 0
        scale = min(max(1.0 - recent_loss / self.first_loss, 0.0), 1.0)
        self.budget = int(math.floor(scale * self.umax))
        return self.budget

    def state_dict(self) -> dict:
        return {"first_loss": self.first_loss, "umax": self.umax, "budget": self.budget,
                "rounds_done": self.rounds_done}

    def load_state_dict(self, state: dict) -> None:
        self.first_loss = state.get("first_loss")
        self.umax = state.get("umax")
        self.budget = int(state.get("budget", 0))
        self.rounds_done = int(state.get("rounds_done", 0))
