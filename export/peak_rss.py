"""This process's peak resident memory, per stage: the kernel's high-water mark (VmHWM), reset
before each submodule so that each reports its own peak, weights, tracing and checks included."""
from __future__ import annotations


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux 4.0+); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_mib() -> float | None:
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return None
