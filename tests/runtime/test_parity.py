"""Parity with the official implementation: every case of the fixture set, none skipped."""
from __future__ import annotations

import pytest

from tests.runtime.parity import checkers  # noqa: F401  (registers every checker)
from tests.runtime.parity.common import CHECKERS, ParityCase, load_cases

CASES = load_cases()


def test_fixture_set_is_not_empty():
    assert CASES, "index.json lists no cases"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_parity_case(case: ParityCase):
    check = CHECKERS.get(case.name)
    if check is None:
        pytest.fail(f"no parity checker for case '{case.name}' ({case.id}); the runtime cannot run it")
    check(case)
