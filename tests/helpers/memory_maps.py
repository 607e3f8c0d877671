"""What Linux says of this process's mappings (/proc/self/smaps), for tests of where a
tensor's memory lies: on memory advised for transparent huge pages (`hg`), shared or not."""
from __future__ import annotations


def _field(address: int, name: str) -> str | None:
    """The `name:` line of the mapping holding `address` in /proc/self/smaps, None where
    none does (or there is no /proc)."""
    try:
        with open("/proc/self/smaps") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for i, line in enumerate(lines):
        head = line.split()[0] if line else ""
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            if lo <= address < hi:
                return next((ln for ln in lines[i + 1:] if ln.startswith(name + ":")), None)
    return None


def vm_flags(address: int) -> str | None:
    """The `VmFlags:` line of the mapping holding `address`, None where none does (or
    there is no /proc)."""
    return _field(address, "VmFlags")


def resident_bytes(address: int) -> int | None:
    """How much of the mapping holding `address` is in memory (its `Rss:`), None where
    no mapping holds it (or there is no /proc)."""
    line = _field(address, "Rss")
    return int(line.split()[1]) << 10 if line else None
