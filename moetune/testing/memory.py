"""What this process holds in memory, from ``/proc/self`` (Linux): anonymous memory, and the pages of
memory-mapped files under a directory. Shared by the residency tests and ``bench/residency.py``."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path


def rss_anon() -> int:
    """Resident anonymous memory of this process in bytes (``RssAnon``: heap, tensors; not file pages)."""
    text = Path("/proc/self/status").read_text()
    m = re.search(r"^RssAnon:\s+(\d+) kB", text, re.M)
    assert m is not None, "/proc/self/status has no RssAnon line (not Linux?)"
    return int(m.group(1)) * 1024


@dataclass(frozen=True)
class MappedUsage:
    """Mappings of files under one directory: how much of them is resident, and how much of that is
    anonymous (copy-on-write copies; 0 when nothing was copied). ``ranges``: (start, end) addresses."""

    rss: int
    anonymous: int
    ranges: tuple[tuple[int, int], ...]

    def contains(self, address: int) -> bool:
        return any(start <= address < end for start, end in self.ranges)


def mapped_usage(directory: str | Path) -> MappedUsage:
    """Sum ``Rss`` and ``Anonymous`` over this process's mappings of files inside ``directory``."""
    prefix = str(Path(directory).resolve()) + "/"
    rss = anon = 0
    ranges = []
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) \S+ \S+ \S+ \S+\s*(.*)$", line)
        if head:
            inside = head.group(3).startswith(prefix)
            if inside:
                ranges.append((int(head.group(1), 16), int(head.group(2), 16)))
            continue
        if inside and line.startswith(("Rss:", "Anonymous:")):
            kb = int(line.split()[1]) * 1024
            if line.startswith("Rss:"):
                rss += kb
            else:
                anon += kb
    return MappedUsage(rss, anon, tuple(ranges))
