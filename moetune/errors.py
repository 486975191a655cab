"""One error root for everything a user can cause; one subclass per domain.

Messages name the field or file, the bad value, what is allowed and how to fix it.
Internal invariants use ``assert`` instead.
"""

from __future__ import annotations


class MoetuneError(Exception):
    """Root of every error moetune raises for bad input or bad state."""


class ConfigError(MoetuneError, ValueError):
    """A configuration value is missing, of the wrong type or out of range."""


class EngineError(MoetuneError):
    """The expert engine was given inputs it cannot compute on (shapes, dtypes, ids)."""


class EngineStateError(EngineError):
    """A saved forward was used twice, by the wrong engine, or after its weights changed."""


class NonFiniteError(EngineError):
    """A NaN or Inf appeared in the expert engine while ``check_finite`` was on, or a quantized format's stored
    codes or scales stand for one (the loader names the checkpoint's layer and files: ``NonFiniteWeightError``)."""


class AdapterError(MoetuneError):
    """An adapter file or state dict does not have the keys, shapes or config fields moetune expects."""


class RegistryError(MoetuneError, KeyError):
    """A name was looked up in a registry (formats, activations, architectures) and is not there."""

    def __str__(self) -> str:  # KeyError quotes its message; show it plainly
        return str(self.args[0]) if self.args else ""


class ArchError(MoetuneError):
    """A model's architecture is not one moetune can run (unknown family, experts layout or activation)."""


class SaveError(MoetuneError):
    """A model cannot be saved as asked (e.g. a full checkpoint of a model whose routed experts are in the engine)."""


class LoadError(MoetuneError):
    """A checkpoint cannot be loaded: missing or extra files or tensors, wrong shapes, unsupported formats."""


class NonFiniteWeightError(LoadError):
    """A checkpoint's routed-expert weights hold NaN or Inf (found when they are read; named by file, tensor, layer)."""


class DataError(MoetuneError, ValueError):
    """A dataset cannot be loaded or turned into training examples (missing fields, wrong format, no labels)."""


class DivergenceError(MoetuneError):
    """Training diverged: a non-finite loss, gradient norm or weight, or a collapse to a uniform guess."""


class CheckpointError(MoetuneError):
    """A training checkpoint to resume from is damaged (a truncated or unreadable file) or does not fit the run."""


class OutputDirError(MoetuneError):
    """The output folder cannot be written (read-only, a file in its place or in its path)."""


LISTED = 12  # items an error message shows; the rest are counted


def listing(items: list[str], *, inline: bool = False, total: int | None = None) -> str:
    """The first ``LISTED`` of ``items`` for a message, the rest counted: one per line, each on a new line
    after the text it follows (``"\\n  - a\\n  - b\\n  ... and 3 more"``), or ``inline`` (``"a, b, ... and 3
    more"``). ``total``: how many there are, when the caller kept only the first ones."""
    count = len(items) if total is None else total
    shown = items[:LISTED]
    more = count - len(shown)
    if inline:
        return ", ".join(shown) + (f", ... and {more} more" if more > 0 else "")
    return "".join(f"\n  - {m}" for m in shown) + (f"\n  ... and {more} more" if more > 0 else "")


class DistError(MoetuneError):
    """A multi-process run could not start or another of its processes failed."""
