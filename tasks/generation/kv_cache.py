"""A KV cache for the decoding loop that writes each step in place instead of concatenating.

transformers' DynamicLayer grows its keys and values with ``torch.cat`` on every decoded token, copying the whole
cache each step: O(T^2) bytes over a completion, and on the default tiny model (128 rows x 32 new tokens on one
CPU thread) a third of the decoding time went to those copies. :class:`PreallocatedLayer` allocates each layer's
buffers once, for the prompt plus ``extra`` new tokens, writes a step's states into the next free positions and
hands the model views of the filled prefix, so attention sees exactly what DynamicLayer would give it (same
values, same shapes; the tokens sampled are identical, tested). Only plain full-attention layers are replaced;
sliding-window, quantized or linear-attention layers keep transformers' own class.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer


class PreallocatedLayer(DynamicLayer):
    """DynamicLayer whose ``keys``/``values`` are views ``buffer[:, :, :n]`` of buffers sized for the prompt plus
    ``extra`` tokens; a longer sequence than that regrows the buffers (one copy), so it never fails."""

    def __init__(self, extra: int) -> None:
        super().__init__()
        self.extra = extra
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        self._n = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, t = self._n, key_states.shape[-2]
        if self._k is None or n + t > self._k.shape[-2]:
            cap = n + t + self.extra
            k = key_states.new_empty((*key_states.shape[:2], cap, key_states.shape[-1]))
            v = value_states.new_empty((*value_states.shape[:2], cap, value_states.shape[-1]))
            if n:
                k[:, :, :n] = self._k[:, :, :n]
                v[:, :, :n] = self._v[:, :, :n]
            self._k, self._v = k, v
        self._k[:, :, n : n + t] = key_states
        self._v[:, :, n : n + t] = value_states
        self._n = n + t
        self._views()
        return self.keys, self.values

    def _views(self) -> None:
        self.keys, self.values = self._k[:, :, : self._n], self._v[:, :, : self._n]

    def get_seq_length(self) -> int:
        return self._n

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self._n:
            self._k, self._v = self._k[indices], self._v[indices]
            self._views()

    def crop(self, tokens_to_remove: int) -> None:
        """DynamicLayer's crop: a negative value removes that many tokens, a positive one (deprecated there) is
        the length to keep; here only the filled length moves (the buffers stay)."""
        keep = min(tokens_to_remove, self._n) if tokens_to_remove > 0 else self._n + tokens_to_remove
        self._n = max(keep, 0)
        if self._k is not None:
            self._views()

    def reset(self) -> None:
        self._k = self._v = None
        self._n = 0
        super().reset()


def decode_cache(config, extra: int) -> DynamicCache:
    """transformers' DynamicCache for ``config`` with its plain full-attention layers replaced by
    :class:`PreallocatedLayer` (room for ``extra`` tokens after the prompt)."""
    cache = DynamicCache(config=config)
    cache.layers = [PreallocatedLayer(extra) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache
