"""What leaves moetune for other tools: adapters in the layouts serving engines load (``serving``)."""

from moetune.export.serving import ServingAdapter, export_serving_adapter, serving_adapter

__all__ = ["ServingAdapter", "export_serving_adapter", "serving_adapter"]
