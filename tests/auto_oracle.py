"""A hand-written copy of the ``auto`` model's equations (docs/auto.md), written from the document,
not from lightning_gc/auto/model.py, for the tests' brute-force oracles. Plain dicts in, seconds out."""

from __future__ import annotations

import math


def ring(alpha: float, beta: float, nbytes: float, n: int) -> float:
    return 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes * beta


def direct(alpha: float, beta: float, nbytes: float, n: int) -> float:
    """Every rank sends its message to the n - 1 others at once (docs/cost_model.md, "Direct exchange")."""
    return alpha + (n - 1) * nbytes * beta


def allreduce(alpha: float, beta: float, nbytes: float, n: int) -> float:
    """The engine's allreduce: direct on 2..8 ranks when its n - 1 copies come to 12 KiB or less, or the
    model finds it cheaper than the ring; else the ring."""
    if 2 <= n <= 8 and ((n - 1) * nbytes <= 12 * 1024 or direct(alpha, beta, nbytes, n) < ring(alpha, beta, nbytes, n)):
        return direct(alpha, beta, nbytes, n)
    return ring(alpha, beta, nbytes, n)


def allgather(alpha: float, beta: float, nbytes: float, n: int) -> float:
    if 2 <= n <= 8:  # the direct exchange
        return direct(alpha, beta, nbytes, n)
    return alpha * math.ceil(math.log2(n)) + (n - 1) * nbytes * beta


def sparse_best(alpha: float, beta: float, numel: int, n: int, c: float, vb: float) -> float:
    L = math.ceil(math.log2(n))
    idx = 4 * numel * c
    val = idx * vb / 4
    return min(alpha * L + (idx + val) * beta * (n - 1),  # allgather of indices and values
               alpha * (2 * (n - 1) + L) + beta * (idx * L + val * 2 * (n - 1) / n),  # ART-Ring
               3 * alpha * L + beta * L * (idx + 2 * val))  # ART-Tree


def buckets_by_hand(numels: list[int], first: int = 1 << 20, cap: int = 25 << 20) -> list[list[int]]:
    """Tensor indices per DDP bucket, in ready order: a bucket closes when its fp32 bytes reach its cap."""
    out, cur, size, limit = [], [], 0, first
    for i, n in enumerate(numels):
        cur.append(i)
        size += 4 * n
        if size >= limit:
            out.append(cur)
            cur, size, limit = [], 0, cap
    if cur:
        out.append(cur)
    return out


def step_by_hand(cost: dict, wl: dict, alpha: float, beta: float, n: int) -> float:
    """Predicted step seconds of one candidate (``cost``: MethodCost fields, ``wl``: Workload fields)."""
    bwd = wl["backward_s"]
    numels = wl["numels"]
    total = sum(numels)
    if n == 1:
        compute = wl["forward_s"] + sum(bwd) + wl["optimizer_s"]
        overhead = cost.get("overhead_s", 0.0)
        return max(compute + wl["other_s"] + overhead, compute if overhead >= 0 else 1e-4)
    if cost["wire"] == "bucket":
        per = 4 if cost["name"] == "ddp" else 2
        net_free = 0.0
        for b in buckets_by_hand(numels):
            ready = sum(bwd[: b[-1] + 1])
            elems = sum(numels[i] for i in b)
            start = max(ready, net_free)  # the engine's steady dense path: DDP's buckets and nothing else
            net_free = start + cost["codec_s"] * elems / total + ring(alpha, beta, per * elems, n)
        end = max(sum(bwd), net_free)
    else:
        B = cost["payload_bytes"]
        if cost["wire"] == "allreduce":
            comm = allreduce(alpha, beta, B, n)
        elif cost["wire"] == "allgather":
            comm = allgather(alpha, beta, B, n)
        elif cost["wire"] == "lowrank":
            # P with the exact small tensors, Q with the closing report (40 fp32 elements): two messages
            comm = allreduce(alpha, beta, B / 2 + cost["exact_bytes"], n) + allreduce(alpha, beta, B / 2 + 40 * 4, n)
        else:
            group = max(total - int(cost["exact_bytes"] // 4), 1)  # the exact small tensors are not in M
            comm = sparse_best(alpha, beta, group, n, cost["sparse_ratio"], cost["value_bytes"])
        if cost["wire"] != "lowrank":
            comm += allreduce(alpha, beta, 13 * 8, n)  # the engine's closing report: 13 float64 fields
        if cost["exact_bytes"] > 0 and cost["wire"] != "lowrank":
            comm += allreduce(alpha, beta, cost["exact_bytes"], n)
        end = sum(bwd) + cost["codec_s"] + comm
    compute = wl["forward_s"] + sum(bwd) + wl["optimizer_s"]
    overhead = cost.get("overhead_s", 0.0)
    # the raw model is floored at the profiled compute; a negative (measured) correction at 0.1 ms
    floor = compute if overhead >= 0 else 1e-4
    return max(wl["forward_s"] + end + wl["optimizer_s"] + wl["other_s"] + overhead, floor)


def time_per_progress_by_hand(cost: dict, wl: dict, alpha: float, beta: float, n: int, w: float) -> float:
    d2 = cost["delta2"] if cost["error_feedback"] else cost["delta2"] / n
    return step_by_hand(cost, wl, alpha, beta, n) * (1 + w * d2)


def argmin_by_hand(costs: list[dict], wl: dict, alpha: float, beta: float, n: int, w: float) -> str:
    """Brute force: every candidate's time per progress, the least wins, earlier on an exact tie."""
    scored = [(time_per_progress_by_hand(c, wl, alpha, beta, n, w), k, c["name"]) for k, c in enumerate(costs)]
    return min(scored)[2]
