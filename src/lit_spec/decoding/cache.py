"""The one module that touches transformers' KV cache objects (``DynamicCache`` and its layers).

Everything else in ``lit_spec.decoding`` asks for these operations by meaning: roll back to an accepted prefix, keep
selected entries of the last block (tree acceptance), select rows of a batch.
"""

from __future__ import annotations

import copy
import functools
import inspect

import torch
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import DynamicLayer, StaticLayer

from lit_spec.errors import ConfigError


@functools.cache
def _cache_argument(model_class: type) -> str:
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def cache_argument(model, cache) -> dict:
    """The keyword a model's forward takes its KV cache by: ``cache`` in recent transformers (which warns that
    ``past_key_values`` goes away), ``past_key_values`` before."""
    return {_cache_argument(type(model)): cache}


class GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys/values are views of a buffer that grows by doubling, so a forward appends its new
    entries in place instead of re-concatenating the whole past (``DynamicLayer.update`` copies every layer's cache
    on every forward, which dominates small blocks on CPU). Crop and in-place edits keep the views on the buffer;
    anything that replaces the tensors (row selection) is adopted as a new buffer at the next update. The Chimera
    draft keeps its full-context block's keys/values in one too (``decoding.heads.ChimeraCandidates``)."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length, new = self.get_seq_length(), key_states.size(-2)
        buffers = getattr(self, "_buffers", None)
        if (buffers is None or length + new > buffers[0].size(-2) or buffers[0].shape[:2] != key_states.shape[:2]
                or (length and self.keys.data_ptr() != buffers[0].data_ptr())):
            capacity = max(2 * (length + new), 64)
            buffers = tuple(s.new_empty(*s.shape[:2], capacity, s.size(-1)) for s in (key_states, value_states))
            if length:
                buffers[0][..., :length, :] = self.keys
                buffers[1][..., :length, :] = self.values
            self._buffers = buffers
        keys, values = self._buffers
        keys[..., length: length + new, :] = key_states
        values[..., length: length + new, :] = value_states
        self.keys, self.values = keys[..., : length + new, :], values[..., : length + new, :]
        return self.keys, self.values


def new_cache(model) -> DynamicCache:
    """transformers' ``DynamicCache`` for ``model`` (sliding-window layers as the config says), its full-attention
    layers growing in place (``GrowingLayer``)."""
    cache = DynamicCache(config=model.config)
    cache.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def static_cache(model, length: int) -> StaticCache:
    """transformers' ``StaticCache`` of ``length`` positions for the fast path (``lit_spec.decoding.fast``), every
    layer a plain ``StaticLayer``. A sliding window at least that long never slides, so its layers are plain too; a
    shorter one would make them ring buffers, which rollback by length cannot undo: refused."""
    window = getattr(model.config, "sliding_window", None)
    if window is not None and window < length:
        raise ConfigError(f"the fast decoding path needs {length} cache positions but the model's sliding window is "
                          f"{window}: decode with engine=eager")
    cache = StaticCache(config=model.config, max_cache_len=length)
    cache.layers = [StaticLayer(length) for _ in cache.layers]
    return cache


def copy_prefix(source: StaticCache, target: StaticCache, length: int) -> None:
    """The first ``length`` positions of ``source``'s keys and values written into ``target``, a longer static cache
    of the same model (its layers allocated here if they were not yet)."""
    for old, new in zip(source.layers, target.layers):
        if not old.is_initialized:
            continue
        if not new.is_initialized:
            new.lazy_initialization(old.keys[:, :, :1], old.values[:, :, :1])
        new.keys[:, :, :length] = old.keys[:, :, :length]
        new.values[:, :, :length] = old.values[:, :, :length]


def static_tensors(cache: StaticCache) -> list[torch.Tensor]:
    """Every layer's keys, values and length tensor, in order: what a frozen package takes the cache as."""
    return [t for layer in cache.layers for t in (layer.keys, layer.values, layer.cumulative_length)]


def static_cache_on(cache: StaticCache, tensors) -> StaticCache:
    """A copy of ``cache`` whose layers hold ``tensors`` (``static_tensors``' order) instead of their own: what a
    frozen package's forward is traced on."""
    shell = copy.copy(cache)
    shell.layers = [copy.copy(layer) for layer in cache.layers]
    for i, layer in enumerate(shell.layers):
        layer.keys, layer.values, layer.cumulative_length = tensors[3 * i: 3 * i + 3]
    return shell


def static_layer(attention, length: int, like: torch.Tensor) -> StaticLayer:
    """One static layer of ``length`` positions for a draft's own attention module (EAGLE-3's: ``kv_heads`` heads of
    ``head_dim``), of ``like``'s dtype and device, allocated here, outside compiled code, so that its tensors keep
    static addresses (transformers marks them only there)."""
    layer = StaticLayer(length)
    empty = like.new_empty(1, attention.kv_heads, 0, attention.head_dim)
    layer.lazy_initialization(empty, empty)
    return layer


def set_length(cache: StaticCache | StaticLayer, length: int) -> None:
    """Roll a static cache (or one static layer) back or forward to its first ``length`` positions: only its length
    moves; the stale entries after it are overwritten by the next forward and masked until then."""
    for layer in [cache] if isinstance(cache, StaticLayer) else cache.layers:
        layer.cumulative_length.fill_(length)


def cache_length(cache: DynamicCache) -> int:
    return cache.get_seq_length()


def crop(cache: DynamicCache, length: int) -> None:
    """Roll the cache back to its first ``length`` positions (``DynamicCache.crop`` takes a negative count)."""
    extra = cache_length(cache) - length
    if extra < 0:
        raise ValueError(f"cannot crop a cache of {cache_length(cache)} positions to {length}")
    if extra:
        cache.crop(-extra)


def keep_positions(cache: DynamicCache, start: int, keep: list[int]) -> None:
    """Keep positions ``[0, start)`` and then only ``start + keep`` (in that order), dropping the rest of the block.

    Used after tree verification: the accepted path's entries are scattered in the verified block and are moved to
    form a contiguous prefix. ``keep``: increasing offsets into the block (same for every row). Only the block's
    entries are touched (moved in place, then the tail cut), never the past before ``start``.
    """
    length = start + len(keep)
    moves = _moves(keep)
    for layer in cache.layers:
        if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
            continue
        static = isinstance(layer, StaticLayer)
        if getattr(layer, "is_sliding", False) and layer.get_seq_length() >= layer.sliding_window:
            raise NotImplementedError("keep_positions on a sliding-window layer that has dropped old positions")
        for dst, src, n in moves:
            for t in (layer.keys, layer.values):
                block = t[..., start + src: start + src + n, :]
                t[..., start + dst: start + dst + n, :] = block.clone() if src < dst + n else block
        if static:                                # a static layer keeps its tensors (compiled code holds them)
            layer.cumulative_length.fill_(length)
            continue
        layer.keys, layer.values = layer.keys[..., :length, :], layer.values[..., :length, :]
        if hasattr(layer, "cumulative_length"):    # sliding-window layers (Mistral) count their length themselves
            layer.cumulative_length = length


def _moves(keep: list[int]) -> list[tuple[int, int, int]]:
    """``keep`` (increasing offsets) as slice copies (destination, source, count), one per run of consecutive kept
    offsets that is not already in place: cheaper than a gather, and an accepted path is mostly one or two runs.
    Destinations never pass their sources (dst <= src), so copying the runs in order is safe."""
    runs: list[list[int]] = []
    for dst, src in enumerate(keep):
        if runs and src == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([dst, src, 1])
    return [(dst, src, n) for dst, src, n in runs if dst != src]


def select_rows(cache: DynamicCache, rows: torch.Tensor) -> None:
    """Keep only the given batch rows (finished prompts leave a batched decode)."""
    cache.batch_select_indices(rows)
