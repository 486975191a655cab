"""``moetune export --model DIR --adapter DIR --out DIR``: an adapter in the layout vLLM and SGLang load
(``moetune.export.serving``)."""

from __future__ import annotations

import argparse


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "export",
        help="write an adapter in the layout vLLM and SGLang load (expert LoRA per expert, checkpoint names)",
        description="Rewrite a trained adapter for serving engines: every LoRA pair under the name of the "
        "checkpoint weight it adapts, routed-expert LoRA one pair per expert and projection where the checkpoint "
        "stores one matrix per expert (Qwen, DeepSeek, Kimi, GLM, Mixtral, ...), PEFT's fused pairs for the "
        "models vLLM adapts that way (gpt-oss, Qwen3.5-MoE, Qwen3-VL-MoE), rsLoRA folded into B. Reads the "
        "checkpoint's headers only. Router LoRA, modules_to_save and LoRA experts are refused (no engine applies "
        "them). The adapter as trained stays the one stock PEFT loads.",
    )
    p.add_argument("--model", required=True, help="the base model folder the adapter was trained on")
    p.add_argument(
        "--adapter", required=True, help="adapter folder written by moetune train (stock PEFT format)"
    )
    p.add_argument("--out", required=True, help="folder to write: new or empty (or an earlier export)")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier export in --out")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moetune.export import export_serving_adapter

    result = export_serving_adapter(args.model, args.adapter, args.out, overwrite=args.overwrite)
    pairs = sum(k.endswith(".lora_A.weight") for k in result.tensors)
    print(
        f"wrote {args.out}: {pairs} LoRA pairs; routed experts {result.per_expert} modules per expert, "
        f"{result.fused} fused; r={result.config['r']}, lora_alpha={result.config['lora_alpha']} "
        f"(serve with vLLM --max-lora-rank >= {result.config['r']})"
    )
    return 0
