"""DiLoCo (``sync="diloco"``): outer steps against hand-written references from all ranks' θ_local,
error-feedback conservation of a compressed Δ, the non-finite agreement, bit-identical ranks, the
configuration refusals, and (tests/test_diloco_lightning.py) DDP parity and exact resume."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from dist_harness import run_distributed

from lightning_gc import GCStrategy
from lightning_gc.config import GCConfig
from lightning_gc.sync.diloco import DiLoCoConfig, DiLoCoSync

SHAPES = [(40, 30), (30,), (7, 50)]


class _Traffic:
    """The engine double: what DiLoCo reads (parameters, group, seed) and the bytes it reports."""

    def __init__(self, params, rank, world_size):
        import torch.distributed as dist

        self.params = params
        self.names = [f"p{i}" for i in range(len(params))]
        self.world_size = world_size
        self.rank = rank
        self.device = torch.device("cpu")
        self.process_group = dist.group.WORLD if world_size > 1 else None
        self.config = SimpleNamespace(seed=0)
        self.bytes = []

    def add_deferred_traffic(self, bytes_sent, bytes_payload, bytes_inter_node=0):
        self.bytes.append((bytes_sent, bytes_payload))


def _theta0():
    g = torch.Generator().manual_seed(7)
    return [torch.randn(s, generator=g) for s in SHAPES]


def _local_move(rank, outer_step):
    """A rank-dependent inner-round displacement. Scales and signs vary per rank and per element,
    so no rank dominates the mean in magnitude or in sign."""
    g = torch.Generator().manual_seed(100 * outer_step + rank)
    return [torch.randn(s, generator=g) * (0.5 + rank) * (-1) ** (rank + outer_step) for s in SHAPES]


def _run_outer_steps(rank, world_size, compressor_name, outer_optimizer, outer_args, steps, nan_rank=-1,
                     error_decay=1.0):
    from lightning_gc.compressors import build_compressor

    params = [t.clone() for t in _theta0()]
    engine = _Traffic(params, rank, world_size)
    compressor = build_compressor(compressor_name, ratio=0.05) if compressor_name != "dense" else None
    sync = DiLoCoSync(engine, DiLoCoConfig(inner_steps=1, outer_optimizer=outer_optimizer, outer_args=outer_args,
                                                 error_decay=error_decay),
                      compressor, error_feedback=compressor is not None and compressor.default_error_feedback)
    record = []
    for k in range(steps):
        before = [p.clone() for p in params]
        memory_before = sync.memory.clone() if sync.memory is not None else None
        with torch.no_grad():
            for p, d in zip(params, _local_move(rank, k)):
                p.add_(d)
                if rank == nan_rank and k == 1:
                    p.view(-1)[3] = math.nan
        local = [p.clone() for p in params]
        sync.outer_step()
        record.append({"outer_before": before, "local": local, "after": [p.clone() for p in params],
                       "memory_before": memory_before,
                       "memory_after": sync.memory.clone() if sync.memory is not None else None,
                       "stats": vars(sync.last_stats).copy()})
    sync.close()
    return record


def _flat(ts):
    return torch.cat([t.reshape(-1) for t in ts])


def _three_rank_scenarios(rank, world_size):
    """The 3-rank scenarios in one launch (a spawn costs more than the scenarios themselves)."""
    return {
        "published": _run_outer_steps(rank, world_size, "dense", "SGD", None, 3),
        **{("topk", decay): _run_outer_steps(rank, world_size, "topk", "SGD", {"lr": 1.0}, 3, -1, decay)
           for decay in (1.0, 0.5)},
        "short": _short_payload(rank, world_size),
    }


def _two_rank_scenarios(rank, world_size):
    return {"published": _run_outer_steps(rank, world_size, "dense", "SGD", None, 3),
            "nan": _run_outer_steps(rank, world_size, "dense", "SGD", None, 3, 1)}


@pytest.fixture(scope="module")
def two_ranks():
    out = run_distributed(_two_rank_scenarios, 2, timeout=300)
    return {key: [o[key] for o in out] for key in out[0]}


@pytest.fixture(scope="module")
def three_ranks():
    out = run_distributed(_three_rank_scenarios, 3, timeout=300)
    return {key: [o[key] for o in out] for key in out[0]}


@pytest.mark.parametrize("world_size", [2, 3])
def test_outer_step_equals_a_hand_written_nesterov_reference(world_size, request):
    """Published outer optimizer (SGD lr 0.7, momentum 0.9, Nesterov), dense Δ, three outer steps."""
    out = request.getfixturevalue({2: "two_ranks", 3: "three_ranks"}[world_size])["published"]
    for r in range(1, world_size):  # every rank loads the same θ_outer, bit for bit
        for k in range(3):
            assert torch.equal(_flat(out[r][k]["after"]), _flat(out[0][k]["after"]))
    lr, mu = 0.7, 0.9
    theta = _flat(_theta0()).double()
    buf = None
    for k in range(3):
        locals_ = [_flat(out[r][k]["local"]).double() for r in range(world_size)]
        delta = sum(theta - loc for loc in locals_) / world_size
        buf = delta.clone() if buf is None else mu * buf + delta
        theta = theta - lr * (delta + mu * buf)
        assert torch.allclose(_flat(out[0][k]["after"]).double(), theta, atol=1e-5, rtol=1e-5), k
        n = theta.numel()
        assert out[0][k]["stats"]["bytes_sent"] == round(2 * (world_size - 1) * 4 * n / world_size)
        assert out[0][k]["stats"]["delta_norm"] == pytest.approx(float(delta.norm()), rel=1e-5)


@pytest.mark.parametrize("decay", [1.0, 0.5])
def test_compressed_delta_with_error_feedback_conserves_what_was_not_sent(decay, three_ranks):
    """Top-k 5 % on Δ with error feedback, plain outer SGD at lr 1 (θ_outer ← θ_outer − mean):
    per rank, memory_after + sent = Δ + β·memory_before where ``sent`` holds exactly the largest
    entries of Δ + β·memory_before (a support checked with torch.topk, not the library's
    selection); the applied mean is the average of what the ranks sent. β = 1: plain error
    feedback; β = 0.5: SparseLoCo's decayed memory (``diloco_error_decay``)."""
    world_size = 3
    out = three_ranks["topk", decay]
    for k in range(3):
        sents = []
        for r in range(world_size):
            rec = out[r][k]
            delta = _flat(rec["outer_before"]) - _flat(rec["local"])
            carried = delta + (decay * rec["memory_before"] if rec["memory_before"] is not None else 0)
            sent = carried - rec["memory_after"]
            nz = sent.nonzero().reshape(-1)
            expect = torch.topk(carried.abs(), nz.numel()).indices
            assert set(nz.tolist()) == set(expect.tolist()), (k, r)
            assert nz.numel() == pytest.approx(0.05 * carried.numel(), abs=len(SHAPES) + 1)
            assert torch.allclose(sent[nz], carried[nz])  # what is sent is sent exactly
            sents.append(sent)
        mean = sum(sents) / world_size
        applied = _flat(out[0][k]["outer_before"]) - _flat(out[0][k]["after"])
        assert torch.allclose(applied, mean, atol=1e-6), k
        for r in range(1, world_size):
            assert torch.equal(_flat(out[r][k]["after"]), _flat(out[0][k]["after"]))


def test_a_non_finite_delta_on_one_rank_discards_the_round_on_every_rank(two_ranks):
    out = two_ranks["nan"]
    for r in range(2):
        assert [rec["stats"]["discarded"] for rec in out[r]] == [False, True, False]
        # the discarded round: every rank is back at θ_outer of before the round
        assert torch.equal(_flat(out[r][1]["after"]), _flat(out[r][1]["outer_before"]))
        assert torch.isfinite(_flat(out[r][2]["after"])).all()
    assert torch.equal(_flat(out[0][2]["after"]), _flat(out[1][2]["after"]))


def _short_payload(rank, world_size):
    """Top-k Δ whose payload on rank ``odd`` is one element short at the second outer step, for each
    ``odd`` in turn: what every rank raises, and whether θ_outer and the error memory moved."""
    from lightning_gc.compressors import build_compressor
    from lightning_gc.compressors.base import Compressed

    out = {}
    for odd in range(world_size):
        params = [t.clone() for t in _theta0()]
        compressor = build_compressor("topk", ratio=0.05)
        compress = compressor.compress
        sync = DiLoCoSync(_Traffic(params, rank, world_size), DiLoCoConfig(inner_steps=1), compressor,
                          error_feedback=True)

        def short(x, ctx, _compress=compress, _odd=odd, _sync=sync):
            c = _compress(x, ctx)
            if rank == _odd and _sync.outer_steps == 1:
                return Compressed(tuple(t[:-1] for t in c.payload), c.meta)
            return c

        compressor.compress = short
        try:
            for k in range(3):
                with torch.no_grad():
                    for p, d in zip(params, _local_move(rank, k)):
                        p.add_(d)
                outer = _flat(sync.theta_outer).clone()
                memory = sync.memory.clone() if sync.memory is not None else None
                sync.outer_step()
            out[odd] = "no error"
        except RuntimeError as e:
            kept = torch.equal(_flat(sync.theta_outer), outer) and torch.equal(sync.memory, memory)
            out[odd] = f"{e!r} {e.__cause__!r} [outer and memory kept: {kept}]"
        finally:
            sync.close()
    return out


def test_a_payload_of_the_wrong_size_stops_every_rank_without_a_hang(three_ranks):
    """A compressor bug on one rank (each rank in turn): zeros travel in its place, so no rank waits
    in the collective, and every rank raises at the outer step with the count of such ranks; θ_outer
    and the error memory are left as they were."""
    ws = 3
    out = three_ranks["short"]
    for odd in range(ws):
        for rank in range(ws):
            msg = out[rank][odd]
            assert f"1 of {ws} ranks produced a compressed pseudo-gradient of another size" in msg, (odd, rank, msg)
            here = "this rank's: payload of" if rank == odd else "not this rank's"
            assert here in msg, (odd, rank, msg)
            assert "[outer and memory kept: True]" in msg, (odd, rank, msg)


def test_dense_delta_counts_ring_bytes_and_memory_stays_empty(two_ranks):
    out = two_ranks["published"]
    n = sum(math.prod(s) for s in SHAPES)
    assert out[0][0]["stats"]["bytes_sent"] == 4 * n  # ring allreduce at N = 2: 2·(N−1)/N · 4n
    assert out[0][0]["memory_after"] is None


# --------------------------------------------------------------------------- configuration


@pytest.mark.parametrize("kw, match", [
    (dict(compressor="topk", diloco_error_decay=0.0), r"diloco_error_decay=0\.0 must be a number in \(0, 1\]"),
    (dict(compressor="topk", diloco_error_decay=1.5), r"diloco_error_decay=1\.5 must be"),
    (dict(compressor="dense", diloco_error_decay=0.9), r"error memory of a compressed pseudo-gradient, and there is none"),
    (dict(compressor="topk", error_feedback=False, diloco_error_decay=0.9), r"error_feedback=False"),
])
def test_bad_error_decay_is_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        GCStrategy(sync="diloco", **kw)


def test_diloco_options_are_refused_without_diloco():
    with pytest.raises(ValueError, match=r"diloco_inner_steps=10 only applies with sync='diloco'"):
        GCConfig.from_flat(diloco_inner_steps=10)


@pytest.mark.parametrize("value", [0, -1, 2.5, True])
def test_bad_inner_steps_are_refused(value):
    with pytest.raises(ValueError, match=r"diloco_inner_steps=.* must be an integer ≥ 1"):
        GCStrategy(sync="diloco", diloco_inner_steps=value)


def test_unknown_outer_optimizer_names_the_closest():
    with pytest.raises(ValueError, match=r"'Adamw' is not a torch.optim optimizer. Did you mean 'AdamW'"):
        GCStrategy(sync="diloco", diloco_outer_optimizer="Adamw")


def test_bad_outer_arguments_are_refused_at_construction():
    with pytest.raises(ValueError, match=r"cannot be built"):
        GCStrategy(sync="diloco", diloco_outer_args={"lr": 0.7, "nesterov": True})  # Nesterov needs momentum


def test_published_outer_optimizer_is_the_default():
    cfg = GCStrategy(sync="diloco").config.diloco
    assert cfg.resolved_args() == {"lr": 0.7, "momentum": 0.9, "nesterov": True}
    assert DiLoCoConfig(outer_optimizer="AdamW").resolved_args() == {}


def test_diloco_with_omgs_is_refused():
    with pytest.raises(ValueError, match=r"sync='diloco' with plan='omgs'"):
        GCStrategy(sync="diloco", plan="omgs")


def test_diloco_with_the_adaptive_controller_is_refused():
    from lightning_gc.adaptive.callback import AdaptiveRatio
    from lightning_gc.strategy import check_trainer_setup

    with pytest.raises(ValueError, match=r"sync='diloco'\) with the AdaptiveRatio callback"):
        check_trainer_setup(GCStrategy(sync="diloco").config, [AdaptiveRatio()])


def test_aliases_pick_the_delta_compressor():
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_gc  # noqa: F401 - registers the aliases

    assert StrategyRegistry["gc_diloco"]["init_params"] == {"compressor": "dense", "sync": "diloco"}
    assert StrategyRegistry["gc_topk_diloco"]["init_params"] == {"compressor": "topk", "sync": "diloco"}


def test_flat_round_trip_keeps_the_diloco_section():
    cfg = GCConfig.from_flat(sync="diloco", diloco_inner_steps=10, diloco_outer_optimizer="AdamW",
                             diloco_outer_args={"lr": 0.1})
    assert GCConfig.from_flat(**cfg.to_flat()) == cfg


# --------------------------------------------------------------------------- Streaming DiLoCo


def _run_streaming(rank, world_size, steps, h, f, tau, alpha):
    params = [t.clone() for t in _theta0()]
    engine = _Traffic(params, rank, world_size)
    sync = DiLoCoSync(engine, DiLoCoConfig(inner_steps=h, outer_args={"lr": 1.0}, fragments=f, overlap_steps=tau,
                                           mixing=alpha))
    record = {"fragments": sync.fragments, "after": [], "outer": []}
    for t in range(1, steps + 1):
        with torch.no_grad():
            for p, d in zip(params, _local_move(rank, t)):
                p.add_(0.1 * d)
        sync.after_optimizer_step()
        record["after"].append([p.clone() for p in params])
        record["outer"].append([o.clone() for o in sync.theta_outer])
    sync.finish()
    record["final"] = [p.clone() for p in params]
    record["stats"] = vars(sync.last_stats).copy()
    sync.close()
    return record


def test_streaming_fragments_overlap_and_mixing_equal_a_hand_written_reference():
    """F = 2, H = 4, τ = 1, α = 0.25 (asymmetric: a swapped α shows), outer SGD lr 1, 3 ranks, 8 inner steps: fragment 0 (the
    1200-element tensor) is sent at steps 2 and 6 and applied at 3 and 7, fragment 1 (the other
    two) sent at 4 and 8 and applied at 5 (and at the end of fit). Reference in float64: at an
    apply, θ_outer,p −= mean_r(θ_outer,p − θ_local,r,p at the send) and θ_local,p ← α θ_local,p +
    (1 − α) θ_outer,p; the end of fit applies what is pending, then closes every fragment with α = 0."""
    world_size, steps, h, f, tau, alpha = 3, 8, 4, 2, 1, 0.25
    out = run_distributed(_run_streaming, world_size, steps, h, f, tau, alpha)
    frags = [[0], [1, 2]]
    assert out[0]["fragments"] == frags
    theta = [t.double() for t in _theta0()]
    local = [[t.double().clone() for t in _theta0()] for _ in range(world_size)]
    sends = {2: 0, 6: 0, 4: 1, 8: 1}  # inner step -> fragment sent after it
    pending: dict[int, tuple[int, list]] = {}  # fragment -> (step sent, every rank's Δ)

    def apply(p, a):
        _, deltas = pending.pop(p)
        for j, i in enumerate(frags[p]):
            theta[i] = theta[i] - sum(d[j] for d in deltas) / world_size
            for r in range(world_size):
                local[r][i] = a * local[r][i] + (1 - a) * theta[i]

    def send(p, t):
        pending[p] = (t, [[theta[i] - local[r][i] for i in frags[p]] for r in range(world_size)])

    for t in range(1, steps + 1):
        for r in range(world_size):
            for i, d in enumerate(_local_move(r, t)):
                local[r][i] = local[r][i] + 0.1 * d.double()
        for p in sorted(pending):
            if pending[p][0] + tau == t:
                apply(p, alpha)
        if t in sends:
            send(sends[t], t)
        for r in range(world_size):
            for i in range(len(SHAPES)):
                assert torch.allclose(out[r]["after"][t - 1][i].double(), local[r][i], atol=1e-5), (t, r, i)
        for i in range(len(SHAPES)):
            assert torch.allclose(out[0]["outer"][t - 1][i].double(), theta[i], atol=1e-5), (t, i)
    assert sorted(pending) == [1]  # fragment 1 sent at step 8, due at 9: in flight at the end
    apply(1, alpha)
    for p in range(f):
        send(p, steps)
        apply(p, 0.0)
    for r in range(world_size):
        for i in range(len(SHAPES)):
            assert torch.allclose(out[r]["final"][i].double(), theta[i], atol=1e-5), (r, i)
            assert torch.equal(out[r]["final"][i], out[0]["final"][i])


def test_fragments_are_contiguous_with_about_equal_sizes():
    from lightning_gc.sync.diloco import split_fragments

    assert split_fragments([10, 10, 10, 10], 2) == [[0, 1], [2, 3]]
    assert split_fragments([100, 1, 1, 1], 2) == [[0], [1, 2, 3]]
    assert split_fragments([1, 1, 100], 3) == [[0], [1], [2]]  # every fragment gets a tensor
    with pytest.raises(ValueError, match=r"more than the model's 2 parameter tensors"):
        split_fragments([5, 5], 3)


@pytest.mark.parametrize(("kw", "match"), [
    ({"diloco_fragments": 5, "diloco_inner_steps": 4}, r"diloco_fragments=5 must be an integer in \[1, diloco_inner_steps=4\]"),
    ({"diloco_overlap_steps": 2, "diloco_fragments": 2, "diloco_inner_steps": 4}, r"diloco_overlap_steps=2 must be .* \[0, 2\)"),
    ({"diloco_mixing": 1.5}, r"diloco_mixing=1.5 must be a number in \[0, 1\]"),
])
def test_bad_streaming_settings_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        GCStrategy(sync="diloco", **kw)
