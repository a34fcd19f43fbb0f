"""The mode table and CosyVoice3's prefix (cosyvoice_runtime/frontend/prompt_rules.py, spec §1.2)."""
from __future__ import annotations

from cosyvoice_runtime.frontend.prompt_rules import CV3_SYSTEM_PROMPT, MODES, instruct_prompt, with_cv3_prefix


def test_mode_table_matches_the_spec():
    assert MODES["zero_shot"] == MODES["voice"] == (True, True)  # transcript + prompt speech
    assert MODES["cross_lingual"] == MODES["instruct"] == (False, False)
    assert set(MODES) == {"zero_shot", "voice", "cross_lingual", "instruct"}


def test_cv3_prefix_only_for_cosyvoice3_and_only_once():
    assert with_cv3_prefix("cosyvoice2", "hello") == "hello"
    assert with_cv3_prefix("cosyvoice3", "hello") == f"{CV3_SYSTEM_PROMPT}<|endofprompt|>hello"
    assert with_cv3_prefix("cosyvoice3", "sys<|endofprompt|>hello") == "sys<|endofprompt|>hello"
    assert with_cv3_prefix("cosyvoice3", "x", system_prompt="Be brief.") == "Be brief.<|endofprompt|>x"


def test_instruction_is_closed_once():
    assert instruct_prompt("  speak slowly ") == "speak slowly<|endofprompt|>"
    assert instruct_prompt("speak slowly<|endofprompt|>") == "speak slowly<|endofprompt|>"
