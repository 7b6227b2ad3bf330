"""The configuration tree and its one mapping from flat names (lightning_gc/config.py)."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from lightning_gc import GCStrategy
from lightning_gc.bench.methods import MethodSpec, build_strategy
from lightning_gc.comm.hierarchy import TopologyConfig
from lightning_gc.config import FLAT_FIELDS, CompressionConfig, GCConfig, is_flat_name
from lightning_gc.engine.config import EngineConfig
from lightning_gc.engine.omgs import OMGSConfig
from lightning_gc.sync.diloco import DiLoCoConfig
from lightning_gc.sync.osp import OSPConfig


def test_every_flat_name_is_a_strategy_argument_and_reaches_a_real_field():
    params = inspect.signature(GCStrategy.__init__).parameters
    sections = {"compression": CompressionConfig, "engine": EngineConfig, "osp": OSPConfig, "diloco": DiLoCoConfig,
                "topology": TopologyConfig}
    for name, (section, fld) in FLAT_FIELDS.items():
        assert name in params, name  # the strategy takes it by that name
        if fld is not None:
            assert fld in {f.name for f in dataclasses.fields(sections[section])}, (name, section, fld)
        else:
            assert section in {f.name for f in dataclasses.fields(GCConfig)}, name
    # and every lightning_gc argument of the strategy is in the table (the rest are DDPStrategy's, and
    # config=, the whole tree at once)
    own = [n for n, p in params.items() if p.kind == p.KEYWORD_ONLY and n != "config"]
    assert sorted(own) == sorted(FLAT_FIELDS), set(own) ^ set(FLAT_FIELDS)


def test_from_flat_builds_the_tree_and_round_trips():
    cfg = GCConfig.from_flat(compressor="qsgd", compressor_args={"levels": 3}, plan="layer", warmup_steps=4,
                             sync="osp", osp_round_steps=7, osp_deferred_compressor="topk", nonfinite="propagate")
    assert cfg.compression.compressor == "qsgd" and dict(cfg.compression.compressor_args) == {"levels": 3}
    assert (cfg.engine.plan, cfg.engine.warmup_steps) == ("layer", 4)
    assert (cfg.engine.collective, cfg.engine.error_feedback) == ("allgather", False)  # resolved: QSGD's packed levels
    assert (cfg.sync, cfg.osp.round_steps, cfg.osp.deferred_compressor) == ("osp", 7, "topk")
    assert cfg.nonfinite == "propagate" and cfg.omgs is None
    assert GCConfig.from_flat(**cfg.to_flat()) == cfg


def test_omgs_fields_by_prefix_and_warmup_raised():
    cfg = GCConfig.from_flat(plan="omgs", omgs_profile_steps=4, omgs_profile_skip_steps=1)
    assert cfg.omgs == OMGSConfig(profile_steps=4, profile_skip_steps=1)
    assert cfg.omgs.dense_steps_needed == 0 and cfg.engine.warmup_steps == 1  # compressed-step profile: no raise
    dense = GCConfig.from_flat(plan="omgs", omgs_profile_steps=4, omgs_profile_skip_steps=1, omgs_profile_on="dense")
    assert dense.engine.warmup_steps == dense.omgs.dense_steps_needed == 6
    assert GCConfig.from_flat(omgs={"profile_steps": 3}, omgs_profile_steps=5).omgs.profile_steps == 5  # field wins


@pytest.mark.parametrize(("flat", "match"), [
    ({"ratoi": 0.1}, r"ratoi=0.1 is not a lightning_gc option.*Did you mean ratio\?"),
    ({"osp_round_steps": 5, "osp_deferred_fraction": 0.3}, r"osp_deferred_fraction=0.3 only applies with sync='osp'"),
    ({"sync": "osp", "plan": "omgs"}, r"sync='osp' with plan='omgs' \(OMGS\) is not supported"),
    ({"nonfinite": "ignore"}, r"nonfinite='ignore' is invalid"),
    ({"compressor": "qsgd", "ratio": 0.1}, r"compressor 'qsgd' does not take a ratio"),
    ({"compressor": "topk", "collective": "ring"}, r"ring"),
    ({"monitor": "yes"}, r"monitor='yes' is invalid"),
])
def test_bad_values_are_refused_with_the_value(flat, match):
    with pytest.raises(ValueError, match=match):
        GCConfig.from_flat(**flat)


def test_strategy_and_bench_build_the_same_tree():
    s = GCStrategy(compressor="topk", ratio=0.05, plan="layer", warmup_steps=3, overlap=False)
    assert s.config == GCConfig.from_flat(compressor="topk", ratio=0.05, plan="layer", warmup_steps=3, overlap=False)
    assert s.engine_config is s.config.engine
    bench = build_strategy(MethodSpec(name="topk", options={"ratio": 0.05, "plan": "layer", "warmup_steps": 3,
                                                            "overlap": False}, gc=True))
    assert bench.config == s.config
    assert is_flat_name("omgs_profile_steps") and not is_flat_name("levels")
