"""A growable, slot-based KV cache for the batched decoder.

Layout: per layer one key and one value buffer `[slots, kv_heads, capacity, head_dim]`. Running
requests occupy slots `0..B-1` (no holes: a leaving row is replaced by the last row). All rows
share one write column `end`: a decode step writes every row's new key/value at column `end`,
and row r's context lives at columns `[end - lengths[r], end)` (left padding). The model reads
the view `[:B, :, start:end+1]` where `start = end - max(lengths)`, so padding costs only the
difference between the longest and each row's context, and nothing is concatenated per step
(HF's DynamicCache re-allocates the whole cache every token).

The object is handed to a transformers model as `past_key_values`: attention layers call
`update(key, value, layer_idx)` and get back the keys/values to attend over. The caller passes
the attention mask and position ids itself (see `decode_mask`), so none of the Cache methods
that transformers uses to build masks are needed.

`release()` frees the buffers (the engine's `/release_memory_occupation` with tag `kv_cache`,
allowed only while no row is cached) and `resume()` allocates them again at the shape they had.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache


GROW_COLUMNS = 16  # capacity grows in multiples of this many columns, by two of them at least


class SlotKVCache(Cache):
    """KV cache for `B` left-padded rows sharing one write column (see module docstring)."""

    def __init__(
        self,
        *,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        slots: int = 4,
        capacity: int = 64,
    ) -> None:
        super().__init__(layers=[])
        self.num_layers = num_layers
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.keys = [self._alloc(slots, capacity) for _ in range(num_layers)]
        self.values = [self._alloc(slots, capacity) for _ in range(num_layers)]
        self.lengths: list[int] = []  # tokens cached per active row
        self.end = 0  # next write column
        self._released_shape: tuple[int, int] | None = None  # (slots, capacity) while released

    # -- shape ---------------------------------------------------------------------------------
    def _alloc(self, slots: int, capacity: int) -> torch.Tensor:
        return torch.zeros(
            slots, self.kv_heads, capacity, self.head_dim, dtype=self.dtype, device=self.device
        )

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    @property
    def slots(self) -> int:
        return self.keys[0].shape[0] if self.keys else 0

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    @property
    def nbytes(self) -> int:
        """Bytes the key and value buffers hold (0 while released)."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    @property
    def released(self) -> bool:
        return self._released_shape is not None

    @property
    def start(self) -> int:
        return self.end - max(self.lengths, default=0)

    @property
    def padded_tokens(self) -> int:
        """Cells the attention reads but masks out (the padding overhead of this layout)."""
        width = self.end - self.start
        return width * self.batch_size - sum(self.lengths)

    def _reshape(self, slots: int, capacity: int, shift: int) -> None:
        """Re-allocate to (slots, capacity), moving the live columns right by `shift` (which may
        be negative, to compact). Only the live region [start, end) is copied."""
        b, lo, hi = self.batch_size, self.start, self.end
        for buffers in (self.keys, self.values):
            for i, old in enumerate(buffers):
                new = self._alloc(slots, capacity)
                if b and hi > lo:
                    new[:b, :, lo + shift : hi + shift] = old[:b, :, lo:hi]
                buffers[i] = new
        self.end += shift

    def reserve(self, rows: int, columns: int, min_end: int = 0) -> None:
        """Make room for `rows` active rows and `columns` more write columns, with `end` at least
        `min_end` (a joining row with that many cached tokens must fit left of `end`)."""
        if self.released:
            raise RuntimeError("the KV cache is released (resume it before use)")
        fits = rows <= self.slots and max(self.end, min_end) + columns <= self.capacity
        if fits and self.end >= min_end:
            return
        if fits and self.batch_size == 0:
            self.end = min_end  # nothing live: just move the write column
            return
        # Compact the live region to the left edge, keeping `end` >= min_end. The capacity
        # follows what the rows need (their longest context and the new columns) with a quarter
        # more, instead of doubling past it: the KV cache is most of what an engine grows by,
        # and the quarter keeps compactions (one copy of the live region) a quarter-width apart.
        live = self.end - self.start
        new_end = max(min_end, live)
        slots = self.slots if rows <= self.slots else max(rows, self.slots + max(4, self.slots // 4))
        want = new_end + columns
        capacity = self.capacity
        if want + want // 4 > capacity:
            capacity = -(-(want + max(want // 4, 2 * GROW_COLUMNS)) // GROW_COLUMNS) * GROW_COLUMNS
        self._reshape(slots, capacity, new_end - self.end)

    # -- rows ----------------------------------------------------------------------------------
    def add_rows(self, source: "SlotKVCache", lengths: list[int]) -> None:
        """Append `source`'s rows (a prefilled batch, right-aligned at its own `end`) as new
        rows of this cache. Row i brings its last `lengths[i]` cached tokens."""
        n = len(lengths)
        self.reserve(self.batch_size + n, 1, min_end=max(lengths, default=0))
        b = self.batch_size
        for layer in range(self.num_layers):
            for dst, src in ((self.keys, source.keys), (self.values, source.values)):
                for i, length in enumerate(lengths):
                    dst[layer][b + i, :, self.end - length : self.end] = src[layer][
                        i, :, source.end - length : source.end
                    ]
        self.lengths.extend(lengths)

    def remove_rows(self, rows: list[int]) -> list[tuple[int, int]]:
        """Drop `rows`; the last rows move into the holes. Returns the (old, new) index moves
        so the caller can keep its per-row bookkeeping aligned."""
        moves: list[tuple[int, int]] = []
        lo, hi = self.start, self.end
        for row in sorted(rows, reverse=True):
            last = self.batch_size - 1
            if row != last:
                for buffers in (self.keys, self.values):
                    for t in buffers:
                        t[row, :, lo:hi] = t[last, :, lo:hi]
                self.lengths[row] = self.lengths[last]
                moves.append((last, row))
            self.lengths.pop()
        return moves

    def clear(self) -> None:
        self.lengths.clear()
        self.end = 0

    # -- memory occupation -----------------------------------------------------------------------
    def release(self) -> int:
        """Free the key and value buffers; returns the bytes freed (0 if already released). No
        row may be cached. Until `resume()` the cache must not be used (it holds no buffer)."""
        if self.lengths:
            raise RuntimeError(f"cannot release the KV cache: {len(self.lengths)} rows are cached")
        if self.released:
            return 0
        freed = self.nbytes
        self._released_shape = (self.slots, self.capacity)
        self.keys, self.values = [], []
        self.end = 0
        return freed

    def resume(self) -> int:
        """Allocate the buffers again (zeros, at the shape they had when released); returns the
        bytes allocated (0 if not released)."""
        if self._released_shape is None:
            return 0
        slots, capacity = self._released_shape
        self.keys = [self._alloc(slots, capacity) for _ in range(self.num_layers)]
        self.values = [self._alloc(slots, capacity) for _ in range(self.num_layers)]
        self._released_shape = None
        return self.nbytes

    # -- the transformers Cache interface --------------------------------------------------------
    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        cache_kwargs: dict | None = None,
        **_: object,  # transformers >= 5.24 also passes the layer's `kwargs`; none matter here
    ) -> tuple[torch.Tensor, torch.Tensor]:
        b, _, q, _ = key_states.shape
        k, v = self.keys[layer_idx], self.values[layer_idx]
        k[:b, :, self.end : self.end + q] = key_states
        v[:b, :, self.end : self.end + q] = value_states
        lo = self.end - max(self.lengths, default=0)
        return k[:b, :, lo : self.end + q], v[:b, :, lo : self.end + q]

    def advance(self, columns: int = 1) -> None:
        """After a forward that wrote `columns` new tokens for every row."""
        self.end += columns
        self.lengths = [n + columns for n in self.lengths]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(self.lengths, default=0)

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    @property
    def is_compileable(self) -> bool:  # transformers asks; this cache is eager-only
        return False

    # -- masks ---------------------------------------------------------------------------------
    def decode_mask(self) -> torch.Tensor:
        """Boolean mask [B, 1, 1, width] for one new token per row (True = attend): row r sees
        its own `lengths[r]` cached tokens plus the token being written at `end`."""
        lengths = torch.tensor(self.lengths, device=self.device)
        width = self.end - self.start + 1
        cols = torch.arange(width, device=self.device)
        first_valid = width - 1 - lengths  # columns left of this are padding
        return (cols[None, :] >= first_valid[:, None])[:, None, None, :]


def prefill_mask(prompt_lengths: list[int], width: int, device: torch.device | str) -> torch.Tensor:
    """Causal + left-padding mask [B, 1, width, width] for a left-padded prefill batch."""
    lengths = torch.tensor(prompt_lengths, device=device)
    pos = torch.arange(width, device=device)
    causal = pos[None, :] <= pos[:, None]  # [q, k]
    not_pad = pos[None, :] >= (width - lengths)[:, None]  # [B, k]
    mask = causal[None, :, :] & not_pad[:, None, :]
    # Padding query rows would attend to nothing (NaN in SDPA); let them see themselves.
    mask = mask | torch.eye(width, dtype=torch.bool, device=device)[None]
    return mask[:, None, :, :]
