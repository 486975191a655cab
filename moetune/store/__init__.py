"""Pre-quantized expert stores: what ``moetune convert`` writes and ``load_model(expert_path=...)`` reads.

One safetensors file per experts module in a registered engine format, and a ``manifest.json`` written last
(``manifest``); files memory-mapped and checked (``mapped``); the reader and writer (``files``); engines
over a store, resident in RAM or paged from disk within a budget (``engines``). ``moetune.loading`` imports
this package, never the other way: the checkpoint side (``moetune.loading.convert``) plans and reads, this
side stores.
"""

from moetune.store.engines import open_store, store_engines
from moetune.store.files import ExpertStore, StorePages, StoreWriter
from moetune.store.manifest import MANIFEST, Manifest, SourceIdentity

__all__ = [
    "MANIFEST",
    "ExpertStore",
    "Manifest",
    "SourceIdentity",
    "StorePages",
    "StoreWriter",
    "open_store",
    "store_engines",
]
