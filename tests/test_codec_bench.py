"""The codec micro-benchmark runs on small sizes and produces consistent fields (no timing thresholds:
times on a shared machine are noise; the structure and the derived quantities are checked)."""

from __future__ import annotations

import json
import math

import pytest

from lightning_gc.bench import cli as bench_cli
from lightning_gc.bench.codec import CodecBenchConfig, markdown, parse_size, run_codec_bench
from lightning_gc.compressors import available_compressors


def test_parse_size():
    assert parse_size("1M") == 1_000_000
    assert parse_size("11m") == 11_000_000
    assert parse_size("250k") == 250_000
    assert parse_size("1e6") == 1_000_000
    assert parse_size("4096") == 4096
    for bad in ("", "abc", "0", "-3", "1.5"):
        with pytest.raises(ValueError, match="size"):
            parse_size(bad)


def test_config_validation():
    with pytest.raises(ValueError, match="world_size=0"):
        CodecBenchConfig(world_size=0)
    with pytest.raises(ValueError, match="unknown compressors"):
        CodecBenchConfig(compressors=("tpok",))
    with pytest.raises(ValueError, match="ratio"):
        CodecBenchConfig(ratio=0.0)


def test_micro_benchmark_reports_every_compressor_with_consistent_fields():
    sizes = (5000, 20011)
    cfg = CodecBenchConfig(sizes=sizes, world_size=3, repeats=1, segments=5, ratio=0.05)
    doc = run_codec_bench(cfg)
    json.dumps(doc)  # serialisable
    assert [s["numel"] for s in doc["sizes"]] == list(sizes)
    for s in doc["sizes"]:
        n = s["numel"]
        ref = s["reference"]["add"]
        assert ref["seconds"] > 0 and ref["vs_add"] == pytest.approx(1.0)
        assert ref["elements_per_s"] == pytest.approx(n / ref["seconds"])
        assert ref["bytes_per_s"] == pytest.approx(12 * n / ref["seconds"])
        assert set(s["engine"]) == {"flatten", "flatten_hugepages", "ef_add", "ef_residual", "norm2", "writeback"}
        assert set(s["compressors"]) == set(available_compressors())
        for name, r in s["compressors"].items():
            for key in ("compress", "aggregate", "decompress"):
                t = r[key]
                assert t["seconds"] >= 0 and len(t["runs"]) == 1
                if t["seconds"] > 0:
                    assert t["elements_per_s"] == pytest.approx(n / t["seconds"])
                    assert t["vs_add"] == pytest.approx(t["seconds"] / ref["seconds"])
            # the engine's codec time is the sum of the parts the exchange runs
            parts = r["compress"]["seconds"] + r["aggregate"]["seconds"] + r.get("gather_values", {}).get("seconds", 0)
            parts += r["decompress"]["seconds"] if r["needs_dense_sent"] else 0.0
            assert r["engine_codec_s"] == pytest.approx(parts)
            # marsit: the merged bits are decoded into the mean (η·sign, dense), which is also its sent: one decode
            assert r["needs_dense_sent"] == (r["wire_format"] in ("allreduce", "gradiveq", "lowrank", "marsit")
                                             or name in ("qsgd", "signsgd", "efsignsgd"))
            if r["wire_format"] == "allgather":
                assert "pack" in r and "unpack" in r
        # bytes per element follow the formats: dense 4, casts 2, sign 1/8 + scale, Top-k 8·ratio
        c = s["compressors"]
        # Marsit's aggregate is its ring's merges of packed bits, not AR-Topk's gather at indices (its
        # packed bits were once read as indices there)
        assert "gather_values" not in c["marsit"] and set(c["star_topk"]) >= {"gather_values"}
        assert c["dense"]["bytes_per_element"] == 4.0
        assert c["fp16"]["bytes_per_element"] == 2.0
        assert c["signsgd"]["payload_bytes"] == 4 + math.ceil(n / 8)
        assert c["topk"]["payload_bytes"] == 8 * math.ceil(0.05 * n)
        assert c["randomk"]["payload_bytes"] == 4 * math.ceil(0.05 * n)
    md = markdown(doc)
    assert md.count("## ") == len(sizes)
    for name in available_compressors():
        assert f"| {name} |" in md


def test_cli_entry_points(tmp_path, capsys):
    out = tmp_path / "codec.json"
    md = tmp_path / "codec.md"
    rc = bench_cli.main(["--codec", "--sizes", "3000", "--repeats", "1", "--compressors", "topk,qsgd",
                         "--json", str(out), "--md", str(md)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["schema"] == "lightning_gc.bench.codec/1"
    assert list(doc["sizes"][0]["compressors"]) == ["topk", "qsgd"]
    assert "| qsgd |" in md.read_text()
    assert bench_cli.main(["--codec", "--sizes", "zero"]) == 2
    assert "size 'zero'" in capsys.readouterr().err
