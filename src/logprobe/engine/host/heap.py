"""Handing freed host memory back to the operating system (glibc's malloc_trim; a no-op elsewhere)."""

from __future__ import annotations


def _load_malloc_trim():
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


_MALLOC_TRIM = _load_malloc_trim()


def trim_heap() -> None:
    """glibc keeps freed memory in its arenas, so a server's RSS only grows with the largest batches it
    has seen; malloc_trim returns it (a few ms, only when the engine goes idle)."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
