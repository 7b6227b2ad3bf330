"""GradiVeQ's cross-rank safety checks, stop vote and reported ratio at 2, 3 and 4 ranks, and the
setup agreement of every compressor option, each triggered on purpose on every rank in turn.

Oracles written here, never computed by the code under test:

* the basis digest check: one rank's samples differ (an extra sample recorded on that rank only,
  so its μ̄ differs while U, d and every payload size stay the same — without the check the ranks
  would silently diverge); every rank must raise, naming the ranks grouped by basis, for each
  choice of the odd rank out; with identical samples nothing is raised;
* the stop vote: the sample means span one direction u (exact dyadic values), so U = ±u and
  μ̄ = u/2 by hand; on the compressed step v chosen ranks send ``u + 2w`` (w ⟂ u: Eq. 7 loss
  exactly 4/5) and the others ``(1 + r)·u`` (loss 0). The summed votes must be v, the mean loss
  0.8·v/N, the mean ``u · mean_r(a_r)`` per slice, and the phase ends iff 2v > N — at even N
  half the ranks is a tie and must not end it;
* the reported ``gradiveq/ratio`` of a step with two compressed groups: Σ z elements / Σ elements,
  rows·d per compressed tensor and 1 per exact element, written out;
* the engine's setup check: one rank built Marsit, VAR AR-Topk or GradiVeQ with another option;
  every rank raises naming the ranks and both option values;
* single process: every option of every compressor changes ``describe()`` (the setup signature),
  the digest changes with one ulp of U or μ̄, and the vote rule ``2v > N`` at N = 1…6.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from dist_harness import run_distributed

from lightning_gc.comm.exchange import ExchangeTimes, Timer
from lightning_gc.compressors import GroupContext, available_compressors, build_compressor, takes_ratio
from lightning_gc.compressors.gradiveq import GradiVeQCompressor, GradiVeQConfig, GroupBasis
from lightning_gc.engine import EngineConfig, GCEngine
from lightning_gc.exchanges.gradiveq import GradiVeQRingExchange

SHAPES = ((12, 40), (12,))  # a linear layer: F·D = 480 > 96 → K = 12·8 = 96, 5 rows; its bias exact
SEGS = (480, 12)
CONV = ((8, 4, 3, 3),)  # F·D = 32 ≤ 96, m | 9, m ≤ 3 → K = 96, 3 rows
BASE = dict(max_slice=96, warmup=0, sample_steps=2, compress_steps=3, sample_levels=0, pca_slices=2, dim=1,
            loss_threshold=None, coef_dtype="float32", outside_span="zero")
THRESHOLD = 0.5
U_VEC = torch.zeros(96)
U_VEC[:16] = 0.25  # unit norm, exact
W_VEC = torch.zeros(96)
W_VEC[16:32] = 0.25  # unit norm, orthogonal to U_VEC


def _unpack(rows: torch.Tensor) -> torch.Tensor:
    """Packed (5, 96) rows of the (12, 40) weight back to its own layout: packed order is (P, D, F)."""
    return rows.reshape(1, 40, 12).permute(2, 1, 0).reshape(-1)


def _weight(row: torch.Tensor) -> torch.Tensor:
    return _unpack(row.expand(5, 96).clone())


def _ctx(rank: int, ws: int, step: int, gid: int = 0, shapes=SHAPES) -> GroupContext:
    segs = tuple(int(torch.Size(s).numel()) for s in shapes)
    names = ("fc.weight", "fc.bias") if shapes == SHAPES else ("conv.weight",)
    return GroupContext(step=step, rank=rank, world_size=ws, segments=segs, group_id=gid, seed=1, shapes=shapes,
                        names=names)


def _sample_input(rank: int, ws: int, step: int) -> torch.Tensor:
    """Mean over ranks: step·u per slice (the rank-dependent w parts cancel); bias rank-dependent."""
    dev = rank - (ws - 1) / 2
    return torch.cat([_weight(step * U_VEC + dev * W_VEC), torch.full((12,), float(rank + 1))])


def _run(ex, p: torch.Tensor, ctx: GroupContext, times: ExchangeTimes | None = None):
    times = times if times is not None else ExchangeTimes()
    mean, _ = ex.run(p, ctx, Timer(torch.device("cpu"), times))
    return mean, times


def _digest_case(rank: int, ws: int, bad: int | None) -> dict:
    ex = GradiVeQRingExchange(GradiVeQCompressor(GradiVeQConfig(**BASE)))
    for step in range(2):
        _run(ex, _sample_input(rank, ws, step), _ctx(rank, ws, step))
    if rank == bad:  # this rank alone records one more sample: its μ̄ differs, U, d and sizes do not
        ex.compressor.add_sample(_sample_input(0, 1, 1), _ctx(rank, ws, 1))
    try:
        _run(ex, _sample_input(rank, ws, 1), _ctx(rank, ws, 2))
    except RuntimeError as e:
        return {"error": str(e)}
    return {"error": None, "digest": ex.compressor.bases[0].digest}


def _vote_case(rank: int, ws: int, voters: set[int]) -> dict:
    ex = GradiVeQRingExchange(GradiVeQCompressor(GradiVeQConfig(**dict(BASE, loss_threshold=THRESHOLD))))
    for step in range(2):
        _run(ex, _sample_input(rank, ws, step), _ctx(rank, ws, step))
    row = U_VEC + 2 * W_VEC if rank in voters else (1 + rank) * U_VEC
    mean, times = _run(ex, torch.cat([_weight(row), torch.full((12,), float(rank))]), _ctx(rank, ws, 2))
    loss = ex.last_loss[0]
    _, after = _run(ex, _sample_input(rank, ws, 0), _ctx(rank, ws, 3))
    return {"mean": mean, "votes": times.metrics["gradiveq/stop_votes"], "loss": loss,
            "phase": times.metrics["gradiveq/phase"], "next_phase": after.metrics["gradiveq/phase"],
            "mu": ex.compressor.bases[0].mu[0].clone(), "U": ex.compressor.bases[0].blocks[0].U.clone()}


def _ratio_case(rank: int, ws: int) -> dict:
    """Two compressed groups through one step's ExchangeTimes."""
    ex = GradiVeQRingExchange(GradiVeQCompressor(GradiVeQConfig(**BASE)))
    out = {}
    for step in range(3):
        times = ExchangeTimes()
        _run(ex, _sample_input(rank, ws, step % 2), _ctx(rank, ws, step, 0), times)
        g = torch.Generator().manual_seed(10 * rank + step)
        _run(ex, torch.randn(288, generator=g) * (1 + rank), _ctx(rank, ws, step, 1, CONV), times)
        out = dict(times.metrics)
    return out


SETUP_CASES = [  # (compressor, option, value on the other ranks, value on the odd rank, words in the message)
    ("marsit", "full_precision_every", 100, 50, ("K=100", "K=50")),
    ("var_topk", "var_smoothing", 0.0, 0.5, ("var_smoothing=0.0", "var_smoothing=0.5")),
    ("gradiveq", "lam", 0.01, 0.02, ("lam=0.01", "lam=0.02")),
]


def _setup_case(rank: int, ws: int, name: str, option: str, good, bad_value, bad: int) -> str:
    model = torch.nn.Linear(8, 4)
    comp = build_compressor(name, ratio=0.1 if name == "var_topk" else None,
                            args={option: bad_value if rank == bad else good})
    try:
        GCEngine(comp, EngineConfig(min_compress_numel=0, overlap=False), list(model.named_parameters()))
    except RuntimeError as e:
        return str(e)
    return "no error"


def _worker(rank: int, ws: int) -> dict:
    return {
        "digest": {bad: _digest_case(rank, ws, bad) for bad in [None, *range(ws)]},
        # v voters, chosen so that the last rank is not always among them
        "vote": {v: _vote_case(rank, ws, {(v + j) % ws for j in range(v)}) for v in range(ws + 1)},
        "ratio": _ratio_case(rank, ws),
        "setup": {(c[0], bad): _setup_case(rank, ws, *c[:4], bad) for c in SETUP_CASES for bad in range(ws)},
    }


# ws4 (11 s on 2 cores) with -m extended; 3 ranks already have a middle rank
@pytest.fixture(scope="module", params=[2, 3, pytest.param(4, marks=pytest.mark.extended)], ids=lambda n: f"ws{n}")
def spawned(request):
    ws = request.param
    return ws, run_distributed(_worker, ws, timeout=300)


def _groups(ws: int, bad: int) -> list[list[int]]:
    """Ranks grouped by what they hold, in order of each group's first rank (as the check lists them)."""
    good = [r for r in range(ws) if r != bad]
    return [good, [bad]] if good[0] < bad else [[bad], good]


def test_basis_digest_mismatch_on_any_one_rank_raises_on_every_rank(spawned):
    ws, results = spawned
    control = [res["digest"][None] for res in results]
    assert all(c["error"] is None for c in control), control
    assert len({c["digest"] for c in control}) == 1  # identical samples: identical bases
    for bad in range(ws):
        digests = {}
        for r, res in enumerate(results):
            msg = res["digest"][bad]["error"]
            assert msg is not None, f"ws={ws}: rank {bad}'s basis differs and rank {r} did not notice"
            assert "GradiVeQ" in msg and "basis" in msg and "group 0" in msg, msg
            assert str(_groups(ws, bad)) in msg, (ws, bad, msg)
            digests[r] = re.search(r"digest=([0-9a-f]+)", msg).group(1)
        assert digests[bad] != digests[(bad + 1) % ws]
        assert len({digests[r] for r in range(ws) if r != bad}) == 1


def test_stop_vote_is_a_strict_majority_of_summed_votes(spawned):
    ws, results = spawned
    for v in range(ws + 1):
        voters = {(v + j) % ws for j in range(v)}
        a = [1.0 if r in voters else 1.0 + r for r in range(ws)]
        for r, res in enumerate(results):
            got = res["vote"][v]
            assert torch.allclose(got["U"].abs().reshape(-1), U_VEC.abs(), atol=1e-6)  # U = ±u by hand
            assert torch.allclose(got["mu"], (U_VEC / 2).expand(5, 96), atol=1e-6)  # μ̄ = mean of 0·u and 1·u
            assert got["phase"] == 2.0
            assert got["votes"] == v, (ws, v, r, got["votes"])
            assert got["loss"] == pytest.approx(0.8 * v / ws, abs=1e-6)
            want_row = U_VEC * (sum(a) / ws)  # P x̄: the mean's component along u
            assert torch.allclose(got["mean"][:480], _weight(want_row), atol=1e-5), (ws, v, r)
            assert torch.allclose(got["mean"][480:], torch.full((12,), sum(range(ws)) / ws))
            ends = 2 * v > ws
            assert got["next_phase"] == (1.0 if ends else 2.0), (ws, v, r, got["next_phase"])


def test_reported_ratio_covers_every_compressed_group_of_the_step(spawned):
    ws, results = spawned
    # d = 1: group 0 sends 5 rows·1 + 12 exact values of 492 elements, group 1 3 rows·1 of 288
    for res in results:
        assert res["ratio"]["gradiveq/phase"] == 2.0
        assert res["ratio"]["gradiveq/ratio"] == pytest.approx((5 + 12 + 3) / (492 + 288), rel=1e-12)
        assert res["ratio"]["gradiveq/d/fc.weight"] == 1.0 and res["ratio"]["gradiveq/d/conv.weight"] == 1.0


@pytest.mark.parametrize("case", SETUP_CASES, ids=[c[0] for c in SETUP_CASES])
def test_option_differing_on_any_one_rank_is_refused_at_setup_on_every_rank(spawned, case):
    ws, results = spawned
    name, _, _, _, words = case
    for bad in range(ws):
        for r, res in enumerate(results):
            msg = res["setup"][(name, bad)]
            assert "ranks built different communication setups" in msg, (ws, name, bad, r, msg)
            assert str(_groups(ws, bad)) in msg, (ws, name, bad, msg)
            assert all(w in msg for w in words), (words, msg)


# ------------------------------------------------------------------------------ single process
ALTERNATIVES = {  # an alternative valid value for every option of every compressor
    "ratio": 0.5, "scale": "none", "levels": 3, "bucket_size": 64, "search_rounds": 7, "unbiased": False,
    "selection": ("var", "star"), "var_smoothing": 0.5, "full_precision_every": 7, "seed": 5,
    "lam": 0.2, "max_slice": 64, "reuse": 2, "pca_slices": 3, "warmup": 9, "sample_steps": 3, "compress_steps": 4,
    "loss_threshold": None, "sample_levels": 0, "sample_bucket": 64, "min_numel": 9, "compress_linear": False,
    "dim": 4, "coef_dtype": "float32", "outside_span": "mu", "dtype": ("bf16", "fp16"),
    "rank": 3, "min_compression_rate": 1.5, "warm_start": False, "release_compensation": False,
    "dense_names": (["tok_emb.weight"],),  # one alternative: a list of patterns
    "wire_dtype": ("bfloat16", "float32"),
    "bits": (8, 4), "block_size": 64,
}


@pytest.mark.parametrize("name", available_compressors())
def test_every_option_is_part_of_the_setup_signature(name):
    """describe() is what the ranks compare at setup: an option it leaves out could differ unnoticed."""
    comp = build_compressor(name, ratio=0.1 if takes_ratio(name) else None)
    if not dataclasses.is_dataclass(comp.config):
        return  # no options (dense, casts)
    for f in dataclasses.fields(comp.config):
        assert f.name in ALTERNATIVES, f"{name}: option {f.name!r} has no alternative value in this test"
        alts = ALTERNATIVES[f.name] if isinstance(ALTERNATIVES[f.name], tuple) else (ALTERNATIVES[f.name],)
        alt = next(a for a in alts if a != getattr(comp.config, f.name))
        other = type(comp)(dataclasses.replace(comp.config, **{f.name: alt}))
        assert other.describe() != comp.describe(), f"{name}: {f.name}={alt!r} does not change describe()"


def _fitted_basis() -> tuple[GradiVeQCompressor, GroupBasis]:
    comp = GradiVeQCompressor(GradiVeQConfig(**dict(BASE, dim=2)))
    for step in range(3):
        comp.phase(step)
        g = torch.Generator().manual_seed(step)
        comp.add_sample(torch.randn(492, generator=g), _ctx(0, 1, step))
    basis = comp.fit(_ctx(0, 1, 3), torch.float32)
    assert basis is not None
    return comp, basis


@pytest.mark.parametrize("what", ["U", "mu", "d", "rows"])
def test_basis_digest_changes_with_one_ulp_of_any_part(what):
    comp, basis = _fitted_basis()
    blk = basis.blocks[0]
    U, mu = blk.U.clone(), {k: v.clone() for k, v in basis.mu.items()}
    r0, r1 = blk.r0, blk.r1
    if what == "U":
        U[7, 1] = torch.nextafter(U[7, 1], torch.tensor(2.0))
    elif what == "mu":
        mu[0][3, 5] = torch.nextafter(mu[0][3, 5], torch.tensor(2.0))
    elif what == "d":
        U = U[:, :1].clone()
    else:
        r1 = r1 - 1
    changed = GroupBasis(basis.layers, [dataclasses.replace(blk, U=U, r0=r0, r1=r1)], mu)
    same = GroupBasis(basis.layers, [dataclasses.replace(blk, U=blk.U.clone())], {k: v.clone() for k, v in basis.mu.items()})
    assert GradiVeQCompressor.digest(same) == basis.digest
    assert GradiVeQCompressor.digest(changed) != basis.digest


@pytest.mark.parametrize("ws", [1, 2, 3, 4, 5, 6])
def test_vote_rule_is_a_strict_majority(ws):
    for v in range(ws + 1):
        comp = GradiVeQCompressor(GradiVeQConfig(warmup=0, sample_steps=2, compress_steps=5))
        assert [comp.phase(s) for s in range(3)] == ["sample", "sample", "compress"]
        assert comp.vote(float(v), ws) == (2 * v > ws), (ws, v)
        assert comp.phase(3) == ("sample" if 2 * v > ws else "compress"), (ws, v)
