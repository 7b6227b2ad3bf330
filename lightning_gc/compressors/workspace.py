"""Reusable scratch buffers for the codecs.

Why: on CPU, a fresh tensor above glibc's mmap threshold (32 MiB at most; an 11M-element fp32
group is 44 MB) is mapped fresh by the kernel on every allocation and every page faults on first
touch — measured ~40 ms for 44 MB against ~5 ms for one streaming pass over the same memory
(``python -m lightning_gc.bench.codec``: allocating passes cost 4–5 × ``torch.add`` into an
existing tensor). Codecs therefore keep their large *intermediates* in buffers reused across steps.

Rules that keep this safe:

* a buffer is private to the calling thread (engine v2 runs exchanges on worker threads);
* each call site uses its own ``tag``; a buffer never escapes the function that asked for it
  (payloads and results handed back to the engine are always fresh tensors);
* only CPU tensors are cached — CUDA's caching allocator already reuses memory, and a cached
  buffer could be overwritten while a kernel on another stream still reads it.

Memory cost: at most one buffer per (tag, dtype) and thread, sized for the largest group seen;
:func:`release` drops them.
"""

from __future__ import annotations

import threading

import torch
from torch import Tensor

_local = threading.local()


def scratch(tag: str, numel: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> Tensor:
    """A 1-D tensor of ``numel`` elements with undefined contents, reused across calls on CPU."""
    device = torch.device(device)
    if device.type != "cpu":
        return torch.empty(numel, dtype=dtype, device=device)
    cache: dict | None = getattr(_local, "bufs", None)
    if cache is None:
        cache = _local.bufs = {}
    key = (tag, dtype)
    buf = cache.get(key)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(max(numel, 1), dtype=dtype)
        cache[key] = buf
    return buf[:numel]


def release() -> None:
    """Free this thread's cached buffers."""
    _local.bufs = {}


_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def keep_large_allocations_cached(threshold_bytes: int = 1 << 30) -> bool:
    """Ask glibc's malloc to serve allocations up to ``threshold_bytes`` from its heap and to keep
    freed memory, instead of mapping every large tensor fresh from the kernel.

    Process-wide and irreversible, so nothing in lightning_gc calls it on its own; a training
    script (or a strategy option) may. Effect measured with the codec micro-benchmark
    (``--keep-allocations``): every pass that allocates a group-sized result — ``torch.cat``,
    ``g + e``, a decompressed or aggregated gradient — drops from ~5× to ~1× the cost of one
    ``torch.add`` into an existing tensor on 11M-element groups. The price: the process keeps its
    peak heap size (like CUDA's caching allocator). The environment variables
    ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` do the same without code.

    Returns True when the settings were applied (glibc), False elsewhere.
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, int(threshold_bytes)) == 1
    ok = (mallopt(_M_TRIM_THRESHOLD, int(threshold_bytes) * 2) == 1) and ok
    return ok
