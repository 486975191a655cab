"""Expert weight formats behind one contract (:class:`ExpertFormat`); see ``FORMATS`` for the registered ones."""

from moetune.engine.formats.base import FORMATS, ExpertFormat
from moetune.engine.formats.dense import DenseExperts

__all__ = ["FORMATS", "DenseExperts", "ExpertFormat"]
