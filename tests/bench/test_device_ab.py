"""bench/device_ab.sh on the CPU: the command runs on the tree as sent, then with the change
reverted, each arm's files in its own folder, and the tree is restored (also after a failing arm);
a missing or stale patch stops it before anything runs."""
from __future__ import annotations

import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "device_ab.sh"
CMD = 'cat code.py > "$OUT/seen.txt"'


def _tree(tmp_path: Path) -> tuple[Path, Path]:
    """A tree whose code.py has the change, and its patch under .ab/."""
    tree, out = tmp_path / "tree", tmp_path / "out"
    tree.mkdir()
    out.mkdir()
    (tree / ".ab").mkdir()
    (tree / ".ab" / "change.patch").write_text(
        "--- a/code.py\n+++ b/code.py\n@@ -1 +1 @@\n-x = 'old'\n+x = 'new'\n")
    (tree / "code.py").write_text("x = 'new'\n")
    return tree, out


def _run(tree: Path, out: Path, cmd: str) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "OUT": str(out), "AB_CMD": cmd}
    # check=False: the tests read the status (an arm's failure, a refused patch)
    return subprocess.run(["bash", str(SCRIPT)], check=False, cwd=tree, env=env, capture_output=True, text=True,
                          timeout=60)


def test_both_arms_run_apart_and_the_tree_is_restored(tmp_path):
    tree, out = _tree(tmp_path)
    done = _run(tree, out, CMD)
    assert done.returncode == 0, done.stderr
    assert (out / "new" / "seen.txt").read_text() == "x = 'new'\n"
    assert (out / "old" / "seen.txt").read_text() == "x = 'old'\n"
    assert (tree / "code.py").read_text() == "x = 'new'\n"


def test_a_failing_old_arm_still_restores_the_tree(tmp_path):
    tree, out = _tree(tmp_path)
    done = _run(tree, out, CMD + ' && grep -q new code.py')  # fails in the old arm only
    assert done.returncode != 0
    assert (out / "old" / "seen.txt").read_text() == "x = 'old'\n"
    assert (tree / "code.py").read_text() == "x = 'new'\n"


def test_a_missing_or_stale_patch_runs_nothing(tmp_path):
    tree, out = _tree(tmp_path)
    (tree / "code.py").write_text("x = 'other'\n")  # the patch no longer reverts
    stale = _run(tree, out, CMD)
    assert stale.returncode == 2 and "does not revert cleanly" in stale.stderr
    (tree / ".ab" / "change.patch").unlink()
    missing = _run(tree, out, CMD)
    assert missing.returncode == 2 and "no .ab/change.patch" in missing.stderr
    assert not (out / "new").exists() and (tree / "code.py").read_text() == "x = 'other'\n"
