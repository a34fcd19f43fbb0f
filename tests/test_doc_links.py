"""Every link of the README, the docs and the results' record resolves to a file of the repository,
the latest files name reports that exist, and bench/results holds nothing loose."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from bench import results_index

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), RESULTS / "INDEX.md",
         *sorted(RESULTS.glob("*/*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
# a path under bench/results written out in prose or code spans (placeholders such as <date> and
# globs are not paths)
RESULTS_PATH = re.compile(r"bench/results/[\w.\-/]+")


def _links(page: Path) -> list[str]:
    return [t for t in LINK.findall(page.read_text()) if not re.match(r"[a-z]+:|#", t)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_link_resolves(page):
    missing = [t for t in _links(page) if not (page.parent / t.split("#")[0]).exists()]
    assert not missing, f"{page.relative_to(REPO)} links to missing files: {missing}"


@pytest.mark.parametrize("page", [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))],
                         ids=lambda p: str(p.relative_to(REPO)))
def test_every_results_path_named_in_prose_exists(page):
    named = {m.rstrip(".") for m in RESULTS_PATH.findall(page.read_text())}
    missing = sorted(p for p in named if not (REPO / p).exists())
    assert not missing, f"{page.relative_to(REPO)} names missing readings: {missing}"


@pytest.mark.parametrize("name", ["latest.json", "cosyvoice3-latest.json"])
def test_the_latest_files_name_reports_that_exist(name):
    doc = json.loads((RESULTS / name).read_text())
    reports = [doc["report"], *doc.get("capacity_reports", []),
               *(v for k, v in doc.items() if k.startswith("capacity_report_") and not k.endswith("_note"))]
    assert reports
    assert [r for r in reports if not (RESULTS / r).is_file()] == []


def test_the_results_hold_run_folders_and_an_index_that_is_current():
    assert results_index.loose_files() == []
    assert (RESULTS / "INDEX.md").read_text() == results_index.render(), \
        "bench/results/INDEX.md is stale (a run added, or a page now cites one): python -m bench.results_index"
    for run in results_index.read_runs():
        folder = RESULTS / run["run"]
        assert run["main"] in run["files"] and (folder / run["main"]).is_file(), run["run"]
        assert {"date", "device", "commit", "command", "config"} <= run.keys(), run["run"]
