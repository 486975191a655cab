"""Progress of streaming experts layers into engines: byte sizes for logs, a tqdm bar with the read rate."""

from __future__ import annotations

import time


def format_bytes(n: int) -> str:
    """``1.23 GB`` / ``45.6 MB`` / ``789 KB``, for logs and the progress bar."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n / 1e3:.0f} KB"


class LayerProgress:
    """A tqdm bar over experts layers showing the read rate: ``advance(nbytes)`` after each layer."""

    def __init__(self, num_layers: int, total_bytes: int, desc: str, enabled: bool) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(total=num_layers, desc=desc, unit="layer", disable=not enabled)
        self.total, self.done, self.start = total_bytes, 0, time.perf_counter()

    def advance(self, nbytes: int) -> None:
        """One more layer done, ``nbytes`` of it read."""
        self.done += nbytes
        rate = self.done / max(time.perf_counter() - self.start, 1e-9) / 1e9
        self.bar.set_postfix_str(f"{rate:.2f} GB/s, {format_bytes(self.done)} of {format_bytes(self.total)}")
        self.bar.update(1)

    def __enter__(self) -> LayerProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.close()
