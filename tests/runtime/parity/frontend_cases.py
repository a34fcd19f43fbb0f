"""Parity checkers of the frontend (prompt mel)."""
from __future__ import annotations

import dataclasses

from cosyvoice_runtime.config import MelSpec
from cosyvoice_runtime.frontend.features import prompt_mel
from cosyvoice_runtime.yaml_config import read_model_spec
from tests.runtime.parity.common import ParityCase, assert_matches, checker


def _case_mel_spec(case: ParityCase) -> MelSpec:
    """The model yaml's ``feat_extractor``; every field the case json states overrides it."""
    spec = read_model_spec(case.model_dir).mel
    overrides = {f.name: case.params[f.name] for f in dataclasses.fields(MelSpec) if f.name in case.params}
    return dataclasses.replace(spec, **overrides)


@checker("frontend_mel")
def check_frontend_mel(case: ParityCase) -> None:
    mel_spec = _case_mel_spec(case)
    assert case.params.get("center", False) is False, "only the non-centred Matcha mel is implemented"
    wav = case.t("wav").float()
    assert_matches(case, "feat", prompt_mel(wav, mel_spec))
