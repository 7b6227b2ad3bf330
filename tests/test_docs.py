"""The docs equal the code: argument table, alias list, `--help`, TensorBoard tags, documented
signatures and preset figures are checked against the code they describe (no processes spawned).

Oracles: the tables are parsed from the Markdown as a reader sees them, and compared with what
Python itself reports (``inspect.signature``, Lightning's strategy registry, the directory listing),
never with a list kept in the code under test.
"""

from __future__ import annotations

import ast
import inspect
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from lightning.pytorch.strategies import StrategyRegistry

from lightning_gc import GCStrategy
from lightning_gc.cli import DOC_PAGES, help_text, list_text, sync_models
from lightning_gc.compressors import available_compressors
from lightning_gc.plans import available_planners

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"


def _table(text: str, header_start: str) -> list[list[str]]:
    """Rows (cells stripped) of the first Markdown table whose header line starts with ``header_start``."""
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(header_start))
    rows = []
    for ln in lines[start + 2:]:
        if not ln.startswith("|"):
            break
        rows.append([c.strip() for c in re.split(r"(?<!\\)\|", ln.strip())[1:-1]])
    return rows


# ---------------------------------------------------------------- getting-started.md: arguments
def _own_parameters() -> dict[str, inspect.Parameter]:
    params = inspect.signature(GCStrategy.__init__).parameters
    return {n: p for n, p in params.items() if p.kind is p.KEYWORD_ONLY}


def test_argument_table_has_every_keyword_argument_and_its_default():
    rows = _table((DOCS / "getting-started.md").read_text(), "| argument |")
    documented: dict[str, str] = {}
    for names, default, _meaning in rows:
        found = re.findall(r"`([^`]+)`", names)
        cells = [c.strip() for c in default.split(",")] if len(found) > 1 else [default]
        for i, name in enumerate(found):
            documented[name] = cells[i] if i < len(cells) else ""
    own = _own_parameters()
    assert set(documented) == set(own) | {"**kwargs"}, (
        f"docs/getting-started.md's argument table differs from GCStrategy's keyword-only arguments: "
        f"undocumented {sorted(set(own) - set(documented))}, not in the signature "
        f"{sorted(set(documented) - set(own) - {'**kwargs'})}")
    checked = 0
    for name, cell in documented.items():
        if name == "**kwargs":
            continue
        try:  # a literal default cell ("topk", 8192, True, None, 0.5) must equal the signature's
            value = ast.literal_eval(cell.strip("`"))
        except (ValueError, SyntaxError):
            continue  # prose ("compressor default (0.01)")
        assert value == own[name].default, f"{name}: documented default {cell}, signature {own[name].default!r}"
        checked += 1
    assert checked >= 15  # most cells are literals: the comparison is not vacuous


# ---------------------------------------------------------------- getting-started.md: aliases
def test_alias_list_matches_the_registry():
    text = (DOCS / "getting-started.md").read_text()
    section = text[text.index("Aliases ("):text.index("`import lightning_gc` must run")]
    bullets = [b for b in section.split("\n* ")[1:]]
    families = [re.findall(r"`(gc_[a-z0-9_<>]+)`", b) for b in bullets]
    listed = [n[3:] for n in families[0][1:]]  # the first bullet names the family, then every member
    assert families[0][0] == "gc_<compressor>"
    assert listed == available_compressors()
    expected: set[str] = set()
    for names in families:
        for name in names:
            if "<compressor>" in name:
                expected |= {name.replace("<compressor>", c) for c in listed}
            else:
                expected.add(name)
    registered = {n for n, e in StrategyRegistry.items()
                  if isinstance(e["strategy"], type) and issubclass(e["strategy"], GCStrategy)}
    assert expected == registered, (f"in the registry, not in docs: {sorted(registered - expected)}; "
                                    f"in docs, not registered: {sorted(expected - registered)}")


# ---------------------------------------------------------------- --help, list, index
def test_help_names_every_compressor_plan_sync_model_and_doc_page():
    text = help_text()
    words = set(re.findall(r"[a-z_0-9.\-]+", text))
    for name in [*available_compressors(), *available_planners(), *sync_models()]:
        assert name in words or name in text, f"lightning-gc --help does not name {name!r}"
    assert "lightning_gc.AdaptiveRatio" in text and "GCFabricStrategy" in text
    pages = sorted(p.name for p in DOCS.glob("*.md"))
    assert sorted(DOC_PAGES) == pages, (
        "lightning_gc/cli.py DOC_PAGES must list every page of docs/ (add a line for a new page): "
        f"missing {sorted(set(pages) - set(DOC_PAGES))}, gone {sorted(set(DOC_PAGES) - set(pages))}")
    for page in pages:
        assert page in text


def test_sync_models_read_from_the_signature_are_accepted():
    assert {"bsp", "osp"} <= set(sync_models())
    for sync in sync_models():
        assert GCStrategy(sync=sync).config.sync == sync
    with pytest.raises(ValueError, match="sync="):
        GCStrategy(sync="nope")


def test_list_points_to_the_decision_guide():
    assert "docs/choosing.md" in list_text().splitlines()[0]
    assert (DOCS / "choosing.md").is_file()


def test_index_and_readme_link_every_page():
    index = (DOCS / "index.md").read_text()
    readme = (REPO / "README.md").read_text()
    for page in DOCS.glob("*.md"):
        if page.name != "index.md":
            assert f"]({page.name})" in index, f"docs/index.md does not link {page.name}"
        assert f"](docs/{page.name})" in readme, f"README.md does not link docs/{page.name}"


# ---------------------------------------------------------------- monitoring.md: every tag
def test_monitoring_page_names_every_tag_the_code_logs():
    page = (DOCS / "monitoring.md").read_text()
    src = (REPO / "lightning_gc" / "callbacks" / "monitor.py").read_text()
    tags = set(re.findall(r'"(gc/[a-z_]+)"', src))
    # compressor-specific values are logged as gc/<key> (StepStats.compressor_metrics)
    for path in (REPO / "lightning_gc" / "comm").glob("*.py"):
        tags |= {f"gc/{k}" for k in re.findall(r'metrics(?:\[|\.get\(|\.setdefault\()"([a-z_]+/[a-z_]+)"',
                                                path.read_text())}
    from lightning_gc.callbacks.fidelity import FIDELITY_KEYS

    tags |= {f"gc/fidelity/{k}" for k in FIDELITY_KEYS}  # GradientFidelity logs gc/fidelity/<key>
    assert len(tags) > 25
    missing = sorted(t for t in tags if f"`{t}`" not in page)
    assert not missing, f"docs/monitoring.md does not describe {missing}"


# ---------------------------------------------------------------- workloads.md: signatures and presets
def _documented_signatures(text: str) -> dict[str, dict[str, object]]:
    out = {}
    for block in re.findall(r"```python\n(.*?)```", text, flags=re.S):
        m = re.match(r"\s*([A-Z]\w+)\((.*)\)\s*$", block, flags=re.S)
        if not m:
            continue
        tree = ast.parse(f"def f({m.group(2)}): pass")
        args = tree.body[0].args
        defaults = dict(zip([a.arg for a in args.args][-len(args.defaults):], args.defaults)) if args.defaults else {}
        out[m.group(1)] = {k: ast.literal_eval(v) for k, v in defaults.items()}
    return out


def test_workload_signatures_in_the_docs_are_the_code():
    import lightning_gc.examples as ex

    sigs = _documented_signatures((DOCS / "workloads.md").read_text())
    assert {"MLPClassifier", "TeacherClassificationData", "ByteLM", "StdlibTextData"} <= set(sigs)
    for cls_name, documented in sigs.items():
        params = inspect.signature(getattr(ex, cls_name).__init__).parameters
        actual = {n: p.default for n, p in params.items() if n != "self" and p.default is not p.empty}
        actual = {n: (list(v) if isinstance(v, tuple) else v) for n, v in actual.items()}
        documented = {n: (list(v) if isinstance(v, tuple) else v) for n, v in documented.items()}
        assert documented == actual, f"{cls_name}: docs/workloads.md {documented} vs code {actual}"


def test_preset_table_is_describe_presets():
    from lightning_gc.examples import describe_presets

    rows = {r[0].strip("`"): r for r in _table((DOCS / "workloads.md").read_text(), "| preset")}
    presets = {d["name"]: d for d in describe_presets()}
    assert set(rows) == set(presets), f"docs/workloads.md's Summary table needs a row per preset: {sorted(presets)}"
    for name, d in presets.items():
        _, model, data, params, metric, target, batch = rows[name][:7]
        assert (model.strip("`"), data.strip("`")) == (d["model"], d["data"])
        assert int(params.replace(",", "")) == d["params"]
        assert metric == f"`{d['metric']}` ({d['mode']})"
        assert float(target) == d["target"]
        assert int(batch.split()[0]) == d["batch_size"]


# ---------------------------------------------------------------- word limits, the record, links
# Words are counted as `wc -w` counts them: runs of non-whitespace bytes, code blocks included (a
# guide's commands are part of what a reader reads).
README_WORDS = 1000
GUIDE_WORDS = 2500
GUIDES = ("getting-started", "choosing", "auto", "auto-diloco", "compressors", "monitoring", "fabric",
          "diloco", "osp", "omgs", "adaptive", "multi-node", "bench", "gpu")


def _words(path: Path) -> int:
    return len(path.read_bytes().split())


def test_words_are_counted_as_wc_does(tmp_path):
    sample = tmp_path / "sample.md"
    sample.write_bytes("one  two\tthree\n```bash\nfour --five\n```\n\u00e9six\n".encode())
    assert _words(sample) == 8  # code fences and their commands count, as in wc -w
    wc = shutil.which("wc")
    if wc is None:
        pytest.skip("no wc on this machine to compare with")
    def wc_words(path: Path) -> int:
        out = subprocess.run([wc, "-w", str(path)], capture_output=True, text=True, check=True,
                             env={"LC_ALL": "C.UTF-8"})
        return int(out.stdout.split()[0])

    sign = tmp_path / "sign.md"
    sign.write_bytes("a \u2265 b\n".encode())  # a lone non-ASCII word: wc counts it only in a UTF-8 locale
    if wc_words(sign) != 3:
        pytest.skip("wc has no UTF-8 locale here to compare with")
    for path in (sample, sign, REPO / "README.md", DOCS / "auto.md", DOCS / "choosing.md"):
        assert _words(path) == wc_words(path), path


def test_readme_is_a_front_page():
    words = _words(REPO / "README.md")
    assert words <= README_WORDS, f"README.md has {words} words (wc -w); at most {README_WORDS}"


@pytest.mark.parametrize("guide", GUIDES)
def test_guide_within_its_word_limit(guide):
    words = _words(DOCS / f"{guide}.md")
    assert words <= GUIDE_WORDS, (f"docs/{guide}.md has {words} words (wc -w, code blocks included); at most "
                                  f"{GUIDE_WORDS}: move run-by-run figures to docs/measurements/{guide}.md")


# A measured run is named by its date, device and command, never by the sitting it came from
# ("a fourth session", "this session's checks"). The step session of the engine and the word in
# Lightning's or torch's own sense are not caught: only a plural, or a singular with a qualifier
# that counts or places a sitting.
_SITTING = re.compile(
    r"\b(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|\d+(?:st|nd|rd|th)|this|that|"
    r"previous|next|last|later|earlier|same|one|another|other|each|every|these|those|GPU)\s+sessions?\b"
    r"|\bsessions\b", re.IGNORECASE)


def _doc_files() -> list[str]:
    return [f.relative_to(REPO).as_posix() for f in [REPO / "README.md", *sorted(DOCS.rglob("*.md"))]]


def test_sitting_pattern_catches_what_it_should():
    for bad in ("A fourth session reran it", "this session's checks", "in the same session",
                "## Seventh session: the hand-over", "earlier sessions refused them", "a 3rd session"):
        assert _SITTING.search(bad), bad
    for fine in ("the step session hands the plan", "The session is what DiLoCo's outer step needs",
                 "a Lightning session object"):
        assert not _SITTING.search(fine), fine


@pytest.mark.parametrize("rel", _doc_files())
def test_no_measured_run_is_named_by_its_sitting(rel):
    text = re.sub(r"`[^`\n]*`", "", (REPO / rel).read_text())
    found = [text[max(0, m.start() - 40):m.end() + 20].replace("\n", " ") for m in _SITTING.finditer(text)]
    assert not found, f"{rel} names runs by the sitting they came from (name the date, device, command): {found}"


def _relative_links(text: str) -> list[str]:
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    return [ln.split("#")[0] for ln in links if not ln.startswith(("http:", "https:", "mailto:", "#"))]


@pytest.mark.parametrize("rel", _doc_files())
def test_relative_links_resolve(rel):
    page = REPO / rel
    broken = [ln for ln in _relative_links(page.read_text()) if ln and not (page.parent / ln).exists()]
    assert not broken, f"{rel} links files that do not exist: {broken}"


def test_the_measured_record_is_indexed_and_linked():
    record = DOCS / "measurements"
    index = (record / "README.md").read_text()
    for page in record.glob("*.md"):
        if page.name != "README.md":
            assert f"]({page.name})" in index, f"docs/measurements/README.md does not link {page.name}"
    assert "](docs/measurements/README.md)" in (REPO / "README.md").read_text()
    assert "](measurements/README.md)" in (DOCS / "index.md").read_text()
    for guide in ("auto", "choosing", "compressors"):  # the guides whose figures moved there
        assert f"](measurements/{guide}.md)" in (DOCS / f"{guide}.md").read_text(), guide
