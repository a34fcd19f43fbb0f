"""No product module over 450 lines (the house rule, issue 42): a module that grows past it is split
along a seam of what it does, not cut anywhere. bench/ and tests/ are not product code."""
from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PRODUCT_PACKAGES = ("cosyvoice_runtime", "deployments", "serve_app", "fastcosy_cli")
MAX_LINES = 450


def _lines(path: Path) -> int:
    with path.open("rb") as f:
        return sum(1 for _ in f)


def too_long(root: Path, packages=PRODUCT_PACKAGES, limit: int = MAX_LINES) -> dict[str, int]:
    """The product modules under ``root`` longer than ``limit`` lines, with their lengths."""
    return {str(p.relative_to(root)): n for pkg in packages for p in sorted((root / pkg).rglob("*.py"))
            if (n := _lines(p)) > limit}


def test_no_product_module_is_over_450_lines():
    assert all((ROOT / pkg).is_dir() for pkg in PRODUCT_PACKAGES)
    assert too_long(ROOT) == {}, f"split these modules along a seam (at most {MAX_LINES} lines each)"


@pytest.mark.parametrize("n, over", [(MAX_LINES, False), (MAX_LINES + 1, True)])
def test_a_module_one_line_over_is_found(tmp_path, n, over):
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "sub" / "m.py").write_text("x = 1\n" * n)
    (tmp_path / "pkg" / "short.py").write_text("x = 1\n")
    assert too_long(tmp_path, packages=("pkg",)) == ({"pkg/sub/m.py": n} if over else {})
