"""The low-bit ring allreduce (``compressor="lowbit"``): codec, ring, bytes, registration.

Oracles, none of which calls the ring:

* a float64 replay of the whole algorithm from every rank's input with the same dither draws
  (``GroupContext.private_generator(salt=hop)`` of the rank that quantises), written here from the
  description in docs/lowbit.md;
* the analytic per-quantisation bound ``|D(Q(v)) − v| < max|v|/L`` and its end-to-end sum;
* a byte count written from the message layout (fp32 scale per block + packed codes, chunks of
  whole blocks) and the model ``2(N−1)/N · (n·k/8 + 4·⌈n/B⌉)``.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from dist_harness import run_distributed

from lightning_gc.comm.exchange import ExchangeTimes, Timer
from lightning_gc.compressors import GroupContext, build_compressor
from lightning_gc.compressors.lowbit import LowBitConfig, decode_blocks, encode_blocks, message_bytes
from lightning_gc.exchanges import make_exchange

SEED = 11


# ------------------------------------------------------------------ configuration
@pytest.mark.parametrize("kwargs, match", [
    ({"bits": 3}, r"bits=3 is invalid.*Use bits=4"),
    ({"bits": 16}, r"bits=16 is invalid"),
    ({"bits": True}, r"bits=True is invalid"),
    ({"bits": "4"}, r"bits='4' is invalid"),
    ({"block_size": 7}, r"block_size=7 is invalid.*even integer"),
    ({"block_size": 0}, r"block_size=0 is invalid"),
])
def test_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LowBitConfig(**kwargs)
    with pytest.raises(ValueError, match=match):  # the same refusal through the strategy's path
        build_compressor("lowbit", args=kwargs)


def test_unknown_option_and_wrong_collective_are_refused():
    with pytest.raises(ValueError, match=r"\['levels'\] are not options of compressor 'lowbit'.*bits"):
        build_compressor("lowbit", args={"levels": 7})
    with pytest.raises(ValueError, match="cannot travel by collective='allgather'.*'lowbit'"):
        make_exchange(build_compressor("lowbit"), "allgather")
    assert make_exchange(build_compressor("lowbit"), "auto").name == "lowbit"


def test_strategy_alias_and_recipe_reach_lowbit():
    import yaml
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_gc
    from lightning_gc import GCStrategy

    s = GCStrategy(compressor="lowbit", compressor_args={"bits": 8})
    assert s.config.compression.compressor_config() == LowBitConfig(bits=8)
    assert StrategyRegistry["gc_lowbit"]["init_params"]["compressor"] == "lowbit"
    recipe = yaml.safe_load((__import__("pathlib").Path(lightning_gc.__file__).parents[1]
                             / "recipes" / "lowbit.yaml").read_text())
    args = recipe["trainer"]["strategy"]["init_args"]
    assert args["compressor"] == "lowbit" and LowBitConfig(**args["compressor_args"]).bits == 4


# ------------------------------------------------------------------ the codec alone
def _codec(v: torch.Tensor, bits: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    b, bs = v.shape
    msg = torch.empty(message_bytes(b, bs, bits), dtype=torch.uint8)
    dq = torch.empty_like(v)
    encode_blocks(v, bits, torch.Generator().manual_seed(seed), msg, dq)
    out = torch.empty_like(v)
    decode_blocks(msg, b, bs, bits, out)
    return msg, out, dq


@pytest.mark.parametrize("bits", [4, 8])
def test_codec_per_hop_bound_and_packing(bits):
    """|D(Q(v)) − v| < max|v|/L per block; the decoder reads what the encoder meant (dq); 4-bit
    codes are two per byte, low nibble first (brute-force decode of the bytes)."""
    L = 2 ** (bits - 1) - 1
    g = torch.Generator().manual_seed(3)
    v = torch.randn(6, 32, generator=g) * torch.tensor([1e-3, 1, 10, 0, 5, 1e4]).unsqueeze(1)
    msg, out, dq = _codec(v, bits, 5)
    assert torch.equal(out, dq)
    scale = v.abs().amax(dim=1, keepdim=True) / L
    assert bool(((out - v).abs() < scale * (1 + 1e-6)).logical_or(scale == 0).all())
    assert torch.equal(out[3], torch.zeros(32))  # an all-zero block stays zero
    assert torch.equal(msg[:24].view(torch.float32), scale.view(-1))
    codes = msg[24:]
    if bits == 4:
        codes = torch.stack([codes & 0xF, codes >> 4], dim=1).reshape(-1)
    levels = codes.double() - L
    assert int(levels.abs().max()) <= L
    assert torch.allclose(levels.view(6, 32) * scale.double(), out.double(), rtol=1e-6, atol=0)


def test_codec_is_unbiased_per_element():
    """Mean over 4000 dithers of one block → v, within 5 standard errors of the rounding's variance
    (a rounding step s moves an element by a Bernoulli(frac)·s: variance ≤ s²/4)."""
    v = torch.linspace(-1, 1, 64).view(1, 64) * 0.37
    s = float(v.abs().max()) / 7
    draws = 4000
    acc = torch.zeros_like(v, dtype=torch.float64)
    for seed in range(draws):
        acc += _codec(v, 4, seed)[1].double()
    err = (acc / draws - v.double()).abs()
    assert float(err.max()) <= 5 * (s / 2) / math.sqrt(draws), float(err.max())


# ------------------------------------------------------------------ float64 replay (the oracle)
def _inputs(n: int, d: int, case: int) -> list[torch.Tensor]:
    out = []
    for r in range(n):
        g = torch.Generator().manual_seed(7919 * case + r)
        out.append(torch.randn(d, generator=g) * (1 + r) + 0.25 * r)  # rank-dependent scale and offset
    return out


def _quantise64(v: torch.Tensor, bits: int, bs: int, rank: int, hop: int, n: int, d: int, step: int,
                case: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One quantisation of rank ``rank`` at ``hop``: float64 q·s, the per-element step s, and where
    ``v/s + u`` lies within :data:`AMBIGUOUS` of an integer (there float32 may round the other way)."""
    L = 2 ** (bits - 1) - 1
    ctx = GroupContext(step=step, rank=rank, world_size=n, segments=(d,), group_id=case, seed=SEED)
    words = torch.empty((v.numel() + 3) // 4, dtype=torch.int64).random_(generator=ctx.private_generator(salt=hop))
    r = words.view(torch.int16)[:v.numel()].double().remainder(32768)  # the low 15 bits of each int16 lane
    u = ((r + 0.5) / 32768).view(-1, bs)  # the documented dither
    s = v.abs().amax(dim=1, keepdim=True) / L
    t = v / torch.where(s > 0, s, 1.0) + u
    q = torch.where(s > 0, torch.floor(t), torch.zeros_like(v)).clamp(-L, L)
    amb = ((t - torch.round(t)).abs() < AMBIGUOUS) & (s > 0)
    return q * s, s.expand_as(v), amb


#: float32 and float64 may floor ``v/s + u`` differently this close to an integer
AMBIGUOUS = 1e-4


def _replay(xs: list[torch.Tensor], bits: int, bs: int, step: int, case: int):
    """The ring's mean, each rank's quantisation errors (sum units), the end-to-end error bound, and
    the elements whose rounding was ambiguous at some hop."""
    n, d = len(xs), xs[0].numel()
    nb = -(-d // bs)
    pad = [torch.cat([x.double(), torch.zeros(nb * bs - d, dtype=torch.float64)]).view(nb, bs) for x in xs]
    per, extra = divmod(nb, n)
    counts = [per + (1 if c < extra else 0) for c in range(n)]
    mean = torch.zeros(nb, bs, dtype=torch.float64)
    bound = torch.zeros_like(mean)
    amb = torch.zeros_like(mean, dtype=torch.bool)
    errs = [torch.zeros_like(mean) for _ in range(n)]
    for c in range(n):  # chunk c starts at rank c, is quantised at hops 1..n-1 by ranks c..c+n-2
        lo, hi = sum(counts[:c]), sum(counts[:c + 1])
        if lo == hi:
            continue
        acc = pad[c][lo:hi]
        for hop in range(1, n):
            sender = (c + hop - 1) % n
            dq, s, a = _quantise64(acc, bits, bs, sender, hop, n, d, step, case)
            amb[lo:hi] |= a
            errs[sender][lo:hi] += acc - dq
            bound[lo:hi] += s / n
            acc = dq + pad[(c + hop) % n][lo:hi]
        owner = (c - 1) % n
        dq, s, a = _quantise64(acc / n, bits, bs, owner, n, n, d, step, case)
        amb[lo:hi] |= a
        errs[owner][lo:hi] += (acc / n - dq) * n
        bound[lo:hi] += s
        mean[lo:hi] = dq
    flat = lambda t: t.view(-1)[:d]  # noqa: E731
    return flat(mean), [flat(e) for e in errs], flat(bound), flat(amb)


def _expected_bytes(d: int, bits: int, bs: int, n: int, rank: int) -> int:
    nb = -(-d // bs)
    counts = [nb // n + (1 if c < nb % n else 0) for c in range(n)]
    size = [4 * k + k * bs * bits // 8 for k in counts]
    return sum(size[(rank - s) % n] + size[(rank + 1 - s) % n] for s in range(n - 1))


CASES = [  # (d, bits, block): one block for many ranks, uneven chunks and tail, both widths
    (13, 4, 128), (1000, 4, 16), (4099, 8, 64), (2048, 4, 128), (777, 8, 2),
]
STEPS = (3, 4)


def _run_cases(rank: int, n: int) -> dict:
    out = {"cases": []}
    for case, (d, bits, bs) in enumerate(CASES):
        comp = build_compressor("lowbit", args={"bits": bits, "block_size": bs})
        ex = make_exchange(comp, "auto")
        p = _inputs(n, d, case)[rank]
        res = {}
        for step in STEPS:
            times = ExchangeTimes()
            ctx = GroupContext(step=step, rank=rank, world_size=n, segments=(d,), group_id=case, seed=SEED)
            mean, sent = ex.run(p.clone(), ctx, Timer(torch.device("cpu"), times))
            res[step] = {"mean": mean, "sent": sent, "bytes": times.bytes_sent}
        out["cases"].append(res)
    return out


@functools.cache
def _ring_results(n: int) -> list[dict]:
    return run_distributed(_run_cases, n, timeout=300)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_ring_equals_float64_replay_with_the_same_draws(n):
    """Mean, error-feedback residuals and the documented error bound against the replay."""
    results = _ring_results(n)
    for case, (d, bits, bs) in enumerate(CASES):
        xs = _inputs(n, d, case)
        for step in STEPS:
            ref, errs, bound, amb = _replay(xs, bits, bs, step, case)
            exact = sum(x.double() for x in xs) / n
            mean = results[0]["cases"][case][step]["mean"].double()
            tol = 1e-5 * float(bound.max()) + 1e-7
            off = (mean - ref).abs() > tol
            # every difference sits where a rounding was a float32/float64 tie, and ties are rare
            assert not bool((off & ~amb).any()), (case, step, float((mean - ref).abs()[~amb].max()))
            assert int(amb.sum()) <= max(4, d // 100), (case, step, int(amb.sum()))
            assert bool(((mean - exact).abs() <= bound * (1 + 1e-5) + 1e-7).all()), (case, step)
            assert float((mean - exact).abs().max()) > 0  # it is lossy: the bound is not vacuous
            for r in range(n):
                sent = results[r]["cases"][case][step]["sent"].double()
                diff = (xs[r].double() - sent - errs[r]).abs()[~amb]
                assert float(diff.max()) <= tol * n, (case, step, r, float(diff.max()))


@pytest.mark.parametrize("n", [2, 3, 4])
def test_ranks_bit_identical_and_steps_draw_apart(n):
    results = _ring_results(n)
    for case in range(len(CASES)):
        for step in STEPS:
            first = results[0]["cases"][case][step]["mean"]
            assert all(torch.equal(r["cases"][case][step]["mean"], first) for r in results[1:]), (case, step)
        d = CASES[case][0]
        a, b = (results[0]["cases"][case][s]["mean"] for s in STEPS)
        assert d < 50 or not torch.equal(a, b)  # the step is in the draws


def _bytes_at(rank: int, n: int) -> list[int]:
    out = []
    for bits in (4, 8):
        comp = build_compressor("lowbit", args={"bits": bits})
        times = ExchangeTimes()
        ctx = GroupContext(step=1, rank=rank, world_size=n, segments=(BYTES_D,), seed=SEED)
        make_exchange(comp, "auto").run(torch.randn(BYTES_D) + rank, ctx, Timer(torch.device("cpu"), times))
        out.append(times.bytes_sent)
    return out


BYTES_D = 100_003


def test_bytes_per_rank_are_flat_in_n():
    """Measured bytes per rank at 2, 3, 4 and 8 ranks: exactly the layout's count, within one block
    per message of ``2(N−1)/N · (n·k/8 + 4·⌈n/B⌉)``, and below ``2·(n·k/8 + 4·⌈n/B⌉)`` for every N."""
    nb = -(-BYTES_D // 128)
    for n in (2, 3, 4, 8):
        for r, per_bits in enumerate(run_distributed(_bytes_at, n, timeout=200)):
            for bits, measured in zip((4, 8), per_bits):
                assert measured == _expected_bytes(BYTES_D, bits, 128, n, r)
                model = 2 * (n - 1) / n * (BYTES_D * bits / 8 + 4 * nb)
                assert abs(measured - model) <= 2 * (n - 1) * (4 + 128 * bits / 8), (n, r, measured, model)
                assert measured < 2 * (BYTES_D * bits / 8 + 4 * nb)


def test_cost_model_bytes_and_auto_efficiency_follow_the_stated_formulas():
    """advise/auto's byte model and error charge, against the formulas of docs/lowbit.md."""
    from lightning_gc.auto.model import MethodCost, efficiency
    from lightning_gc.comm.cost_model import lowbit_ring_bytes

    for n in (2, 3, 4, 8, 64):
        exact = [_expected_bytes(BYTES_D, 4, 128, n, r) for r in range(n)]
        assert all(abs(b - lowbit_ring_bytes(BYTES_D, n, 4, 128)) <= 2 * (n - 1) * (4 + 64) for b in exact)
    cost = MethodCost("lowbit", "lowbit", 0.0, 1000.0, delta2=0.03)
    for n in (1, 4, 64, 1024):
        factor = sum(h * h for h in range(1, n)) / n ** 2 + 1  # Σ_{h<N} h²/N² + 1
        assert efficiency(cost, n, 2.0) == pytest.approx(1 / (1 + 2.0 * 0.03 * factor))
