"""The replica exchange under FSDP2 (lightning_gc/sync/hsdp.py), hook by hook, on a 2 × 2 mesh.

Four gloo ranks: two replicas ("nodes") of two shard ranks. Every rank gets its own batch, so every
rank's gradient differs. Oracles, built from all ranks' full gradients (an unsharded copy of the model
run on every rank's batch, in float64) and never from the code under test:

* dense: native HSDP (``fully_shard`` on the 2-D mesh) bit for bit;
* Top-k with error feedback: each replica's node mean plus its memory, its top k by magnitude on this
  shard, averaged over the replicas; the memory is what was not sent (zero on padding rows);
* the 16-bit cast and QSGD: the exact mean within the codec's analytic error bound;
* ``lowrank`` at full rank: the exact mean (PowerSGD reconstructs a matrix whose rank it covers).
Replicas of a shard must hold the same mean bit for bit, in every case.
"""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_distributed

from lightning_gc.sync.hsdp import ShardLayout, refusal

R, S = 2, 2  # replicas × shard ranks
IN, HID, OUT = 7, 11, 5  # 11 and 5 rows: uneven shards, so padding rows exist


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(IN, HID), torch.nn.Tanh(), torch.nn.Linear(HID, OUT))


def _batch(rank: int, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(9, IN, generator=g) * (1 + rank), torch.randn(9, OUT, generator=g)


def _loss(model: torch.nn.Module, rank: int, step: int = 0) -> torch.Tensor:
    x, y = _batch(rank, step)
    return ((model(x) - y) ** 2).mean()


def _full_grads(world: int) -> list[list[torch.Tensor]]:
    """Every rank's full gradient of every parameter (float64), from an unsharded copy."""
    out = []
    for r in range(world):
        m = _model().double()
        x, y = _batch(r)
        ((m(x.double()) - y.double()) ** 2).mean().backward()
        out.append([p.grad.detach().clone() for p in m.parameters()])
    return out


def _sharded(mesh_dims: tuple[str, ...] | None, compressor: str, **kw):
    """The model sharded on the shard mesh with a ReplicaExchange hooked in (or native HSDP when
    ``mesh_dims`` is None); returns (model, exchange or None, mesh)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from lightning_gc.comm.network import NetworkState
    from lightning_gc.engine.slots import MethodSpec, build_slot
    from lightning_gc.sync.hsdp import ReplicaExchange, attach

    mesh = init_device_mesh("cpu", (R, S), mesh_dim_names=("replicate", "shard"))
    model = _model()
    target = mesh if mesh_dims is None else mesh["shard"]
    reduce_dtype = kw.pop("reduce_dtype", None)
    policy = {"mp_policy": MixedPrecisionPolicy(reduce_dtype=reduce_dtype)} if reduce_dtype is not None else {}
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=target, **policy)
    fully_shard(model, mesh=target, **policy)
    if mesh_dims is None:
        return model, None, mesh
    group = mesh["replicate"].get_group()
    slot = build_slot(MethodSpec(compressor, kw.pop("ratio", None), kw.pop("args", {})), group, NetworkState(), False)
    ex = ReplicaExchange(slot, group, replica=mesh["replicate"].get_local_rank(), replicas=R,
                         shard=mesh["shard"].get_local_rank(), min_compress_numel=0)
    attach(model, ex)
    assert dist.get_world_size() == R * S
    return model, ex, mesh


def _local_grads(model) -> list[torch.Tensor]:
    return [p.grad.to_local().detach().clone() for p in model.parameters()]


def _rows(rank: int, full: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``full`` (FSDP2: torch.chunk on dim 0 over the shard ranks)."""
    chunks = torch.chunk(full, S, dim=0)
    s = rank % S
    return chunks[s] if s < len(chunks) else full[:0]


def _node_mean(grads: list[list[torch.Tensor]], rank: int, i: int) -> torch.Tensor:
    node = rank // S
    return sum(grads[node * S + j][i] for j in range(S)) / S


def _run(rank: int, world: int, compressor: str, kw: dict) -> dict:
    model, ex, _ = _sharded(("shard",), compressor, **dict(kw))
    _loss(model, rank).backward()
    out = {"grads": _local_grads(model), "memory": None}
    if ex is not None:
        ex.after_step()
        out["memory"] = ex.memory(1)  # modules in model order: 0 = the first Linear, 1 = the last
        out["layout"] = ex.layouts[1]
        out["bytes"] = ex.last.bytes_inter_node
    native, _, _ = _sharded(None, "dense", **({"reduce_dtype": kw["reduce_dtype"]} if "reduce_dtype" in kw else {}))
    _loss(native, rank).backward()
    out["native"] = _local_grads(native)
    return out


def _replicas_identical(res: list[dict]) -> None:
    for s in range(S):
        for a, b in zip(res[s]["grads"], res[S + s]["grads"]):
            assert torch.equal(a, b), "the replicas of a shard hold the same mean"


def test_dense_equals_native_hsdp_bit_for_bit():
    res = run_distributed(_run, R * S, "dense", {})
    for r in res:
        for a, b in zip(r["grads"], r["native"]):
            assert torch.equal(a, b)
    _replicas_identical(res)
    assert all(r["bytes"] > 0 for r in res)


def _bf16_reduce(rank: int, world: int) -> dict:
    return {c: _run(rank, world, c, {"reduce_dtype": torch.bfloat16}) for c in ("dense", "qsgd")}


def test_a_bf16_reduce_dtype_is_native_for_dense_and_bounded_for_qsgd():
    """FSDP2's ``MixedPrecisionPolicy(reduce_dtype=bfloat16)``: the hook gets a bf16 shard. Dense:
    native HSDP with the same policy, bit for bit. QSGD: exchanged in fp32, written back in bf16;
    replicas identical and within QSGD's bound plus the bf16 roundings (reduce-scatter and write-back)."""
    res = run_distributed(_bf16_reduce, R * S)
    grads = _full_grads(R * S)
    for rank, r in enumerate(res):
        for a, b in zip(r["dense"]["grads"], r["dense"]["native"]):
            assert torch.equal(a, b)
        for i, got in enumerate(r["qsgd"]["grads"]):
            ref = _rows(rank, sum(g[i] for g in grads) / (R * S))
            norm = max(torch.cat([_rows(rep * S + rank % S, _node_mean(grads, rep * S + rank % S, j)).reshape(-1)
                                  for j in ((0, 1) if i < 2 else (2, 3))]).norm() for rep in range(R))
            assert (got.double() - ref).abs().max() <= norm / 7 * 2 + 2 ** -6 * ref.abs().max() + 1e-6
    _replicas_identical([r["qsgd"] for r in res])


def test_topk_with_error_feedback_is_the_mean_of_each_replicas_top_k():
    ratio = 0.3
    res = run_distributed(_run, R * S, "topk", {"ratio": ratio})
    grads = _full_grads(R * S)
    _replicas_identical(res)
    for rank, r in enumerate(res):
        layout: ShardLayout = r["layout"]  # module 1: the last Linear (weight, bias)
        sent, memory = [], []
        for rep in range(R):
            pieces = []
            for i, (shape, rows) in zip((2, 3), zip(layout.shapes, layout.rows)):
                mine = _rows(rep * S + rank % S, _node_mean(grads, rep * S + rank % S, i))
                padded = torch.zeros(shape, dtype=torch.float64)
                padded[:rows] = mine
                pieces.append(padded.reshape(-1))
            p = torch.cat(pieces)
            k = max(1, int(round(ratio * p.numel())))
            idx = p.abs().topk(k).indices
            s = torch.zeros_like(p)
            s[idx] = p[idx]
            sent.append(s)
            if rep == rank // S:
                memory = p - s
        mean = sum(sent) / R
        got = torch.cat([r["grads"][2].reshape(-1), r["grads"][3].reshape(-1)])
        n_w = layout.rows[0] * HID
        want = torch.cat([mean[:n_w], mean[layout.segments[0]:layout.segments[0] + layout.rows[1]]])
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(r["memory"].double(), memory, rtol=1e-5, atol=1e-6)
        for a, b in layout.padding():
            assert torch.count_nonzero(r["memory"][a:b]) == 0


#: per element, |mean − exact mean| ≤ bound(n), n = the largest L2 norm of a replica's shard of the module
#: (the group the codec sees): bf16 rounds each element to 2⁻⁸ relative (the sum of R bf16 values and the
#: division by R add one more rounding); QSGD's error per element is below norm/levels (its bucket's norm is
#: at most the group's); PowerSGD at a rank covering every shard matrix reconstructs it (fp32 rounding only);
#: the 8-bit ring rounds R times, each by less than its block's max/127 (docs/lowbit.md), every
#: partial sum at most R·n
BOUNDS = {"bf16": lambda n: 2 ** -7 * n, "qsgd": lambda n: n / 127, "lowrank": lambda n: 1e-5 * n,
          "lowbit": lambda n: R * R * n / 127}


@pytest.mark.parametrize("compressor,args", [("bf16", {}), ("qsgd", {"levels": 127}), ("lowrank", {"rank": 8}),
                                             ("lowbit", {"bits": 8})])
def test_lossy_codecs_stay_within_their_error_bound(compressor, args):
    res = run_distributed(_run, R * S, compressor, {"args": args})
    grads = _full_grads(R * S)
    _replicas_identical(res)
    for rank, r in enumerate(res):
        for module in ((0, 1), (2, 3)):
            norm = max(torch.cat([_rows(rep * S + rank % S, _node_mean(grads, rep * S + rank % S, i)).reshape(-1)
                                  for i in module]).norm() for rep in range(R))
            for i in module:
                ref = _rows(rank, sum(g[i] for g in grads) / (R * S))
                got = r["grads"][i]
                assert got.shape == ref.shape
                err = (got.double() - ref).abs().max()
                assert err <= BOUNDS[compressor](norm) + 1e-7, f"{compressor}: parameter {i} off by {err}"


def test_the_layout_names_padding_rows():
    layout = ShardLayout(("w", "b"), ((3, 2), (3,)), (2, 1))
    assert layout.segments == (6, 3) and layout.numel == 9
    assert layout.padding() == [(4, 6), (7, 9)]


@pytest.mark.parametrize("flat,collective,fragment", [
    ({"compressor": "auto"}, "allreduce", "compressor='auto' is not supported"),
    ({"compressor": "topk", "sync": "diloco"}, "allgather", "sync='diloco' does not apply"),
    ({"compressor": "topk", "topology": "nodes"}, "allgather", "the device mesh is the topology"),
    ({"compressor": "topk", "plan": "layer"}, "allgather", "each fully_shard call is one exchange"),
    ({"compressor": "marsit"}, "marsit", "with collective='marsit' is not supported"),
])
def test_refusals_name_the_reason(flat, collective, fragment):
    assert fragment in refusal(flat, collective)


def test_supported_options_pass():
    for collective in ("allreduce", "allgather", "lowbit", "lowrank"):
        assert refusal({"compressor": "x", "ratio": 0.1, "seed": 3}, collective) is None
