"""Marsit: one-bit signs merged without bias along a multi-hop ring (Wu et al., DAC 2022).

Why it exists. signSGD compresses a gradient to one bit per element, but the sum of two sign
vectors is no longer a sign vector, so signSGD travels by allgather, whose bytes grow with the
number of ranks N (each rank forwards N−1 payloads). A ring allreduce sends only 2(N−1)/N of the
message per rank, but needs a reduction that keeps one bit per element at every hop. Re-compressing
the partial sum at every hop ("cascading compression", the paper's SSDM foil) biases the result and
its deviation explodes with N. Marsit merges bits instead:

* every rank turns its error-fed gradient ``p = g + c`` into bits ``b = [p ≥ 0]`` (zero counts as
  positive), packed 8 per byte;
* at ring hop ``m`` (the incoming bit ``a`` already aggregates ``m − 1`` ranks) the merged bit is
  ``a ⊙ b = (a AND b) OR ((a XOR b) AND v)`` with a *transient* Bernoulli bit ``v`` (Eq. 2)::

      P(v = 1) = (m − 1)/m   if the local bit b = 0
      P(v = 1) = 1/m         if the local bit b = 1

  If ``P(a = 1)`` equals the fraction of ones among the ``m − 1`` ranks, then ``P(a ⊙ b = 1)``
  equals the fraction among the ``m`` ranks (proof in :func:`merge_packed`): after N − 1 hops the
  merged bit is an unbiased estimate of the mean of all ranks' bits, so ``E[2·bit − 1]`` is the
  mean of the ranks' signs;
* the global update is ``η_s · (2·bits − 1)`` (signs as ±1), identical on every rank.

Global compensation (Algorithm 1). Each rank keeps ``c ← (g + c) − g_global`` after a one-bit
round: the compensation is measured against the *global* result, because in a multi-hop ring no
rank knows what its own contribution became. In this package the engine's error memory is
``e = p − sent``; the Marsit exchange returns ``sent = g_global`` on one-bit rounds, so the engine's
error memory *is* Marsit's compensation vector. Every ``K`` rounds (``full_precision_every``) a
full-precision allreduce of ``g + c`` replaces the one-bit round and ``c ← 0`` (the exchange
returns ``sent = p``). Rounds are optimizer steps: a full-precision round happens when
``step % K == 0`` (step 0 is also the engine's dense warm-up step by default).

η_s (the paper's global step size). The paper's theory uses a constant ``η_s = 1/√(TD)``; that
needs the run length T. Here ``scale="l1"`` (default) sets ``η_s`` per round and group to the mean
over ranks of ``‖g_r + c_r‖₁ / d`` — the mean magnitude of what the ranks wanted to send, as
``efsignsgd`` does per rank — agreed by one 4-byte allreduce, so the update has the magnitude of a
gradient and SGD learning rates carry over. ``scale="none"`` uses ``η_s = 1`` (bare signs): then
the learning rate alone sets the step size (use one ~100× smaller than for SGD), and the
compensation holds gradients minus ±1, so prefer it with ``error_feedback=False``.

The paper's setting vs ours. Algorithm 2 feeds Marsit ``η_l·g`` (the local step size applied
before synchronising) and steps ``x ← x − g_global``. Here Marsit runs inside the DDP
communication hook once per optimizer step on the raw gradient, and the optimizer applies the
learning rate to the result: ``η_l`` is the optimizer's learning rate and the paper's ``η_s``
equals ``lr × η_s`` of this module. For plain SGD with a constant learning rate the two are the
same algorithm (the compensation is kept in gradient units instead of parameter units); with
momentum or Adam the optimizer's state is fed the Marsit estimate instead of the paper's direct
step.

Randomness. The transient bits of rank r at hop h come from a generator seeded by
``(seed, step, group, hop, rank)`` (``GroupContext.private_generator(salt=hop)``); the global RNG
is never touched, and a resumed run draws the same bits. ``seed`` in the config overrides the
strategy's seed for these draws only.

Tuning. ``full_precision_every`` (K) trades bytes for accuracy: the amortised cost is about
``2(N−1)/N · (1/8 + 4/K)`` bytes per element per rank (K = 100: ≈ 0.165 vs dense 4); the paper's
Figure 3 finds K = 50…200 close to dense accuracy and K = ∞ (0 here) about 2–3 points lower.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from ..packing import pack_bits


@dataclass(frozen=True)
class MarsitConfig:
    """Attributes:
    full_precision_every: K — every K-th optimizer step (``step % K == 0``) is a full-precision
        allreduce of ``g + c`` that also resets the compensation to zero; 0 = never (pure one-bit).
        1 makes every step full precision (plain DDP numerics). Typical: 50–200.
    scale: rule for the global step size η_s: ``"l1"`` = mean over ranks of ``‖g + c‖₁/d``
        (agreed by a 4-byte allreduce each round), ``"none"`` = 1 (bare signs).
    seed: seed of the transient Bernoulli bits; ``None`` uses the strategy's ``seed``.
    release_compensation: what a full-precision round does with the compensation ``c``.
        ``True`` (the paper's Algorithm 1): it is sent with the gradient, the round's result is the
        mean of ``g + c``, then ``c ← 0`` — the debt of K one-bit rounds released in one update.
        ``False``: the round sends the mean of ``g`` alone and discards ``c`` (``c ← 0`` without
        the release), so no burst reaches a momentum buffer or Adam's moments. See
        docs/compressors.md for when each is better.
    """

    full_precision_every: int = 100
    scale: Literal["l1", "none"] = "l1"
    seed: int | None = None
    release_compensation: bool = True

    def __post_init__(self) -> None:
        k = self.full_precision_every
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(
                f"full_precision_every={k!r} is invalid: it is K, the period (in optimizer steps) of the "
                "full-precision rounds that reset the compensation, and must be an integer ≥ 0. Use 0 for "
                "never, or e.g. 100."
            )
        if self.scale not in ("l1", "none"):
            raise ValueError(
                f"scale={self.scale!r} is invalid: use 'l1' (η_s = mean over ranks of ‖g + c‖₁/d) or "
                "'none' (η_s = 1, bare signs)."
            )
        if not isinstance(self.release_compensation, bool):
            raise ValueError(
                f"release_compensation={self.release_compensation!r} is invalid: use True (a full-precision round "
                "sends g + c, the paper's rule) or False (it sends g and discards c)."
            )
        s = self.seed
        if s is not None and (isinstance(s, bool) or not isinstance(s, int) or s < 0):
            raise ValueError(
                f"seed={s!r} is invalid: use a non-negative integer, or None to use the strategy's seed."
            )


def transient_bits(local_bits: Tensor, m: int, generator: torch.Generator) -> Tensor:
    """Eq. 2: Bernoulli bits with P(1) = (m−1)/m where the local bit is 0 and 1/m where it is 1.

    Drawn as ``v = b XOR W`` with ``W = [u < (m−1)/m]``, one float32 uniform ``u`` per bit from
    ``generator`` (``torch.rand(n, generator=generator)``, in bit order): where ``b = 0``,
    ``v = W`` is 1 with probability (m−1)/m; where ``b = 1``, ``v = NOT W`` is 1 with probability
    1/m. ``W`` does not depend on the bits, so the merge needs no unpacking of the local bits.
    """
    return local_bits ^ _keep_incoming(local_bits.numel(), m, generator, local_bits.device)


def _keep_incoming(n: int, m: int, generator: torch.Generator, device: torch.device) -> Tensor:
    if m < 2:
        raise ValueError(f"hop m={m} is invalid: the first merge happens at m = 2 (incoming data of 1 rank)")
    return torch.rand(n, generator=generator, device=device, dtype=torch.float32) < (m - 1) / m


def merge_packed(incoming: Tensor, local: Tensor, m: int, generator: torch.Generator) -> Tensor:
    """The ⊙ operator on packed bits: ``(a AND b) OR ((a XOR b) AND v)``, ``v`` from Eq. 2.

    ``incoming`` (a) aggregates ``m − 1`` ranks, ``local`` (b) is this rank's bits; both uint8 of the
    same length (whole bytes, 8 bits each); ``v`` as drawn by :func:`transient_bits`. Unbiasedness:
    let k = number of ones among the m − 1 ranks and P(a = 1) = k/(m−1). If b = 1 the result is 1
    unless a = 0 and v = 0: P = k/(m−1) + (1 − k/(m−1))·1/m = (k+1)/m. If b = 0 the result is 1
    only when a = 1 and v = 1: P = k/(m−1)·(m−1)/m = k/m. Either way P(result = 1) = (ones among
    the m ranks)/m, because v is drawn independently of a. (Equivalently: where the bits differ,
    the incoming bit wins with probability (m−1)/m, the local one with 1/m.)
    """
    v = local ^ pack_bits(_keep_incoming(local.numel() * 8, m, generator, local.device))
    return (incoming & local) | ((incoming ^ local) & v)
