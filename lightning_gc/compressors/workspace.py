"""Reusable scratch buffers for the codecs.

Why: on CPU, a fresh tensor above glibc's mmap threshold (32 MiB at most; an 11M-element fp32 group
is 44 MB) is mapped fresh by the kernel on every allocation and every page faults on first touch,
several times the cost of one streaming pass over the same memory (compare with ``python -m
lightning_gc.bench.codec``). Codecs therefore keep their large *intermediates* in buffers reused
across steps.

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


_HUGE = 1 << 21  # x86-64 / arm64 transparent huge page size
_MADV_HUGEPAGE = 14
_madvise = None


def _get_madvise():
    global _madvise
    if _madvise is None:
        _madvise = False
        try:
            import ctypes
            import ctypes.util
            import sys

            if sys.platform.startswith("linux"):
                libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
                fn = libc.madvise
                fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                fn.restype = ctypes.c_int
                _madvise = fn
        except (OSError, AttributeError):
            _madvise = False
    return _madvise


def empty_output(numel: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> Tensor:
    """``torch.empty`` for a large *result* tensor, asking Linux to back it with huge pages.

    A fresh group-sized result is mapped from the kernel and faults in 4 KiB pages on first write
    (many times one ``torch.add`` pass into an existing tensor); with ``MADV_HUGEPAGE`` on the
    still-untouched mapping it faults in 2 MiB pages, far fewer faults. Only the tensor's own
    page-aligned interior is advised, nothing process-wide changes, and where the call is
    unavailable (not Linux, transparent huge pages off) it is a plain ``torch.empty``.
    """
    out = torch.empty(numel, dtype=dtype, device=device)
    nbytes = numel * out.element_size()
    if out.device.type == "cpu" and nbytes >= 4 * _HUGE:
        fn = _get_madvise()
        if fn:
            ptr = out.data_ptr()
            start = (ptr + _HUGE - 1) & ~(_HUGE - 1)
            end = (ptr + nbytes) & ~(_HUGE - 1)
            if end > start:
                fn(start, end - start, _MADV_HUGEPAGE)  # advisory: failure changes nothing
    return out


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
    ``g + e``, a decompressed or aggregated gradient — drops to about the cost of one
    ``torch.add`` into an existing tensor on large groups. The price: the process keeps its
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
