"""Hand the heap's free pages back to the system between phases of a run.

glibc keeps freed memory inside the process: a trainer's activations, an engine's prefill logits
and KV-cache growth are freed at the end of their phase and stay resident (RSS) until the next
phase reuses them. On one machine the phases alternate (sync mode: the engines generate while the
trainer waits, then the trainer trains while the engines wait), so every process holding its own
high-water mark adds the peaks up. `release_free_memory` (glibc's malloc_trim) returns them at the
end of a phase, once; the next phase faults its pages in again (measured: no change in step time).
Forcing every large allocation onto mmap (MALLOC_MMAP_THRESHOLD_) saves as much but costs a page
fault per allocation: the SmolLM2 step went from 27 s to 40 s.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        return None


def release_free_memory() -> bool:
    """Return the heap's free pages to the system; False where the C library cannot."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False
