"""Codec micro-benchmark: how fast every compressor and every engine pass runs on this machine.

``python -m lightning_gc.bench.codec`` (or ``lightning-gc bench --codec``) times, in one process,
on flat fp32 groups of each requested size:

* a **memory-bandwidth reference**: ``torch.add(a, b, out=c)`` over the same number of elements
  (reads 8, writes 4 bytes per element) — the speed of one streaming pass over the group;
* the engine's own passes: **flatten** (``torch.cat`` of the per-parameter views of a bucket),
  **error feedback** (``p = g + e`` and the dense residual ``e = p − sent``), the **‖p‖²**
  statistic, and **write-back** (copy of the mean into the per-parameter views);
* for every compressor (:func:`lightning_gc.compressors.timing.time_codec`): **compress** (one rank's
  group), **aggregate** of ``world_size`` payloads into the mean, **decompress** (one payload back
  to dense: this rank's ``sent`` unless the format sends an exact subset), and the **pack /
  unpack** of the payload into / out of the byte buffer that allgather moves.

Every time is the median of ``repeats`` runs after one warm-up and is reported in seconds and in
elements per second, next to the reference, so a figure reads as "this pass costs as much as
``x`` streaming passes". Times are of *one* process with ``threads`` torch threads (default 1: a
rank of the 4-rank emulated cluster on a 2-core machine gets one), not of a training step.

``--device cuda`` runs the same passes on CUDA tensors (the reference add is then one pass of the
GPU's memory); every timed call is bracketed by ``torch.cuda.synchronize()``, so a time is the
kernels' time, not their launch. A compressor that fails on a device is recorded with its error
and the others still run; the exit status is then 1.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from lightning_gc.compressors.timing import time_codec, time_runs

SCHEMA = "lightning_gc.bench.codec/1"

_SUFFIX = {"k": 1_000, "m": 1_000_000, "g": 1_000_000_000}


def parse_size(text: str) -> int:
    """``"11M"`` → 11 000 000; also ``"1e6"``, ``"250k"``, ``"4096"``."""
    t = str(text).strip().lower()
    mult = 1
    if t and t[-1] in _SUFFIX:
        mult, t = _SUFFIX[t[-1]], t[:-1]
    try:
        value = float(t) * mult
    except ValueError:
        raise ValueError(f"size {text!r} is not a number of elements; write e.g. 1M, 11M, 250k or 4096") from None
    if not math.isfinite(value) or value < 1 or value != int(value):
        raise ValueError(f"size {text!r} must be a positive whole number of elements, e.g. 1M")
    return int(value)


@dataclass(frozen=True)
class CodecBenchConfig:
    """What to time (the fields are the options of ``python -m lightning_gc.bench.codec``).

    ``sizes``: 1M / 11M (ResNet-18) elements by default; 100M, a large-model group, needs ~4 GB of
    memory and a few minutes on one thread. ``segments``: parameter tensors per group (ResNet-18 has
    62). ``compressors``: ``None`` = every registered compressor. ``keep_allocations``: call
    :func:`lightning_gc.compressors.workspace.keep_large_allocations_cached` first (process-wide) to
    see what page faults on fresh large tensors cost.
    """

    sizes: tuple[int, ...] = (1_000_000, 11_000_000)
    world_size: int = 4
    ratio: float = 0.01
    repeats: int = 3
    segments: int = 62
    compressors: tuple[str, ...] | None = None
    threads: int = 1
    seed: int = 0
    keep_allocations: bool = False
    device: str = "cpu"

    def __post_init__(self) -> None:
        try:
            dev = torch.device(self.device)
        except (RuntimeError, TypeError):
            raise ValueError(f"device={self.device!r} is not a torch device; use 'cpu' or 'cuda'") from None
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"device={self.device!r}: the codec bench runs on 'cpu' or 'cuda'")
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={self.device!r} but torch sees no CUDA device here; use --device cpu")
        if not self.sizes or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in self.sizes):
            raise ValueError(f"sizes={self.sizes!r} must be positive element counts, e.g. (1_000_000, 11_000_000)")
        for name, lo in (("world_size", 1), ("repeats", 1), ("segments", 1), ("threads", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{name}={v!r} must be an integer ≥ {lo}")
        if not (0.0 < float(self.ratio) <= 1.0):
            raise ValueError(f"ratio={self.ratio!r} must lie in (0, 1], e.g. 0.01")
        if self.compressors is not None:
            from lightning_gc.compressors import available_compressors

            unknown = [c for c in self.compressors if c not in available_compressors()]
            if unknown:
                raise ValueError(f"unknown compressors {unknown}; valid: {', '.join(available_compressors())}")


def _timing(runs: list[float], n: int, ref_s: float) -> dict:
    """The median of ``runs``, as elements per second and as a multiple of the reference add's time."""
    s = statistics.median(runs)
    return {"seconds": s, "elements_per_s": n / s if s > 0 else float("inf"),
            "vs_add": s / ref_s if ref_s > 0 else float("nan"), "runs": runs}


def _reference_add(a: torch.Tensor, b: torch.Tensor, repeats: int) -> list[float]:
    c = torch.empty_like(a)
    return time_runs(lambda: torch.add(a, b, out=c), repeats)


def _segments(n: int, parts: int) -> list[int]:
    """Uneven split of ``n`` into ``parts`` sizes (big conv weights and small biases, like a model)."""
    parts = max(1, min(parts, n))
    w = torch.arange(1, parts + 1, dtype=torch.float64) ** 2
    sizes = (w / w.sum() * n).floor().long().clamp_min(1)
    sizes[-1] += n - int(sizes.sum())
    while int(sizes[-1]) < 1:  # only for tiny n: move elements back to the last part
        i = int(torch.argmax(sizes))
        sizes[i] -= 1
        sizes[-1] += 1
    return [int(s) for s in sizes]


def _engine_passes(n: int, cfg: CodecBenchConfig, ref_s: float, g: torch.Tensor) -> dict:
    """The engine's own passes as engine/hook.py runs them today (plus flatten into a huge-page
    backed output, :func:`lightning_gc.compressors.workspace.empty_output`, for comparison)."""
    from lightning_gc.compressors.workspace import empty_output

    segs = _segments(n, cfg.segments)
    offsets = list(itertools.accumulate(segs, initial=0))[:-1]
    bucket = g.clone()
    views = [bucket[o:o + s] for o, s in zip(offsets, segs)]
    e = (torch.randn(n, generator=torch.Generator().manual_seed(cfg.seed + 99)) * 0.1).to(g.device)
    mean = g * 0.5
    sent = g * 0.25
    p = g + e
    out = {
        "flatten": time_runs(lambda: torch.cat([v.reshape(-1) for v in views]), cfg.repeats),
        "flatten_hugepages": time_runs(
            lambda: torch.cat([v.reshape(-1) for v in views], out=empty_output(n, g.dtype, g.device)), cfg.repeats
        ),
        "ef_add": time_runs(lambda: g + e, cfg.repeats),
        "ef_residual": time_runs(lambda: p - sent, cfg.repeats),
        "norm2": time_runs(lambda: float(p.float().pow(2).sum()), cfg.repeats),
        "writeback": time_runs(lambda: [v.copy_(mean[o:o + s]) for v, o, s in zip(views, offsets, segs)],
                               cfg.repeats),
    }
    return {k: _timing(v, n, ref_s) for k, v in out.items()}


def _near_square(numel: int) -> tuple[int, int]:
    """``(d, numel // d)`` with d the largest divisor of ``numel`` not above its square root."""
    d = max(k for k in range(1, int(numel ** 0.5) + 1) if numel % k == 0)
    return d, numel // d


def _compressor_passes(name: str, xs: list[torch.Tensor], cfg: CodecBenchConfig, ref_s: float) -> dict:
    from lightning_gc.compressors import GroupContext, build_compressor, takes_ratio

    n = xs[0].numel()
    N = len(xs)
    segs = tuple(_segments(n, cfg.segments))
    comp = build_compressor(name, ratio=cfg.ratio if takes_ratio(name) else None)
    # lowrank compresses matrices: give each segment a near-square matrix shape (the others read no shapes)
    shapes = tuple(_near_square(s) for s in segs) if name == "lowrank" else ()
    ctxs = [GroupContext(step=5, rank=r, world_size=N, segments=segs, seed=cfg.seed, shapes=shapes,
                         device=xs[0].device) for r in range(N)]
    raw = time_codec(comp, xs, ctxs, cfg.repeats)
    res: dict = {"wire_format": raw["wire_format"], "describe": raw["describe"],
                 "payload_bytes": raw["payload_bytes"], "bytes_per_element": raw["payload_bytes"] / n,
                 "needs_dense_sent": raw["needs_dense_sent"]}
    res.update({k: _timing(v, n, ref_s) for k, v in raw["timings"].items()})
    if "hop_encode" in raw["timings"]:  # a ring codec: its per-hop passes work on one 1/N chunk
        res["hop_elements"] = -(-n // N)
    total = raw["engine_codec_s"]
    res["engine_codec_s"] = total
    res["engine_codec_vs_add"] = total / ref_s if ref_s > 0 else float("nan")
    return res


def run_codec_bench(cfg: CodecBenchConfig, log: Callable[[str], None] | None = None) -> dict:
    """Run every measurement; returns the JSON-serialisable result document."""
    from lightning_gc.compressors import available_compressors

    log = log or (lambda _m: None)
    names = list(cfg.compressors) if cfg.compressors is not None else available_compressors()
    if cfg.keep_allocations:
        from lightning_gc.compressors.workspace import keep_large_allocations_cached

        if not keep_large_allocations_cached():
            log("note: could not tune the allocator (not glibc); timings are with the default")
    old_threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    doc: dict = {
        "schema": SCHEMA,
        "config": {**asdict(cfg), "sizes": list(cfg.sizes), "compressors": names},
        "machine": {"torch": torch.__version__, "python": platform.python_version(),
                    "platform": platform.platform(), "threads": torch.get_num_threads(),
                    "device": _device_name(cfg.device)},
        "sizes": [],
    }
    try:
        for n in cfg.sizes:
            gen = torch.Generator().manual_seed(cfg.seed + n)
            # rank-dependent scales so no rank dominates every coordinate by construction
            xs = [(torch.randn(n, generator=gen) * (1.0 + 0.25 * r)).to(cfg.device) for r in range(cfg.world_size)]
            ref_runs = _reference_add(xs[0], xs[-1], cfg.repeats)
            ref_s = statistics.median(ref_runs)
            entry = {
                "numel": n,
                "reference": {"add": {**_timing(ref_runs, n, ref_s),
                                      "bytes_per_s": 12 * n / ref_s if ref_s > 0 else float("inf")}},
                "engine": _engine_passes(n, cfg, ref_s, xs[0]),
                "compressors": {},
            }
            log(f"size {n}: add {ref_s * 1e3:.2f} ms ({12 * n / ref_s / 1e9:.2f} GB/s)")
            for name in names:
                t0 = time.perf_counter()
                try:
                    entry["compressors"][name] = _compressor_passes(name, xs, cfg, ref_s)
                except Exception as exc:  # noqa: BLE001 - recorded; the other compressors still run
                    entry["compressors"][name] = {"error": f"{type(exc).__name__}: {exc}"}
                    log(f"  {name:12s} FAILED: {type(exc).__name__}: {exc}")
                    continue
                r = entry["compressors"][name]
                log(f"  {name:12s} compress {r['compress']['seconds'] * 1e3:9.2f} ms  aggregate "
                    f"{r['aggregate']['seconds'] * 1e3:9.2f} ms  engine codec {r['engine_codec_s'] * 1e3:9.2f} ms "
                    f"({time.perf_counter() - t0:.1f} s)")
            doc["sizes"].append(entry)
            del xs
    finally:
        torch.set_num_threads(old_threads)
    return doc


def _device_name(device: str) -> str:
    dev = torch.device(device)
    if dev.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(dev)})"
    return "cpu"


def failed_compressors(doc: dict) -> list[str]:
    """``"name at N elements: error"`` for every compressor that raised (empty when all ran)."""
    return [f"{name} at {s['numel']:,} elements: {r['error']}"
            for s in doc["sizes"] for name, r in s["compressors"].items() if "error" in r]


def _fmt_rate(t: dict | None) -> str:
    if not t:
        return "–"
    return f"{t['elements_per_s'] / 1e6:,.0f} ({t['vs_add']:.1f}×)"


def markdown(doc: dict) -> str:
    """Tables: rate in millions of elements per second and, in brackets, time as multiples of the add."""
    cfg = doc["config"]
    lines = [
        f"# Codec micro-benchmark (torch {doc['machine']['torch']}, {doc['machine'].get('device', 'cpu')}, "
        f"{doc['machine']['threads']} thread(s), "
        f"N = {cfg['world_size']}, ratio {cfg['ratio']}"
        f"{', large allocations kept by malloc' if cfg.get('keep_allocations') else ''})",
        "",
        "Rates in M elements/s; in brackets the time as a multiple of one `torch.add` pass over the "
        "same elements (the memory-bandwidth reference). `engine codec` = what the engine's compress "
        "timer covers per rank and step: compress + aggregate (+ decompress of the own payload where "
        "the format needs a dense `sent`).",
    ]
    for s in doc["sizes"]:
        n = s["numel"]
        ref = s["reference"]["add"]
        lines += [
            "",
            f"## {n:,} elements — add: {ref['seconds'] * 1e3:.2f} ms, {ref['elements_per_s'] / 1e6:,.0f} M elem/s, "
            f"{ref['bytes_per_s'] / 1e9:.2f} GB/s",
            "",
            "| engine pass | M elem/s (× add) |",
            "|---|---|",
        ]
        for k, label in (("flatten", "flatten (torch.cat of views)"),
                         ("flatten_hugepages", "flatten into a huge-page output (workspace.empty_output)"), ("ef_add", "error feedback p = g + e"),
                         ("ef_residual", "error feedback e = p − sent (dense)"), ("norm2", "‖p‖² statistic"),
                         ("writeback", "write-back into views")):
            lines.append(f"| {label} | {_fmt_rate(s['engine'][k])} |")
        lines += [
            "",
            "| compressor | format | bytes/elem | compress | aggregate (N) | decompress | pack | unpack (N) "
            "| engine codec ms (× add) |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for name, r in s["compressors"].items():
            if "error" in r:
                lines.append(f"| {name} | failed: {r['error'][:200]} | | | | | | | |")
                continue
            agg = r["aggregate"]
            if "gather_values" in r:
                agg_txt = f"{_fmt_rate(agg)} + gather {_fmt_rate(r['gather_values'])}"
            else:
                agg_txt = _fmt_rate(agg)
            lines.append(
                f"| {name} | {r['wire_format']} | {r['bytes_per_element']:.3f} | {_fmt_rate(r['compress'])} | "
                f"{agg_txt} | {_fmt_rate(r['decompress'])}{'' if r['needs_dense_sent'] else ' (unused)'} | "
                f"{_fmt_rate(r.get('pack'))} | {_fmt_rate(r.get('unpack'))} | "
                f"{r['engine_codec_s'] * 1e3:,.1f} ({r['engine_codec_vs_add']:.1f}×) |"
            )
        hops = {name: r for name, r in s["compressors"].items() if "hop_elements" in r}
        if hops:
            lines += [
                "",
                "Ring codecs, one reduce-scatter hop on one 1/N chunk: encode (quantise what is sent) and "
                "dequantise-accumulate (what arrived, added in fp32 to the own values), in ms.",
                "",
                "| compressor | chunk elements | hop encode ms | hop dequantise-accumulate ms | engine codec ms |",
                "|---|---|---|---|---|",
            ]
            for name, r in hops.items():
                lines.append(f"| {name} | {r['hop_elements']:,} | {r['hop_encode']['seconds'] * 1e3:,.2f} | "
                             f"{r['hop_accumulate']['seconds'] * 1e3:,.2f} | {r['engine_codec_s'] * 1e3:,.1f} |")
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m lightning_gc.bench.codec",
        description="Time every compressor's compress / aggregate / decompress / pack and the engine's own "
        "passes on flat fp32 groups, next to a torch.add memory-bandwidth reference (docs/bench.md).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--sizes", default="1M,11M", help="comma-separated group sizes in elements, e.g. 1M,11M,100M")
    p.add_argument("--world-size", type=int, default=4, help="payloads aggregated (ranks)")
    p.add_argument("--ratio", type=float, default=0.01, help="kept fraction for compressors that take one")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per measurement (median reported)")
    p.add_argument("--segments", type=int, default=62, help="parameter tensors per group (flatten/write-back)")
    p.add_argument("--compressors", default=None, help="comma-separated names (default: all)")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="where the groups live: cpu or cuda (cuda:N)")
    p.add_argument("--keep-allocations", action="store_true",
                   help="let glibc keep freed large blocks (process-wide mallopt) to measure page-fault costs")
    p.add_argument("--json", default=None, metavar="FILE", help="write the result document here")
    p.add_argument("--md", default=None, metavar="FILE", help="write the Markdown tables here")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        cfg = CodecBenchConfig(
            sizes=tuple(parse_size(s) for s in args.sizes.split(",") if s.strip()),
            world_size=args.world_size, ratio=args.ratio, repeats=args.repeats, segments=args.segments,
            compressors=tuple(c.strip() for c in args.compressors.split(",") if c.strip()) if args.compressors else None,
            threads=args.threads, seed=args.seed, keep_allocations=args.keep_allocations, device=args.device,
        )
    except ValueError as exc:
        print(f"codec bench: error: {exc}", file=sys.stderr)
        return 2
    doc = run_codec_bench(cfg, log=lambda m: print(m, flush=True))
    md = markdown(doc)
    print()
    print(md)
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
        print(f"wrote {args.json}")
    if args.md:
        Path(args.md).write_text(md)
        print(f"wrote {args.md}")
    failed = failed_compressors(doc)
    if failed:
        print("codec bench: these compressors failed (recorded in the result):\n  " + "\n  ".join(failed),
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
