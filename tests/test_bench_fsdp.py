"""The bench's FSDP2 methods (lightning_gc/bench/fsdp.py): parsing, strategies and the byte model.

Oracles: the spelling rules of docs/fsdp.md, and the ring all-reduce's bytes written out by hand for
the native HSDP baselines (the shard, 1/shard_ranks of the gradient, all-reduced across the hosts).
"""

from __future__ import annotations

import pytest

from lightning_gc.bench.fsdp import NativeHSDPStrategy
from lightning_gc.bench.methods import (
    MethodError,
    MethodSpec,
    analytic_bytes_per_step,
    build_strategy,
    parse_methods,
)
from lightning_gc.model_parallel import GCModelParallelStrategy


def test_fsdp_methods_parse_and_build():
    specs = parse_methods("hsdp,hsdp_bf16,fsdp_topk:ratio=0.05,fsdp_qsgd:levels=15", default_ratio=None)
    assert [(s.name, s.gc) for s in specs] == [("hsdp", False), ("hsdp_bf16", False), ("fsdp_topk", True),
                                               ("fsdp_qsgd", True)]
    native, native16, topk, qsgd = (build_strategy(s) for s in specs)
    assert type(native) is NativeHSDPStrategy and native.reduce_dtype is None
    assert native16.reduce_dtype == "bfloat16"
    assert type(topk) is GCModelParallelStrategy and topk.compression.ratio == 0.05
    assert qsgd.compression.compressor_args == {"levels": 15}


@pytest.mark.parametrize("text,fragment", [
    ("fsdp_nosuch", "'nosuch' is not a lightning_gc compressor"),
    ("fsdp_topk:ratio", "is not KEY=VALUE"),
])
def test_bad_fsdp_methods_are_refused_when_parsed(text, fragment):
    with pytest.raises(MethodError, match=fragment):
        parse_methods(text, default_ratio=None)


def test_a_compressor_refused_between_replicas_fails_with_the_reason():
    with pytest.raises(MethodError, match="with collective=.marsit. is not supported"):
        build_strategy(MethodSpec("fsdp_marsit", {}, gc=True))
    with pytest.raises(MethodError, match="takes no options"):
        build_strategy(MethodSpec("hsdp", {"ratio": 0.1}))


@pytest.mark.parametrize("name,width", [("hsdp", 4), ("hsdp_bf16", 2)])
@pytest.mark.parametrize("hosts,ranks", [(2, 4), (4, 8), (1, 4)])
def test_native_hsdp_bytes_between_hosts(name, width, hosts, ranks):
    d = 1000
    shard = width * d / (ranks // hosts)
    want = 2 * (hosts - 1) / hosts * shard
    assert analytic_bytes_per_step(MethodSpec(name), ranks, d, hosts=hosts) == pytest.approx(want)
