"""benchmarks/README.md's figures are what benchmarks/results/*.json say (benchmarks/report.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from benchmarks import report

ROOT = Path(__file__).resolve().parents[1]
# a number each generated block shows, by results file and the keys that reach it
SHOWN = [
    ("bench_llama", ["classes", "code", "configs", "adaptive", "tokens_per_s"]),
    ("bench_llama_heldout", ["rss_gb", "target"]),
    ("rows_draft", ["pass_s", "4"]),
    ("chaos", ["tokens_checked"]),
    ("fallback", ["real_pair_code_overall_ratio"]),
    ("ab21_conf_0", ["classes", "prose", "configs", "adaptive", "tokens_per_s"]),
    ("quality", ["texts", "textwrap_py", "engines", "specd", "perplexity"]),
]


@pytest.fixture
def copies(tmp_path) -> list[str]:
    """--results and --readme arguments naming copies of the repository's results and README."""
    shutil.copytree(ROOT / "benchmarks" / "results", tmp_path / "results", ignore=shutil.ignore_patterns("*.png"))
    shutil.copy(ROOT / "benchmarks" / "README.md", tmp_path / "README.md")
    return ["--results", str(tmp_path / "results"), "--readme", str(tmp_path / "README.md")]


def test_the_benchmark_figures_are_the_results():
    assert report.main(["--check"]) == 0, "benchmarks/README.md is stale: run `python -m benchmarks.report`"


@pytest.mark.parametrize("name, keys", SHOWN, ids=[name for name, _ in SHOWN])
def test_a_changed_result_makes_the_figures_stale(copies, name, keys):
    results, readme = Path(copies[1]), Path(copies[3])
    assert report.main(["--check", *copies]) == 0
    path = results / f"{name}.json"
    run = json.loads(path.read_text())
    *parents, last = keys
    holder = run
    for key in parents:
        holder = holder[key]
    holder[last] = holder[last] * 1.5 + 1
    path.write_text(json.dumps(run))
    assert report.main(["--check", *copies]) == 1
    before = readme.read_text()
    assert report.main(copies) == 0  # rewriting the blocks makes the check pass again
    assert readme.read_text() != before and report.main(["--check", *copies]) == 0


def test_text_outside_the_blocks_is_kept_and_a_missing_block_is_refused(copies):
    readme = Path(copies[3])
    text = readme.read_text()
    readme.write_text("A note of the reader's.\n" + text)
    assert report.main(copies) == 0 and readme.read_text().startswith("A note of the reader's.\n")
    start, end = text.index("<!-- generated: chaos -->"), "<!-- end generated -->"
    readme.write_text(text[:start] + text[text.index(end, start) + len(end):])
    with pytest.raises(ValueError, match="chaos"):
        report.main(["--check", *copies])
