"""Peak memory of a block of code, above what was in use when it began."""

import ctypes
import ctypes.util
from pathlib import Path

import torch

_PROC = Path("/proc/self")


def _load_libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
    except (OSError, TypeError):
        return None
    return libc if hasattr(libc, "malloc_trim") else None  # glibc


_LIBC = _load_libc()


def _status_bytes(field: str) -> int:
    line = next(line for line in (_PROC / "status").read_text().splitlines() if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024  # reported in kB


def _reset_rss_peak() -> bool:
    """Hand freed heap memory back to the OS, then reset the peak-RSS counter to the current RSS (Linux only)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
    try:
        (_PROC / "clear_refs").write_text("5")
    except OSError:
        return False
    return True


class PeakMemory:
    r"""
    `with PeakMemory(device) as peak: ...`, then `peak.bytes`: the most memory in use during the block minus
    what was in use when it began (None where it cannot be measured).

    On CUDA: bytes allocated by torch's caching allocator (`max_memory_allocated`). Elsewhere: the process's
    resident set size, from Linux's peak-RSS counter (VmHWM), reset at the start. Freed heap memory is handed
    back to the OS first (glibc `malloc_trim`) so that a block reusing it does not hide its growth. RSS counts
    every allocation of the process, not only torch's, at page granularity.
    """

    def __init__(self, device: str | torch.device):
        self.device = torch.device(device)
        self.bytes: int | None = None
        self._kind: str | None = None
        self._start = 0

    @staticmethod
    def measures(device: str | torch.device) -> str:
        """What `bytes` is on `device`, in words."""
        if torch.device(device).type == "cuda":
            return "torch's peak allocated CUDA memory minus what was allocated when the run began"
        return ("the process's peak resident set minus its size when the run began (freed heap memory handed back "
                "to the OS first)")

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._kind, self._start = "cuda", torch.cuda.memory_allocated(self.device)
        elif _reset_rss_peak():
            self._kind, self._start = "rss", _status_bytes("VmRSS")
        return self

    def __exit__(self, *exc) -> None:
        if self._kind == "cuda":
            torch.cuda.synchronize(self.device)
            self.bytes = torch.cuda.max_memory_allocated(self.device) - self._start
        elif self._kind == "rss":
            self.bytes = max(_status_bytes("VmHWM") - self._start, 0)
