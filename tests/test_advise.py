"""``lightning-gc advise`` (lightning_gc/bench/advise.py): the auto chooser's model, offline.

* the pick against a brute-force argmin written here from the documented equations (not with
  lightning_gc.auto.model), over a grid of world sizes, links and progress weights;
* the command end to end (``--json``), its refusals of bad input, and what the analysis says the
  pick must be at the two ends of the bandwidth range;
* the measurement plumbing: the engine's "model" plan, the payload cap and its extrapolation, the
  user's figures replacing the measured ones.
"""

from __future__ import annotations

import itertools
import json
import math
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_gc.auto.candidates import CANDIDATES, DEFAULT_CANDIDATES
from lightning_gc.auto.model import MethodCost, Workload
from lightning_gc.bench import advise as adv
from lightning_gc.bench.workloads import WorkloadError, resolve_preset
from lightning_gc.cli import main as cli_main
from lightning_gc.comm.cost_model import NetworkModel
from lightning_gc.compressors import GroupContext

MiB = 1024 * 1024


# ---------------------------------------------------------------- 1. the oracle
def _ring(alpha: float, beta: float, nbytes: float, n: int) -> float:
    return 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes * beta


def _direct(alpha: float, beta: float, nbytes: float, n: int) -> float:
    # every rank sends its message to the n - 1 others at once: one latency, n - 1 copies on its link
    return alpha + (n - 1) * nbytes * beta


def _allreduce(alpha: float, beta: float, nbytes: float, n: int) -> float:
    """The engine's allreduce (docs/cost_model.md, "Direct exchange"): direct on 2-8 ranks when the
    n - 1 copies are at most 12 KiB or the model prices direct below the ring."""
    d, r = _direct(alpha, beta, nbytes, n), _ring(alpha, beta, nbytes, n)
    return d if 2 <= n <= 8 and ((n - 1) * nbytes <= 12 * 1024 or d < r) else r


def _log2_rounds(n: int) -> int:
    return math.ceil(math.log2(n)) if n > 1 else 0


def _oracle_step(cost: MethodCost, w: Workload, alpha: float, beta: float, n: int) -> float:
    """Hand-written step time (docs/auto.md, docs/cost_model.md): bucket modes on DDP's bucket
    timeline (the engine's steady dense path adds no message); engine methods after backward, with
    the closing report (13 float64 fields; riding in lowrank's Q message) and the exact tensors'
    allreduce."""
    bwd = sum(w.backward_s)
    base = w.forward_s + w.optimizer_s + w.other_s
    if n == 1:
        return base + bwd
    if cost.wire == "bucket":
        bytes_per_elem = {"ddp": 4, "fp16": 2, "bf16": 2}[cost.name]
        total = sum(w.numels)
        # DDP's buckets in ready order: the first closes at 1 MiB of fp32, later ones at 25 MiB
        buckets, cur, size, cap = [], [], 0, 1 * MiB
        for k, numel in enumerate(w.numels):
            cur.append(k)
            size += 4 * numel
            if size >= cap:
                buckets.append(cur)
                cur, size, cap = [], 0, 25 * MiB
        if cur:
            buckets.append(cur)
        end = 0.0
        for b in buckets:
            ready = sum(w.backward_s[: b[-1] + 1])  # the bucket's last tensor is ready
            elems = sum(w.numels[k] for k in b)
            cast = cost.codec_s * elems / total
            end = max(ready, end) + cast + _ring(alpha, beta, bytes_per_elem * elems, n)
        return base + max(bwd, end)
    B = cost.payload_bytes
    lg = _log2_rounds(n)
    if cost.wire == "allreduce":
        comm = _allreduce(alpha, beta, B, n)
    elif cost.wire == "allgather":  # direct on up to 8 ranks, else the ring allgather
        comm = _direct(alpha, beta, B, n) if n <= 8 else alpha * lg + (n - 1) * B * beta
    elif cost.wire == "lowrank":  # P (with the exact small tensors: they ride in it), then Q (with the report)
        comm = _allreduce(alpha, beta, B / 2 + cost.exact_bytes, n) + _allreduce(alpha, beta, B / 2 + 160, n)
    else:  # sparse: the cheapest of allgather, ART-Ring (4a), ART-Tree (4b); M = 4 * numel
        M = 4.0 * sum(w.numels)
        idx = M * cost.sparse_ratio
        val = idx * cost.value_bytes / 4
        comm = min(alpha * lg + (idx + val) * beta * (n - 1),
                   alpha * (2 * (n - 1) + lg) + beta * (idx * lg + val * 2 * (n - 1) / n),
                   3 * alpha * lg + beta * lg * (idx + 2 * val))
    # the closing report: 104 bytes alone; lowrank's rides in its Q message (above)
    control = 0.0 if cost.wire == "lowrank" else _allreduce(alpha, beta, 104, n)
    exact = _allreduce(alpha, beta, cost.exact_bytes, n) if cost.exact_bytes > 0 and cost.wire != "lowrank" else 0.0
    return base + bwd + cost.codec_s + comm + control + exact


def _oracle_pick(costs, w, alpha, beta, n, weight) -> tuple[str, dict[str, float]]:
    steps = {c.name: _oracle_step(c, w, alpha, beta, n) for c in costs}
    per_progress = {}
    for c in costs:
        d2 = c.delta2 if c.error_feedback else c.delta2 / n
        per_progress[c.name] = steps[c.name] * (1 + weight * d2)  # step / efficiency
    best = costs[0].name
    for c in costs[1:]:  # strict: an exact tie stays with the earlier candidate
        if per_progress[c.name] < per_progress[best]:
            best = c.name
    return best, steps


# ready order: a small head, then big matrices; the first bucket closes after 300k elements (1.2 MB)
ORACLE_WORKLOAD = Workload(
    forward_s=0.004,
    backward_s=(0.0005, 0.002, 0.0001, 0.006, 0.009, 0.0002, 0.004),
    numels=(5_000, 300_000, 512, 2_000_000, 6_000_000, 1_000, 1_200_000),
    optimizer_s=0.002,
    other_s=0.001,
)
_NUMEL = sum(ORACLE_WORKLOAD.numels)
_EXACT = 4.0 * (512 + 1_000)
ORACLE_COSTS = [
    MethodCost("ddp", "bucket", 0.0),
    MethodCost("fp16", "bucket", 0.003, delta2=1e-7),
    MethodCost("bf16", "bucket", 0.002, delta2=1e-5),
    MethodCost("lowrank", "lowrank", 0.012, payload_bytes=180_000.0, delta2=0.45, error_feedback=True,
               exact_bytes=_EXACT),
    MethodCost("topk", "allgather", 0.006, payload_bytes=8.0 * 0.01 * _NUMEL, delta2=0.8, error_feedback=True,
               sparse_ratio=0.01, exact_bytes=_EXACT),
    # exact_bytes 0: the model's sparse M counts every tensor of the workload (see the report on #auto)
    MethodCost("artopk", "sparse", 0.007, payload_bytes=8.0 * 0.01 * _NUMEL, delta2=0.8, error_feedback=True,
               sparse_ratio=0.01, value_bytes=4.0),
    MethodCost("qsgd", "allgather", 0.02, payload_bytes=0.6 * _NUMEL, delta2=1.6, error_feedback=False,
               exact_bytes=_EXACT),
    MethodCost("efsign", "allgather", 0.009, payload_bytes=_NUMEL / 8 + 64, delta2=0.35, error_feedback=True,
               exact_bytes=_EXACT),
]


@pytest.mark.parametrize("n", [1, 2, 4, 8, 64, 1024])
def test_pick_equals_a_brute_force_argmin_of_the_documented_equations(n):
    picks = set()
    for bps, alpha, weight in itertools.product((1e6, 1e8, 1e9, 1e10, 1e12), (0.0, 2e-5, 1e-3), (0.0, 1.0, 4.0)):
        net = NetworkModel.from_bandwidth(bps, alpha)
        pick, preds = adv.advise(ORACLE_WORKLOAD, ORACLE_COSTS, net, n, weight)
        want, steps = _oracle_pick(ORACLE_COSTS, ORACLE_WORKLOAD, alpha, 8.0 / bps, n, weight)
        assert pick == want, (n, bps, alpha, weight, {k: p.time_per_progress_s for k, p in preds.items()})
        for name, step in steps.items():
            assert preds[name].step_s == pytest.approx(step, rel=1e-9, abs=1e-12), (name, n, bps, alpha)
        picks.add(pick)
    if n >= 4:  # the grid is not degenerate: the links move the pick
        assert len(picks) >= 2, picks


def test_oracle_bucket_timeline_has_several_buckets_and_overlap():
    """The pinned workload exercises what the bucket timeline is about: three buckets, the first
    one closed at 1 MiB, and a link where the last allreduce, not backward, ends the step."""
    alpha, beta, n = 0.0, 8.0 / 1e10, 8
    ddp = ORACLE_COSTS[0]
    step = _oracle_step(ddp, ORACLE_WORKLOAD, alpha, beta, n)
    compute = ORACLE_WORKLOAD.forward_s + sum(ORACLE_WORKLOAD.backward_s) + ORACLE_WORKLOAD.optimizer_s
    pred = adv.advise(ORACLE_WORKLOAD, [ddp], NetworkModel(alpha, beta), n)[1]["ddp"]
    assert pred.details["buckets"] == 3
    assert step > compute + ORACLE_WORKLOAD.other_s and pred.step_s == pytest.approx(step)


# ---------------------------------------------------------------- 2. the command end to end
#: a few batches are all a profile needs (the presets' full data sets take seconds to generate)
SMALL_DATA = ["--preset-arg", "num_train=512", "--preset-arg", "num_val=128"]


def test_cli_json_end_to_end(capsys):
    rc = cli_main(["advise", "--preset", "quickstart", *SMALL_DATA, "--ranks", "64", "--bandwidth", "1gbit",
                   "--latency", "50us", "--json", "--repeats", "1", "--profile-steps", "2"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    doc = json.loads(out.out)
    assert doc["schema"] == adv.SCHEMA
    assert doc["pick"] in DEFAULT_CANDIDATES
    assert list(doc["predictions"]) == list(DEFAULT_CANDIDATES)
    for name, p in doc["predictions"].items():
        assert p["name"] == name and p["step_s"] > 0 and 0 < p["efficiency"] <= 1
        assert p["time_per_progress_s"] >= p["step_s"]
    best = min(p["time_per_progress_s"] for p in doc["predictions"].values())
    assert doc["predictions"][doc["pick"]]["time_per_progress_s"] == best
    assert doc["world_size"] == 64 and doc["network"]["alpha_s"] == pytest.approx(5e-5)
    assert doc["network"]["bandwidth_bits_per_s"] == pytest.approx(1e9)
    inputs = doc["inputs"]
    assert inputs["timing_payloads"] == 8 and "extrapolated" in inputs["codec_timing"]
    assert inputs["profile"]["timed_steps"] == 2 and inputs["profile"]["exact_tensors"] == 3  # the biases
    assert sum(doc["workload"]["numels"]) == inputs["profile"]["numel"]


def test_cli_text_names_the_pick_and_the_figures_given(capsys):
    rc = cli_main(["advise", "--preset", "quickstart", *SMALL_DATA, "--ranks", "4", "--bandwidth", "100mbit",
                   "--candidates", "ddp,topk", "--repeats", "1", "--profile-steps", "1", "--skip-steps", "0",
                   "--forward-ms", "2", "--backward-ms", "6", "--optimizer-ms", "1"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    text = out.out
    assert "pick: " in text and "ms/progress" in text
    assert "forward 2.00 ms (given)" in text and "backward 6.00 ms (given)" in text
    assert "optimizer 1.00 ms (given)" in text
    rows = [ln for ln in text.splitlines() if ln[:1] in ("*", " ") and ln[1:].split()[:1] in (["ddp"], ["topk"])]
    assert len(rows) == 2 and sum(r.startswith("*") for r in rows) == 1


def test_diloco_rows_amortise_the_fp16_delta_over_h(capsys):
    rc = cli_main(["advise", "--model-params", "10M", "--compute-ms", "100", "--ranks", "4", "--bandwidth", "20mbit",
                   "--latency", "1ms", "--candidates", "ddp,fp16", "--repeats", "1", "--diloco", "10,50", "--json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    doc = json.loads(out.out)
    w = doc["workload"]
    compute = w["forward_s"] + sum(w["backward_s"]) + w["optimizer_s"] + w["other_s"]
    n, alpha, beta, m = 4, 1e-3, 8 / 20e6, 2 * sum(w["numels"])  # fp16 Δ: 2 bytes an element, a ring allreduce
    ring, flag = 2 * (n - 1) * alpha + 2 * (n - 1) / n * m * beta, 2 * (n - 1) * alpha
    assert [d["inner_steps"] for d in doc["diloco"]] == [10, 50]
    for d in doc["diloco"]:
        assert d["step_s"] == pytest.approx(compute + (ring + flag) / d["inner_steps"], rel=1e-6)
        assert d["bytes_per_step"] == pytest.approx(2 * (n - 1) / n * m / d["inner_steps"], rel=1e-6)
    rc = cli_main(["advise", "--model-params", "10M", "--compute-ms", "100", "--ranks", "4", "--bandwidth", "20mbit",
                   "--candidates", "ddp,fp16", "--repeats", "1", "--diloco", "10"])
    text = capsys.readouterr().out
    assert rc == 0 and "DiLoCo (sync='diloco'" in text and "H=10" in text and "the pick's" in text


# ---------------------------------------------------------------- 3. bad input
@pytest.mark.parametrize("argv, needle", [
    (["--ranks", "0"], "--ranks 0"),
    (["--ranks", "2048"], "--ranks 2048"),
    (["--ranks", "many"], "'many'"),
    (["--world-size", "0"], "--ranks 0"),  # the alias, checked the same way
    (["--bandwidth", "10mbps"], "'10mbps'"),
    (["--bandwidth", "fast"], "'fast'"),
    (["--latency", "5parsec"], "'5parsec'"),
    (["--candidates", "ddp,nope"], "'nope'"),
    (["--candidates", "ddp,ddp"], "twice"),
    (["--preset", "nope"], "'nope'"),
    (["--preset", "no_such_module_xyz:factory"], "no_such_module_xyz"),
    (["--progress-weight", "-1"], "--progress-weight -1"),
    (["--codec-scale", "0"], "--codec-scale 0"),
    (["--backward-ms", "-3"], "--backward-ms -3"),
    (["--preset-arg", "nonsense_arg=3"], "nonsense_arg"),
    (["--diloco", "0"], "--diloco"),
])
def test_bad_input_is_refused_naming_the_value(capsys, argv, needle):
    base = {"--preset": "quickstart", "--ranks": "8", "--bandwidth": "1gbit"}
    args = list(argv)
    for k, v in base.items():
        if k not in args and not (k == "--ranks" and "--world-size" in args):
            args += [k, v]
    assert cli_main(["advise", *args]) == 2
    err = capsys.readouterr().err
    assert needle in err, err


def test_parsers():
    assert adv.parse_bandwidth("100mbit") == 1e8 and adv.parse_bandwidth("2.5Gbit/s") == 2.5e9
    assert adv.parse_bandwidth("2tbit") == 2e12  # above the bench's shaping limit: fine for a model
    assert adv.parse_latency("0.5ms") == pytest.approx(5e-4) and adv.parse_latency("50us") == pytest.approx(5e-5)
    assert adv.parse_latency("0") == 0.0 and adv.parse_latency("2s") == 2.0
    assert adv.parse_candidates("ddp, fp16,topk") == ("ddp", "fp16", "topk")
    with pytest.raises(adv.AdviseError, match="'5'"):
        adv.parse_latency("5")
    with pytest.raises(adv.AdviseError, match="byte unit"):
        adv.parse_bandwidth("100MB")
    with pytest.raises(adv.AdviseError, match="ranks 1025"):
        adv.advise(ORACLE_WORKLOAD, ORACLE_COSTS, NetworkModel(0, 0), 1025)


# ---------------------------------------------------------------- 4. the two ends of the bandwidth range
@pytest.fixture(scope="module")
def mlp_profile():
    model, data, _ = adv.build_module("mlp", {"num_train": 512, "num_val": 128})  # 1.09M parameters
    prof = adv.profile_module(model, data, skip_steps=1, profile_steps=2)
    costs = adv.measure_costs(DEFAULT_CANDIDATES, prof.flat, prof.ctx, 4, prof.exact_bytes, repeats=1, rounds=1)
    return prof, costs


def test_slow_link_picks_a_compressor_fast_link_picks_a_dense_mode(mlp_profile):
    prof, costs = mlp_profile
    assert 1_000_000 < prof.workload.numel < 1_200_000
    # 1 Mbit/s: DDP's ring moves 1.5 x 4.4 MB = 52 s per step; every compressor sends far less
    pick, preds = adv.advise(prof.workload, costs, NetworkModel.from_bandwidth(1e6, 1e-4), 4, progress_weight=0)
    assert pick != "ddp" and preds[pick].step_s < preds["ddp"].step_s / 5, pick
    # infinite bandwidth, no latency: communication is free, so only the codec costs; nothing beats DDP
    pick, preds = adv.advise(prof.workload, costs, NetworkModel(0.0, 0.0), 4, progress_weight=0)
    assert pick in ("ddp", "fp16"), pick
    assert preds["ddp"].exposed_s == pytest.approx(0.0, abs=1e-12)
    # a huge bandwidth with a latency: DDP exposes at most its last bucket (6 alpha) after backward, every
    # engine method at least its closing report and the exact tensors' allreduce (12 alpha) plus its codec
    pick, preds = adv.advise(prof.workload, costs, NetworkModel.from_bandwidth(1e15, 1e-4), 4)
    assert pick in ("ddp", "fp16"), pick


def test_profile_follows_the_engines_model_plan(mlp_profile):
    prof, costs = mlp_profile
    w = prof.workload
    assert len(w.numels) == 8 and len(prof.names) == 8 and not prof.no_grad
    # 4 weight matrices compressed, the 4 biases (< 1024 elements) sent exactly
    assert prof.exact_bytes == 4.0 * (768 + 768 + 512 + 10)
    assert prof.flat.numel() == w.numel - (768 + 768 + 512 + 10) == sum(prof.ctx.segments)
    assert all(len(s) == 2 for s in prof.ctx.shapes)  # lowrank sees the matrices' shapes
    assert w.forward_s > 0 and w.backward_total_s > 0 and w.optimizer_s > 0 and w.other_s == 0
    # one compute time per timed step, each at least that step's forward (the medians' parts)
    assert len(prof.step_s) == prof.steps == 2 and all(t > 0 for t in prof.step_s)
    assert prof.spread == max(prof.step_s) / min(prof.step_s)
    assert [c.name for c in costs] == list(DEFAULT_CANDIDATES)
    # the exact group in fp32 beside the group, or in lowrank_bf16's bfloat16 P message
    assert all(c.exact_bytes == prof.exact_bytes / (2 if c.name == "lowrank_bf16" else 1)
               for c in costs if c.wire != "bucket")


def test_advice_text_renders_the_table(mlp_profile):
    prof, costs = mlp_profile
    net = NetworkModel.from_bandwidth(1e8, 1e-4)
    pick, preds = adv.advise(prof.workload, costs, net, 4)
    text = adv.Advice(pick, preds, prof.workload, costs, net, 4, 1.0, {"preset": "mlp"}).text()
    assert f"pick: {pick}" in text and "100mbit" in text and "N=4" in text
    assert sum(ln.startswith("*") for ln in text.splitlines()) == 1


# ---------------------------------------------------------------- the measurement's plumbing
def test_measure_costs_caps_payloads_extrapolates_allgather_and_scales(monkeypatch):
    calls = []

    def fake_measure(cand, flat, ctx, world_size, repeats, exact_bytes):
        calls.append((cand.name, world_size))
        wire = {"ddp": "bucket", "fp16": "bucket", "topk": "allgather", "lowrank": "lowrank"}[cand.name]
        return MethodCost(cand.name, wire, 0.0 if cand.name == "ddp" else 0.010, 100.0 if wire != "bucket" else 0.0,
                          0.5, cand.name != "qsgd", exact_bytes=exact_bytes)

    agg_calls = []

    def fake_aggregate(cand, flat, ctx, p, repeats):
        agg_calls.append(p)
        return 0.001 + 0.0002 * p + (0.05 if p == 4 and len(agg_calls) < 4 else 0.0)  # one disturbed timing

    monkeypatch.setattr(adv, "measure_method", fake_measure)
    monkeypatch.setattr(adv, "_aggregate_s", fake_aggregate)
    flat = torch.ones(10)
    costs = adv.measure_costs(["ddp", "fp16", "topk", "lowrank"], flat, None, 64, 12.0, repeats=1, codec_scale=0.5)
    assert {ws for _, ws in calls} == {8}  # min(N, 8) payloads
    assert sorted(set(agg_calls)) == [1, 2, 4, 8] and len(agg_calls) == 8  # two rounds, topk only
    by = {c.name: c for c in costs}
    assert by["ddp"].codec_s == 0.0 and by["fp16"].codec_s == pytest.approx(0.005)
    assert by["lowrank"].codec_s == pytest.approx(0.005)  # not allgather: no extrapolation
    assert by["topk"].codec_s == pytest.approx(0.5 * (0.010 + 0.0002 * (64 - 8)))
    assert by["topk"].exact_bytes == 12.0
    calls.clear()
    costs = adv.measure_costs(["topk"], flat, None, 3, repeats=1)
    assert {ws for _, ws in calls} == {3} and costs[0].codec_s == pytest.approx(0.010)


def test_aggregation_slope_is_robust_to_one_outlier():
    assert adv.aggregation_slope({1: 1.0, 2: 2.0, 4: 4.0, 8: 8.0}) == pytest.approx(1.0)
    assert adv.aggregation_slope({1: 1.0, 2: 2.0, 4: 40.0, 8: 8.0}) == pytest.approx(1.0)
    assert adv.aggregation_slope({1: 5.0, 8: 1.0}) == 0.0 and adv.aggregation_slope({8: 1.0}) == 0.0


def test_override_workload_scales_the_backward_profile():
    w = ORACLE_WORKLOAD
    o = adv.override_workload(w, forward_ms=10, backward_ms=2 * 1e3 * w.backward_total_s, optimizer_ms=0, other_ms=3)
    assert o.forward_s == pytest.approx(0.01) and o.optimizer_s == 0 and o.other_s == pytest.approx(0.003)
    assert o.numels == w.numels
    assert o.backward_s == pytest.approx(tuple(2 * t for t in w.backward_s))
    assert adv.override_workload(w) == w


def test_compute_scale_multiplies_the_measured_compute_and_given_figures_replace_it():
    w = ORACLE_WORKLOAD
    o = adv.override_workload(w, compute_scale=2.5)
    assert o.forward_s == pytest.approx(2.5 * w.forward_s) and o.optimizer_s == pytest.approx(2.5 * w.optimizer_s)
    assert o.backward_s == pytest.approx(tuple(2.5 * t for t in w.backward_s))
    assert o.other_s == w.other_s  # not compute: data loading and logging are the user's own figure
    g = adv.override_workload(w, forward_ms=7, compute_scale=2.5)
    assert g.forward_s == pytest.approx(0.007) and g.backward_s == pytest.approx(o.backward_s)
    with pytest.raises(adv.AdviseError, match="compute-scale"):
        adv.override_workload(w, compute_scale=0)


class _Tiny(L.LightningModule):
    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.a = torch.nn.Linear(32, hidden)
        self.unused = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(hidden, 3)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(64, 32, generator=g), torch.randint(0, 3, (64,), generator=g)),
                          batch_size=16)


def tiny_factory(seed: int = 0, hidden: int = 64) -> SimpleNamespace:
    """A ``module:factory`` with the bench's contract (docs/bench.md): an object with model, datamodule, ..."""
    return SimpleNamespace(model=_Tiny(hidden), datamodule=None, metric="val_loss", mode="min", target=None,
                           batch_size=16)


def bare_factory(seed: int = 0, hidden: int = 64) -> L.LightningModule:
    """A factory returning a bare LightningModule: not the bench's contract."""
    return _Tiny(hidden)


def test_module_factory_and_unused_parameters():
    model, data, label = adv.build_module(f"{__name__}:tiny_factory", {"hidden": 48})
    assert isinstance(model, _Tiny) and data is None and model.a.out_features == 48
    prof = adv.profile_module(model, skip_steps=0, profile_steps=1)
    assert set(prof.no_grad) == {"unused.weight", "unused.bias"}
    assert prof.flat.numel() == 32 * 48 and prof.exact_names  # b.weight (144), the biases: exact
    assert prof.workload.numel == 32 * 48 + 48 + 48 * 3 + 3
    with pytest.raises(adv.AdviseError, match="min_compress_numel"):
        adv.profile_module(_Tiny(8), skip_steps=0, profile_steps=1)


def test_advise_takes_exactly_the_bench_presets():
    """advise and the bench load --preset through one function: what one accepts the other does, and a
    factory returning a bare LightningModule is refused by both with the contract in the message."""
    bench_w = resolve_preset(f"{__name__}:tiny_factory", seed=0, hidden=40)
    model, _, _ = adv.build_module(f"{__name__}:tiny_factory", {"hidden": 40})
    assert type(model) is type(bench_w.model) and model.a.out_features == bench_w.model.a.out_features == 40
    with pytest.raises(WorkloadError, match="model, datamodule, metric, mode, target, batch_size") as bench_err:
        resolve_preset(f"{__name__}:bare_factory", seed=0)
    with pytest.raises(adv.AdviseError, match="model, datamodule, metric, mode, target, batch_size") as adv_err:
        adv.build_module(f"{__name__}:bare_factory")
    assert str(bench_err.value) in str(adv_err.value)
    with pytest.raises(adv.AdviseError, match="nonsense"):  # the factory's own TypeError, named
        adv.build_module(f"{__name__}:tiny_factory", {"nonsense": 1})


def test_ranks_is_the_main_spelling_and_world_size_an_alias():
    for flag in ("--ranks", "--world-size", "-N"):
        args = adv.build_parser().parse_args(["--preset", "mlp", flag, "64", "--bandwidth", "1gbit"])
        assert args.ranks == 64, flag
    assert "--ranks" in adv.build_parser().format_help()


# ---------------------------------------------------------------- 5. timed steps that disagree
def test_spread_warning_on_steps_that_disagree():
    """Analytic cases: compute 10, 11 and 40 ms is a 4x spread (warned, above 2x); 10, 12, 15 ms is 1.5x."""
    assert adv.compute_spread([0.010, 0.011, 0.040]) == pytest.approx(4.0)
    msg = adv.spread_warning([0.010, 0.011, 0.040])
    assert msg is not None and "4.0x > 2x" in msg and "10.0, 11.0, 40.0 ms" in msg and "--profile-steps" in msg
    assert adv.spread_warning([0.010, 0.012, 0.015]) is None
    assert adv.spread_warning([0.010, 0.020]) is None  # exactly the factor: not above it
    assert adv.spread_warning([0.010, 0.0201]) is not None
    assert adv.spread_warning([0.010]) is None and adv.compute_spread([]) == 1.0
    assert adv.spread_warning([0.0, 0.01]) is not None  # a step of 0 s: an infinite spread
    assert adv.spread_warning([0.010, 0.030], factor=4.0) is None


def _fake_profile(step_s: tuple[float, ...]) -> adv.Profile:
    flat = torch.ones(2048)
    ctx = GroupContext(step=1, rank=0, world_size=1, segments=(2048,), seed=0)
    return adv.Profile(ORACLE_WORKLOAD, flat, ctx, 0.0, ("w",), len(step_s), step_s=step_s)


@pytest.mark.parametrize("step_s, warned", [((0.010, 0.011, 0.040), True), ((0.010, 0.011, 0.012), False)])
def test_advise_reports_a_profile_whose_steps_disagree(monkeypatch, capsys, step_s, warned):
    monkeypatch.setattr(adv, "build_module", lambda preset, args, seed: (None, None, preset))
    monkeypatch.setattr(adv, "profile_module", lambda *a, **k: _fake_profile(step_s))
    monkeypatch.setattr(adv, "measure_costs", lambda names, *a, **k: [c for c in ORACLE_COSTS if c.name in names])
    names = ",".join(c.name for c in ORACLE_COSTS)
    assert adv.main(["--preset", "fake", "--ranks", "4", "--bandwidth", "1gbit", "--candidates", names]) == 0
    text = capsys.readouterr().out
    assert ("timed steps disagree" in text) is warned
    assert adv.main(["--preset", "fake", "--ranks", "4", "--bandwidth", "1gbit", "--candidates", names,
                     "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert len(doc["inputs"]["warnings"]) == int(warned)
    assert doc["inputs"]["profile"]["spread"] == pytest.approx(max(step_s) / min(step_s))


def test_candidates_cover_the_choosers():
    assert set(DEFAULT_CANDIDATES) <= set(CANDIDATES)
    assert adv.parse_candidates(list(DEFAULT_CANDIDATES)) == DEFAULT_CANDIDATES


def test_the_progress_weight_default_is_one_constant_for_the_chooser_and_advise():
    """auto's live chooser and `lightning-gc advise` rank candidates with the same default weight, so
    advise predicts the pick the chooser makes (the constant is fitted in docs/auto.md, "Progress")."""
    import inspect

    from lightning_gc.auto.chooser import AutoConfig
    from lightning_gc.auto.model import DEFAULT_PROGRESS_WEIGHT

    assert DEFAULT_PROGRESS_WEIGHT == 2.0
    assert AutoConfig().progress_weight == DEFAULT_PROGRESS_WEIGHT
    assert adv.build_parser().parse_args(["--preset", "mlp", "--ranks", "4", "--bandwidth", "1gbit"]
                                         ).progress_weight == DEFAULT_PROGRESS_WEIGHT
    for fn in (adv.advise, adv.run):
        assert inspect.signature(fn).parameters["progress_weight"].default == DEFAULT_PROGRESS_WEIGHT
