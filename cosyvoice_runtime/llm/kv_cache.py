"""Preallocated key/value cache of the Qwen2 backbone.

One fixed buffer per layer holds ``num_slots`` sequences of at most ``max_len`` positions:
``k[layer]`` / ``v[layer]`` have shape ``(num_slots, num_kv_heads, max_len, head_dim)``. A
sequence owns one slot for its whole life; new keys/values are written in place at the slot's
current length, so nothing is ever concatenated or reallocated while decoding. The current
length of every slot is kept host-side (plain ints): it is the position of the next token and is
needed on the host anyway to size the attention window.

A layer's keys and values live in one buffer ``kv[layer]`` of shape ``(num_slots, 2, heads,
max_len, head_dim)`` (``k``/``v`` are views of it) so that the CUDA-graph decode step stores a
batch's new keys and values with one write per layer and gathers their windows with one
index_select, moving 8-byte words (:meth:`KVCache.write_at`).

The cache is request state, not model state: it is passed into
:meth:`cosyvoice_runtime.llm.model.Qwen2Model.forward`, which writes into it and advances the
lengths of the slots it was given.
"""
from __future__ import annotations

import torch


class KVCache:
    """Fixed ``slots x max_len`` key/value buffers for every layer (written in place)."""

    def __init__(self, num_layers: int, num_slots: int, max_len: int, num_kv_heads: int, head_dim: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        if num_slots < 1 or max_len < 1:
            raise ValueError(f"KVCache needs at least one slot and one position, got {num_slots} x {max_len}")
        shape = (num_slots, 2, num_kv_heads, max_len, head_dim)
        self.kv = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        # The gather reinterprets each key/value row as 8-byte words when the row's bytes allow it.
        self._words = torch.int64 if head_dim * self.kv[0].element_size() % 8 == 0 else None
        self.num_slots = num_slots
        self.max_len = max_len
        self.lengths = [0] * num_slots

    @classmethod
    def for_model(cls, model, num_slots: int, max_len: int, device=None, dtype=None) -> KVCache:
        """A cache sized for a :class:`~cosyvoice_runtime.llm.model.SpeechLM` (or its backbone)."""
        spec = model.backbone_spec
        ref = next(model.parameters())
        return cls(spec.num_layers, num_slots, max_len, spec.num_kv_heads, spec.head_dim,
                   device=ref.device if device is None else device, dtype=ref.dtype if dtype is None else dtype)

    @property
    def k(self) -> list[torch.Tensor]:
        """Each layer's keys, ``(num_slots, heads, max_len, head_dim)`` views of ``kv``."""
        return [kv[:, 0] for kv in self.kv]

    @property
    def v(self) -> list[torch.Tensor]:
        return [kv[:, 1] for kv in self.kv]

    @property
    def device(self) -> torch.device:
        return self.kv[0].device

    @property
    def dtype(self) -> torch.dtype:
        return self.kv[0].dtype

    def reset(self, slot: int) -> None:
        """Forget a slot's contents (stale values stay in memory but are never attended to)."""
        self.lengths[slot] = 0

    def check_room(self, slots: list[int], new_tokens: int) -> None:
        for s in slots:
            if self.lengths[s] + new_tokens > self.max_len:
                raise ValueError(
                    f"KV slot {s} holds {self.lengths[s]} positions, {new_tokens} more exceed max_len {self.max_len}"
                )

    def write(self, layer: int, slots: list[int], slot_index: torch.Tensor | None, positions: torch.Tensor,
              kv: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Store new keys/values and return each sequence's keys/values up to its new end.

        Args:
            slots: the B slots, host-side.
            slot_index: the same as a long tensor on the cache device (None when B == 1).
            positions: (B, T) long, the absolute positions of the new tokens.
            kv: (B, 2, num_kv_heads, T, head_dim) new keys ([:, 0]) and values ([:, 1]).
            total: key positions to return, at least the longest new length of the batch.

        Returns:
            keys, values: (B, num_kv_heads, total, head_dim); positions past a sequence's own
            end hold stale data and must be masked.
        """
        cache = self.kv[layer]
        t = kv.shape[3]
        if len(slots) == 1:
            s, start = slots[0], self.lengths[slots[0]]
            cache[s, :, :, start:start + t] = kv[0]
            window = cache[s:s + 1, :, :, :total]
        else:
            # (B, T) advanced indices around full slices -> index result is (B, T, 2, heads, dim).
            rows = slot_index[:, None].expand(-1, t)
            cache[rows, :, :, positions] = kv.permute(0, 3, 1, 2, 4)
            window = cache[slot_index, :, :, :total]
        return window[:, 0], window[:, 1]

    def write_at(self, layer: int, slot_index: torch.Tensor, positions: torch.Tensor, kv: torch.Tensor,
                 window: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Store one new key/value per row at tensor positions; return a fixed key window.

        Tensors only, no host ints, so that it can be captured in a CUDA graph.

        Args:
            slot_index: (B,) long slot of each row (rows may repeat a scratch slot).
            positions: (B,) long position of each row's new token.
            kv: (B, 2, num_kv_heads, 1, head_dim) the new keys ([:, 0]) and values ([:, 1]).
            window: key positions to return (static).

        Returns:
            keys, values: (B, num_kv_heads, window, head_dim), gathered from the slots; keys past
            a row's position are stale and must be masked.
        """
        cache = self.kv[layer]
        # Advanced indices at dims 0 and 3 around full slices: the indexed shape is (B, 2, heads,
        # dim), keys and values in one write.
        cache[slot_index, :, :, positions] = kv[:, :, :, 0]
        # One gather for keys and values, as 8-byte words: PyTorch's index_select moves one element
        # per thread, and two bf16 gathers per layer were the top kernel of a loaded decode step
        # (docs/tuning.md §1, "Under load").
        src = cache[:, :, :, :window]
        if self._words is not None:
            src = src.view(self._words)
        both = src.index_select(0, slot_index).view(self.dtype)
        return both[:, 0], both[:, 1]

    def write_prefix(self, layer: int, slot_index: torch.Tensor,
                     kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store T keys/values per row (kv: (B, 2, heads, T, dim)) at positions 0..T-1 of its slot
        (an empty slot's prompt).

        Tensors only, so that it can be captured in a CUDA graph; rows may repeat a scratch slot.
        Returns the new keys and values themselves: a fresh prompt attends to nothing older.
        """
        t = kv.shape[3]
        self.kv[layer][:, :, :, :t].index_copy_(0, slot_index, kv)
        return kv[:, 0], kv[:, 1]

    def advance(self, slots: list[int], new_tokens: int) -> None:
        for s in slots:
            self.lengths[s] += new_tokens
