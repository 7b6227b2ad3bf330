"""Timing of the codecs as the engine runs them: one place for the codec bench and ``auto``.

:func:`time_runs` times any callable (after a warm-up, CUDA-synchronised); :func:`time_codec`
times one compressor's per-step passes (compress, aggregate of every rank's payload, decompress,
and the pack/unpack an allgather needs) on one flat gradient per rank. The ``auto`` chooser
(:mod:`lightning_gc.auto.candidates`), ``lightning-gc advise`` and the codec micro-benchmark
(:mod:`lightning_gc.bench.codec`) all time through these two functions, so their figures are
comparable. It lives with the compressors because it only needs them: the runtime must not import
the benchmark package.

Tuning: ``repeats`` trades time for noise; the callers take medians (or minima) of the runs, so a
loaded host shows as spread between runs, not as a shifted median alone.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from .lowbit import decode_blocks, encode_blocks, message_bytes
from .marsit.codec import merge_packed
from .packing import pack_payload, unpack_payload
from .sparse import scatter_sparse


def _sync() -> None:
    """Wait for queued CUDA kernels (a no-op where CUDA was never used): a wall-clock time of CUDA
    work without it measures the kernel launches, not the kernels."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def time_runs(fn: Callable[[], object], repeats: int) -> list[float]:
    """Seconds of ``repeats`` calls of ``fn`` after one untimed warm-up call (allocator, lazy
    initialisation); the codec bench, ``lightning-gc advise`` and the ``auto`` chooser's measurement all time with it.
    Each call is bracketed by a CUDA synchronisation where CUDA is in use."""
    fn()  # warm-up (allocator, lazy initialisation)
    out = []
    for _ in range(repeats):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        out.append(time.perf_counter() - t0)
    return out


def time_codec(comp, xs: list[torch.Tensor], ctxs: list, repeats: int) -> dict:
    """Time one compressor's passes as the engine runs them per step and rank; raw seconds.

    The one function through which codec costs reach the ``auto`` chooser
    (:mod:`lightning_gc.auto.candidates` calls it on the live gradient, the codec bench
    :func:`lightning_gc.bench.codec.run_codec_bench` on synthetic ones). ``xs``: one flat fp32 gradient per rank (``len(xs)`` = world size), ``ctxs``:
    their :class:`~lightning_gc.compressors.GroupContext` s (rank ``r`` for ``xs[r]``).

    Returns ``{"wire_format", "describe", "payload_bytes", "needs_dense_sent", "timings": {pass:
    [seconds per run]}, "engine_codec_s"}``; ``engine_codec_s`` (medians) is what the engine's
    ``compress`` timer covers per step: compress + aggregate (+ the gather of values for AR-Topk)
    (+ decompress when the format's ``sent`` is not an exact subset of ``p``).
    """
    n = xs[0].numel()
    N = len(xs)
    c0 = ctxs[0]
    res: dict = {"wire_format": comp.wire_format, "describe": comp.describe()}
    timings: dict[str, list[float]] = {}
    timings["compress"] = time_runs(lambda: comp.compress(xs[0], c0), repeats)
    outs = [comp.compress(x, c) for x, c in zip(xs, ctxs)]
    res["payload_bytes"] = outs[0].nbytes
    fmt = comp.wire_format
    if fmt == "allgather":
        specs = comp.payload_specs(c0, xs[0].dtype)
        timings["pack"] = time_runs(lambda: pack_payload(outs[0].payload), repeats)
        bufs = [pack_payload(o.payload) for o in outs]
        timings["unpack"] = time_runs(lambda: [unpack_payload(b, specs) for b in bufs], repeats)
        payloads = [unpack_payload(b, specs) for b in bufs]
        timings["aggregate"] = time_runs(lambda: comp.aggregate_gathered(payloads, outs[0].meta, c0), repeats)
        needs_sent = not getattr(comp, "sends_exact_subset", False)
    elif fmt in ("allreduce", "gradiveq"):  # gradiveq: coefficients add up (identity before a basis is fitted)
        summed = tuple(sum(o.payload[i] for o in outs) for i in range(len(outs[0].payload)))
        # aggregate_summed may work in place on the summed buffers (it owns them in the exchange)
        timings["aggregate"] = time_runs(
            lambda: comp.aggregate_summed(tuple(t.clone() for t in summed), outs[0].meta, c0), repeats
        )
        clone_s = time_runs(lambda: tuple(t.clone() for t in summed), repeats)
        timings["aggregate"] = [max(a - b, 0.0) for a, b in zip(timings["aggregate"], clone_s)]
        needs_sent = True
    elif fmt == "lowrank":  # P and Q add up; the mean is P̂·Q̄ᵀ, what decompress computes
        summed = tuple(sum(o.payload[i] for o in outs) for i in range(len(outs[0].payload)))
        timings["aggregate"] = time_runs(lambda: comp.decompress(summed, outs[0].meta, c0), repeats)
        needs_sent = True
    elif fmt == "marsit":  # the ring's ⊙ merges: per rank N−1 hops, each merging one 1/N chunk of the bits
        bits = [o.payload[1] for o in outs]

        def merges() -> None:
            acc = torch.tensor_split(bits[0], N)
            for hop in range(N - 1):
                merge_packed(torch.tensor_split(bits[(hop + 1) % N], N)[hop], acc[hop], hop + 2,
                             comp.transient_generator(c0, hop))

        timings["aggregate"] = time_runs(merges, repeats)
        needs_sent = True  # the merged bits decoded into the mean (η·sign), which is also its sent
    elif fmt == "lowbit":  # the ring's codec work on one rank, without the sends
        timings.update(_lowbit_ring_timings(comp, xs, c0, repeats))
        needs_sent = False  # its sent is p − own rounding errors, one subtraction (not a decode)
    else:  # AR-Topk: the source's indices, every rank's values there summed, scattered into the mean
        idx = outs[0].payload[1]
        idx_long = idx.long()
        timings["gather_values"] = time_runs(lambda: xs[0][idx_long].contiguous(), repeats)
        summed_v = sum(x[idx_long] for x in xs)
        timings["aggregate"] = time_runs(lambda: scatter_sparse(summed_v / N, idx, n), repeats)
        needs_sent = False
    timings["decompress"] = time_runs(lambda: comp.decompress(outs[0].payload, outs[0].meta, c0), repeats)
    med = {k: statistics.median(v) for k, v in timings.items()}
    total = med["compress"] + med["aggregate"] + med.get("gather_values", 0.0)
    if needs_sent:
        total += med["decompress"]
    res["needs_dense_sent"] = needs_sent
    res["timings"] = timings
    res["engine_codec_s"] = total
    return res


def _lowbit_ring_timings(comp, xs: list[torch.Tensor], c0, repeats: int) -> dict[str, list[float]]:
    """The dequantising half of one rank's ``lowbit`` ring (lightning_gc.exchanges.lowbit), sends left out.

    ``compress`` (timed by the caller: padding and one encode of the whole group) stands for the
    ring's encodes, which quantise the group once in N chunks. ``aggregate``: N − 1
    dequantise-accumulates of a 1/N chunk and the decoding of the N gathered chunks.
    ``hop_encode`` / ``hop_accumulate``: one reduce-scatter hop on a 1/N chunk (quantise what is
    sent; dequantise what arrived and add it to the own fp32 values). Not counted: the one
    subtraction ``p − own rounding errors`` that makes ``sent``.
    """
    N = len(xs)
    bs, bits = comp.block_size, comp.bits
    x = comp.padded(xs[0])
    chunk = -(-x.shape[0] // N)
    part = x[:chunk]
    msg = torch.empty(message_bytes(chunk, bs, bits), dtype=torch.uint8, device=x.device)
    dq = torch.empty_like(part)
    acc = torch.empty_like(part)
    encode_blocks(part, bits, comp.generator(c0, 1), msg, dq)

    def dequantise() -> None:
        for _ in range(N - 1):
            decode_blocks(msg, chunk, bs, bits, acc, add=part)
        for _ in range(N):
            decode_blocks(msg, chunk, bs, bits, acc)

    return {
        "hop_encode": time_runs(lambda: encode_blocks(part, bits, comp.generator(c0, 1), msg, dq), repeats),
        "hop_accumulate": time_runs(lambda: decode_blocks(msg, chunk, bs, bits, acc, add=part), repeats),
        "aggregate": time_runs(dequantise, repeats),
    }
