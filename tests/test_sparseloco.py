"""SparseLoCo's pseudo-gradient (``sync="diloco", diloco_compressor="sparseloco"``): the exchange and
the error memory against a float64 reference built from all ranks' Δ with the same rounding draws,
bit-identical ranks, an exact resume and the bytes on the wire against an analytic formula in a real
Lightning run, and the refusals of bad options."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from dist_harness import run_distributed

from lightning_gc import GCStrategy
from lightning_gc.config import GCConfig
from lightning_gc.sync.diloco import DiLoCoConfig, DiLoCoSync

SHAPES = [(40, 30), (30,), (7, 50)]  # 1580 elements: 7 chunks of 256, the last one 44 long
CHUNK, DENSITY = 256, 0.05  # k = 13 per chunk
SCENARIOS = {"2bit_nearest": (2, "nearest", 1.0), "4bit_stochastic": (4, "stochastic", 0.95),
             "2bit_stochastic": (2, "stochastic", 0.95)}
STEPS = 3


class _Traffic:
    """The engine double: what DiLoCo reads (parameters, group, seed) and the bytes it reports."""

    def __init__(self, params, world_size):
        import torch.distributed as dist

        self.params = params
        self.names = [f"p{i}" for i in range(len(params))]
        self.world_size = world_size
        self.device = torch.device("cpu")
        self.process_group = dist.group.WORLD if world_size > 1 else None
        self.config = SimpleNamespace(seed=5)
        self.bytes = []

    def add_deferred_traffic(self, bytes_sent, bytes_payload, bytes_inter_node=0):
        self.bytes.append((bytes_sent, bytes_payload))


def _flat(ts):
    return torch.cat([t.reshape(-1) for t in ts])


def _theta0():
    g = torch.Generator().manual_seed(7)
    return [torch.randn(s, generator=g) for s in SHAPES]


def _local_move(rank, outer_step):
    """A rank-dependent displacement: scales and signs differ per rank, so the supports differ."""
    g = torch.Generator().manual_seed(100 * outer_step + rank)
    return [torch.randn(s, generator=g) * (0.5 + rank) * (-1) ** (rank + outer_step) for s in SHAPES]


def _run(rank, world_size, bits, rounding, decay):
    params = [t.clone() for t in _theta0()]
    engine = _Traffic(params, world_size)
    cfg = DiLoCoConfig(inner_steps=1, error_decay=decay, compressor="sparseloco",
                       compressor_args={"density": DENSITY, "chunk": CHUNK, "bits": bits, "rounding": rounding})
    sync = DiLoCoSync(engine, cfg, None)
    record = []
    for k in range(STEPS):
        before = _flat(params).clone()
        memory_before = sync.memory.clone() if sync.memory is not None else torch.zeros_like(before)
        with torch.no_grad():
            for p, d in zip(params, _local_move(rank, k)):
                p.add_(d)
        local = _flat(params).clone()
        sync.outer_step()
        record.append({"before": before, "local": local, "after": _flat(params).clone(),
                       "memory_before": memory_before, "memory_after": sync.memory.clone(),
                       "group_id": None})
    record.append({"bytes": engine.bytes, "group_id": _group_id()})
    sync.close()
    return record


def _group_id():
    from lightning_gc.sync import diloco

    return diloco._DILOCO_GROUP_ID  # the fragment-0 exchange's GroupContext.group_id


def _disagreeing_chunk(rank, world_size):
    """Rank 2 is configured with another chunk: its payload has another size."""
    params = [t.clone() for t in _theta0()]
    cfg = DiLoCoConfig(inner_steps=1, compressor="sparseloco",
                       compressor_args={"density": DENSITY, "chunk": CHUNK if rank < 2 else CHUNK // 2})
    try:
        sync = DiLoCoSync(_Traffic(params, world_size), cfg, None)
    except RuntimeError as e:
        return str(e)
    sync.outer_step()
    sync.close()
    return None


def _scenarios(rank, world_size):
    return {**{name: _run(rank, world_size, *args) for name, args in SCENARIOS.items()},
            "disagree": _disagreeing_chunk(rank, world_size)}


@pytest.fixture(scope="module")
def three_ranks():
    out = run_distributed(_scenarios, 3, timeout=300)
    return {name: [o[name] for o in out] for name in out[0]}


def test_ranks_configured_differently_fail_together_without_a_hang(three_ranks):
    """A rank-dependent chunk would give payloads of another size (gloo aborts the processes):
    the setup compares the ranks' DiLoCo setups and every rank raises, naming the groups of ranks."""
    for message in three_ranks["disagree"]:
        assert message is not None and "[[0, 1], [2]]" in message and "delta=sparseloco(" in message, message


def _draws(step, rank, world_size, group_id, count):
    """The rounding draws the paper's stochastic rounding needs, replayed: u ∈ (0, 1) from the
    rank's private stream of (seed, outer step, group, rank), as documented in the codec."""
    from lightning_gc.compressors import GroupContext
    from lightning_gc.compressors.lowbit import dither_words

    ctx = GroupContext(step=step, rank=rank, world_size=world_size, segments=(), group_id=group_id, seed=5)
    r = dither_words(count, ctx.private_generator(salt=1), torch.device("cpu"))
    return (r.double() + 0.5) / 2 ** 15


def _reference_sent(x, bits, rounding, u):
    """Float64 SparseLoCo codec written from the paper's description: per chunk of CHUNK elements
    the k largest magnitudes (a stable descending sort, not torch.topk), a scale max|v|/M, levels
    q ∈ {1..M} by round-to-nearest or floor(|v|/s + u), decoded sign·q·s."""
    n = x.numel()
    k = math.ceil(DENSITY * CHUNK)
    m = 2 ** (bits - 1)
    chunks = -(-n // CHUNK)
    padded = torch.zeros(chunks * CHUNK, dtype=torch.float64)
    padded[:n] = x
    out = torch.zeros_like(padded)
    for c in range(chunks):
        v = padded[c * CHUNK:(c + 1) * CHUNK]
        keep = torch.argsort(v.abs(), descending=True, stable=True)[:k].sort().values
        s = v[keep].abs().max() / m
        ratio = v[keep].abs() / s
        q = torch.floor(ratio + u[c * k:(c + 1) * k]) if rounding == "stochastic" else torch.round(ratio)
        out[c * CHUNK + keep] = torch.sign(v[keep]) * q.clamp(1, m) * s
    return out[:n]


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_exchange_and_error_memory_equal_a_float64_reference_of_all_ranks(name, three_ranks):
    """3 ranks, 3 outer steps, plain outer SGD at lr 1 (SparseLoCo's default): with the memory of
    the reference's own recursion (e_r ← β·e_r + Δ_r − sent_r, per rank), the applied mean equals
    Σ_r sent_r / N, each rank's memory equals the reference's, and (conservation) the library's new
    memory plus the reference's sent equals its old memory·β plus Δ. Ranks end every step bit-identical."""
    bits, rounding, decay = SCENARIOS[name]
    out = three_ranks[name]
    n, world = sum(math.prod(s) for s in SHAPES), 3
    k = math.ceil(DENSITY * CHUNK)
    group_id = out[0][-1]["group_id"]
    memory = [torch.zeros(n, dtype=torch.float64) for _ in range(world)]
    for step in range(STEPS):
        sents = []
        for r in range(world):
            rec = out[r][step]
            delta = (rec["before"] - rec["local"]).double()
            carried = decay * memory[r] + delta
            sent = _reference_sent(carried, bits, rounding, _draws(step, r, world, group_id, 7 * k))
            assert (sent != 0).sum() == 7 * k
            memory[r] = carried - sent
            scale = float(carried.abs().max())
            assert torch.allclose(rec["memory_after"].double(), memory[r], atol=1e-5 * scale, rtol=0), (step, r)
            old = decay * rec["memory_before"].double() + delta  # conservation on the library's own memory
            assert torch.allclose(rec["memory_after"].double() + sent, old, atol=1e-5 * scale, rtol=0), (step, r)
            sents.append(sent)
        mean = sum(sents) / world
        applied = (out[0][step]["before"] - out[0][step]["after"]).double()
        assert torch.allclose(applied, mean, atol=1e-5 * float(mean.abs().max()), rtol=0), step
        for r in range(1, world):
            assert torch.equal(out[r][step]["after"], out[0][step]["after"]), (step, r)


def _payload_bytes(n, density, chunk, bits):
    """One rank's allgathered buffer, from the wire format's description: per chunk one fp32 scale,
    k codes of ``bits`` bits packed, k 16-bit offsets; each of the three parts padded to 8 bytes."""
    chunks = -(-n // chunk)
    kept = chunks * math.ceil(density * chunk)
    parts = [4 * chunks, -(-kept * bits // 8), 2 * kept]
    return sum(-(-p // 8) * 8 for p in parts)


def test_each_outer_step_sends_the_allgather_of_the_analytic_payload(three_ranks):
    """A 3-rank allgather: every rank sends its payload to 2 others."""
    n = sum(math.prod(s) for s in SHAPES)
    for name, (bits, _, _) in SCENARIOS.items():
        for r in range(3):
            sent = [b for b, _ in three_ranks[name][r][-1]["bytes"]]
            assert sent == [2 * _payload_bytes(n, DENSITY, CHUNK, bits)] * STEPS, (name, r)


# ----------------------------------------------------------------------------- a real Lightning run
H, EPOCHS = 10, 6  # 4 optimizer steps per epoch on each of 2 ranks: outer steps at 10, 20, and 24 (end of fit)


def _strategy():
    return GCStrategy(sync="diloco", diloco_compressor="sparseloco", diloco_inner_steps=H, diloco_error_decay=0.95,
                      diloco_compressor_args={"density": 0.02, "chunk": 1024, "bits": 2, "rounding": "stochastic"},
                      start_method="forkserver")


@pytest.mark.slow
def test_lightning_run_is_identical_across_ranks_resumes_exactly_and_sends_100x_fewer_bytes(tmp_path):
    """TinyClassifier (2020 parameters) on 2 ranks with rank-dependent batches, inner SGD with
    momentum, H = 10, stochastic 2-bit values. The ranks end bit-identical; a resume from the
    checkpoint after epoch 0 (step 4, inside the first round: θ_local, inner momentum and error memory
    per rank) ends bit-identical to the uninterrupted run (same rounding draws); the bytes counted are
    3 allgathers of the analytic payload, and ≥ 100× below DDP's fp32 ring allreduce over 24 steps."""
    import lightning as L
    from diloco_lit import fit
    from lit_models import TinyClassifier

    ckpt_cb = L.pytorch.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_top_k=-1, every_n_epochs=1)
    full = fit(tmp_path / "a", _strategy(), model=TinyClassifier(momentum=0.9), callbacks=[ckpt_cb],
               enable_checkpointing=True, max_epochs=EPOCHS)
    ckpt_file = sorted((tmp_path / "ckpt").glob("epoch=0*.ckpt"))[0]
    ranks = torch.load(ckpt_file, weights_only=False)["lightning_gc"]["ranks"]
    assert ranks[0]["diloco"]["theta_local"] is not None and not ranks[0]["diloco"]["memories"]  # no outer step yet
    second = sorted((tmp_path / "ckpt").glob("epoch=3*.ckpt"))[0]  # step 16: one outer step taken, memory kept
    ranks = torch.load(second, weights_only=False)["lightning_gc"]["ranks"]
    mem = [ranks[r]["diloco"]["memories"][0] for r in range(2)]
    assert mem[0].abs().sum() > 0 and not torch.equal(mem[0], mem[1])  # per rank, not averaged
    resumed = fit(tmp_path / "b", _strategy(), model=TinyClassifier(momentum=0.9), ckpt_path=str(second),
                  max_epochs=EPOCHS)
    n = 16 * 96 + 96 + 96 * 4 + 4
    ddp = 24 * 4 * n  # a ring allreduce of 4n bytes at N = 2, every step
    for r in range(2):
        assert full[r]["global_step"] == 24 and full[r]["outer_steps"] == 3
        for key, v in full[r]["params"].items():
            assert torch.equal(v, full[0]["params"][key]), (r, key)
            assert torch.equal(v, resumed[r]["params"][key]), f"rank {r} {key} differs after resume"
        sent = full[r]["totals"]["bytes_sent"]
        assert sent == 3 * _payload_bytes(n, 0.02, 1024, 2)  # (N − 1) = 1 copy per outer step
        assert ddp / sent >= 100, ddp / sent


# ----------------------------------------------------------------------------- refusals
def _flat_config(**kw):
    return GCConfig.from_flat(**{"sync": "diloco", "diloco_compressor": "sparseloco", **kw})


@pytest.mark.parametrize("kw, match", [
    ({"diloco_compressor_args": {"density": 0.0}}, r"density=0\.0 is invalid.*\(0, 1\]"),
    ({"diloco_compressor_args": {"density": 1.5}}, r"density=1\.5 is invalid"),
    ({"diloco_compressor_args": {"chunk": 70000}}, r"chunk=70000 is invalid.*16 bits.*chunk=4096"),
    ({"diloco_compressor_args": {"chunk": 1}}, r"chunk=1 is invalid"),
    ({"diloco_compressor_args": {"bits": 3}}, r"bits=3 is invalid.*bits=2 or bits=4"),
    ({"diloco_compressor_args": {"rounding": "up"}}, r"rounding='up' is invalid.*'nearest'"),
    ({"diloco_compressor_args": {"ratio": 0.01}}, r"\['ratio'\] are not options.*density"),
    ({"diloco_compressor_args": [1, 2]}, r"must be a dict"),
    ({"diloco_compressor": "topk"}, r"diloco_compressor='topk' is not a DiLoCo.*\['sparseloco'\]"),
    ({"diloco_compressor": None, "diloco_compressor_args": {"bits": 4}}, r"needs diloco_compressor"),
    ({"compressor": "qsgd"}, r"compressor='qsgd' would name a second compressor of Δ"),
    ({"ratio": 0.03}, r"ratio=0\.03 would name a second compressor"),
    ({"error_feedback": False}, r"error_feedback=False.*part of the method"),
])
def test_bad_options_are_refused_with_value_reason_and_fix(kw, match):
    with pytest.raises(ValueError, match=match):
        _flat_config(**kw)


def test_sparseloco_without_diloco_is_refused():
    with pytest.raises(ValueError, match=r"diloco_compressor='sparseloco'.*only applies with sync='diloco'"):
        GCStrategy(diloco_compressor="sparseloco")


def test_defaults_replace_the_outer_momentum_and_round_trip():
    """Without diloco_outer_args the outer optimizer is plain SGD at lr 1 (the error memory stands in
    for the momentum); given ones are kept; the flat names round-trip."""
    cfg = _flat_config(diloco_compressor_args={"bits": 4})
    assert cfg.diloco.resolved_args() == {"lr": 1.0}
    assert _flat_config(diloco_outer_args={"lr": 0.7, "momentum": 0.9}).diloco.resolved_args()["momentum"] == 0.9
    assert GCConfig.from_flat(**cfg.to_flat()) == cfg
    assert GCStrategy(sync="diloco", compressor="dense", diloco_compressor="sparseloco").compressor_name == "sparseloco"


def test_bench_spells_sparseloco_options_one_by_one():
    """``lightning-gc bench --methods``: diloco_sparseloco_KEY=VALUE fill diloco_compressor_args, and
    diloco_outer_KEY=VALUE change SparseLoCo's outer default (lr 1), not the published one."""
    from lightning_gc.bench.methods import build_strategy, parse_methods

    text = ("dense:sync=diloco:diloco_inner_steps=10:diloco_compressor=sparseloco:diloco_sparseloco_bits=4:"
            "diloco_sparseloco_density=0.02:diloco_error_decay=0.95:diloco_outer_momentum=0.5")
    d = build_strategy(parse_methods(text, default_ratio=None)[0]).config.diloco
    assert (d.compressor, dict(d.compressor_args), d.error_decay) == ("sparseloco", {"bits": 4, "density": 0.02}, 0.95)
    assert d.resolved_args() == {"lr": 1.0, "momentum": 0.5}
    bad = "dense:sync=diloco:diloco_compressor=sparseloco:diloco_sparseloco_bits=3"
    with pytest.raises(ValueError, match=r"bits=3 is invalid"):
        build_strategy(parse_methods(bad, default_ratio=None)[0])
