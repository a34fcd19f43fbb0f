"""Text tokenizer: the model's own ``CosyVoice-BlankEN`` Qwen2 BPE via ``AutoTokenizer`` (spec §2.3).

The family's special tokens are registered exactly as the reference does (``add_special_tokens``
in :data:`special_tokens.family_specials` order; already-present tokens keep their ids), then
every id the runtime uses is *read back* from the tokenizer and checked: ``<|endofprompt|>`` must
be the id the CV3 LLM hard-codes, and the vocabulary size must be the family's.
"""
from __future__ import annotations

import logging
from pathlib import Path

from cosyvoice_runtime.config import ENDOFPROMPT_TOKEN_ID
from cosyvoice_runtime.errors import ModelLoadError
from cosyvoice_runtime.frontend.special_tokens import (
    ENDOFPROMPT,
    EOS_TOKEN,
    EXPECTED_VOCAB_SIZE,
    QWEN_BASE_SPECIALS,
    Family,
    family_specials,
)

logger = logging.getLogger(__name__)


class TextTokenizer:
    """``encode(text) -> list[int]`` with no BOS/EOS and special tokens never split.

    Args:
        tokenizer_dir: ``<model_dir>/CosyVoice-BlankEN`` (read offline).
        family: ``"cosyvoice2"`` or ``"cosyvoice3"``: selects the special-token list and checks.
    """

    def __init__(self, tokenizer_dir: str | Path, family: Family) -> None:
        from transformers import AutoTokenizer

        self.family = family
        path = Path(tokenizer_dir)
        try:
            tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except Exception as exc:
            raise ModelLoadError(path, f"cannot load the text tokenizer: {exc}") from exc
        specials = list(QWEN_BASE_SPECIALS[1:]) + list(family_specials(family))
        tok.add_special_tokens({"eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN,
                                "additional_special_tokens": specials})
        self._tok = tok
        self.special_token_ids: dict[str, int] = {t: int(tok.convert_tokens_to_ids(t))
                                                  for t in (*QWEN_BASE_SPECIALS, *family_specials(family))}
        self.endofprompt_id = self.special_token_ids[ENDOFPROMPT]
        if self.endofprompt_id != ENDOFPROMPT_TOKEN_ID:
            raise ModelLoadError(path, f"{ENDOFPROMPT} has id {self.endofprompt_id}, the {family} LLM "
                                       f"expects {ENDOFPROMPT_TOKEN_ID}")
        if len(tok) != EXPECTED_VOCAB_SIZE[family]:
            raise ModelLoadError(path, f"tokenizer has {len(tok)} entries after registering the {family} "
                                       f"special tokens, expected {EXPECTED_VOCAB_SIZE[family]}")
        logger.info("text tokenizer %s: %d entries, %s=%d", path, len(tok), ENDOFPROMPT, self.endofprompt_id)

    def __len__(self) -> int:
        return len(self._tok)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (plain ``tokenizer([text])["input_ids"][0]``)."""
        return list(self._tok([text], add_special_tokens=False)["input_ids"][0])

    def count(self, text: str) -> int:
        """Length measure of English pieces in sentence splitting (spec §2.2)."""
        return len(self.encode(text))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
