"""The streaming chunk schedule (spec §6.1): how many tokens each streamed token2wav call covers.

The first chunk is ``token_hop_len + pad`` tokens with ``pad = ceil(Lp / hop) * hop - Lp`` so that
chunk boundaries fall on the flow's 25-token attention chunks counted from the prompt start; the
hop then grows by ``stream_scale_factor`` up to ``token_max_hop_len``.

Pure arithmetic on ints, shared by :mod:`cosyvoice_runtime.token2wav` (which follows the
schedule per request) and :mod:`cosyvoice_runtime.hift.graphs` (which captures the vocoder
input lengths the schedule produces), so neither imports the other. Also the order of the
step-by-step flow passes (:func:`pick_rows`), used by the serving layer without importing torch.
"""
from __future__ import annotations

import math
from collections.abc import Sequence


def prompt_token_pad(n_prompt_tokens: int, hop: int) -> int:
    """Extra first-chunk tokens that align chunk ends to the flow's attention chunks."""
    return math.ceil(n_prompt_tokens / hop) * hop - n_prompt_tokens


def first_hop(n_prompt_tokens: int, hop: int, min_first_hop: int | None = None) -> int:
    """Tokens of the first streamed chunk.

    Official: ``hop + pad``. With ``min_first_hop``: the smallest ``pad + k * hop`` (k >= 0) that
    is at least ``min_first_hop`` tokens, i.e. the first chunk ends at the first attention-chunk
    boundary past that many tokens. Every chunk end stays on a boundary, so the mel of emitted
    frames is the same as with the official schedule (chunk masks: a frame never sees a later
    chunk); only the first audio comes earlier.
    """
    pad = prompt_token_pad(n_prompt_tokens, hop)
    if min_first_hop is None:
        return hop + pad
    return pad + max(0, math.ceil((max(1, min_first_hop) - pad) / hop)) * hop


def first_chunk_frames(hop: int, token_mel_ratio: int, min_first_hop: int | None = None) -> list[int]:
    """Every vocoder input length (mel frames) a first streamed chunk can have, over all prompt
    lengths: the first hop depends only on the prompt length modulo ``hop``."""
    return sorted({token_mel_ratio * first_hop(n, hop, min_first_hop) for n in range(hop)})


def streaming_lengths(mel_cache_len: int, token_hop_len: int, token_max_hop_len: int, scale: int,
                      token_mel_ratio: int) -> list[int]:
    """Vocoder input lengths (frames) of the streamed calls after the first: cache + 2 x hop."""
    out, hop = [], token_hop_len
    while True:
        out.append(mel_cache_len + token_mel_ratio * hop)
        if hop >= token_max_hop_len or scale <= 1:
            return out
        hop = min(token_max_hop_len, hop * scale)


def final_chunk_frames(mel_cache_len: int, token_max_hop_len: int, lookahead: int, token_mel_ratio: int) -> list[int]:
    """Every vocoder input length a stream's last call can have: the tokens left after the last
    hop (1 to a full hop plus the look-ahead), with the overlap cache or, when the last call is
    also the first, without it."""
    tokens = range(1, token_max_hop_len + lookahead + 1)
    return sorted({token_mel_ratio * r for r in tokens} | {mel_cache_len + token_mel_ratio * r for r in tokens})


def pick_rows(rows: Sequence, deadline_s: dict, now_s: float, slack_s: float, max_batch: int,
              length_ratio: float = 2.0, rider_ratio: float = 1.0) -> list:
    """The rows of the next flow pass (:mod:`cosyvoice_runtime.flow.stepper`,
    :mod:`cosyvoice_runtime.flow.incremental`; anything with ``frames`` and ``kind``): earliest
    deadline first (``deadline_s[id(row)]``).

    A pass runs rows of one kind (recomputed or incremental: one graph each) and size class, the
    most urgent row's: a row no captured bucket holds (``oversize``: it runs eagerly) shares a
    pass only with rows like it, since a pass takes its largest row's shape. While some row of it
    is due within ``slack_s``, the pass is for those rows (a first chunk is due at once), plus riders of at most ``rider_ratio`` times the longest of them (1:
    no longer, so they ride in the same padded bucket for almost nothing); otherwise the earliest
    rows. At most ``max_batch``, and at most ``length_ratio`` times the frames of the most urgent
    row, which the pass pads to.

    Why riders may be longer (``token2wav.rider_ratio``): under load passes carried a fraction of
    the rows in hand (docs/tuning.md §2, ``rider_ratio``), and a pass is bound by its kernel count
    more than by its rows. CosyVoice2's streamed chunks grow (incremental rows of 50, 50, 100,
    then 200 new frames after a kept voice prefix), so at 1 a stream's later chunks never ride
    with the 50-frame first chunks that keep arriving under load: they wait for passes of their
    own. Longer riders pad the urgent pass to their frames: whether that costs first audio more
    than the passes it saves is what the ratio is for measuring.
    """
    order = sorted(rows, key=lambda r: deadline_s[id(r)])
    if not order:
        return []
    order = [r for r in order if _pass_group(r) == _pass_group(order[0])]
    urgent = [r for r in order if deadline_s[id(r)] - now_s < slack_s]
    limit = length_ratio * order[0].frames
    if urgent:
        limit = min(limit, rider_ratio * max(r.frames for r in urgent if r.frames <= limit))
    return [r for r in order if r.frames <= limit][:max_batch]


def _pass_group(row) -> tuple[str, bool]:
    """What rows must share to ride in one pass: kind and size class (rows that carry no
    ``oversize``, e.g. the timed runtime's, are all of the graphed class)."""
    return row.kind, getattr(row, "oversize", False)
