"""What leaves moetune for other tools: adapters in the layouts serving engines load (``serving``), and
checkpoints with the adapter merged into their weights (``merge``)."""

from moetune.export.merge import MergeResult, export_merged_checkpoint, plan_merge
from moetune.export.serving import ServingAdapter, export_serving_adapter, serving_adapter

__all__ = [
    "MergeResult",
    "ServingAdapter",
    "export_merged_checkpoint",
    "export_serving_adapter",
    "plan_merge",
    "serving_adapter",
]
