"""``moetune export``: an adapter in the layout vLLM and SGLang load (``--model DIR --adapter DIR --out DIR``,
``moetune.export.serving``), or merged into its base checkpoint (``--merge``, or LLaMA-Factory's merge config:
``moetune export merge.yaml``; ``moetune.export.merge``)."""

from __future__ import annotations

import argparse

KEPT_WARNING = 0.9  # below this share of the adapter's change kept by requantizing, the message says so


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "export",
        help="write an adapter in the layout vLLM and SGLang load, or merge it into its base checkpoint",
        description="Rewrite a trained adapter for serving engines: every LoRA pair under the name of the "
        "checkpoint weight it adapts, routed-expert LoRA one pair per expert and projection where the checkpoint "
        "stores one matrix per expert (Qwen, DeepSeek, Kimi, GLM, Mixtral, ...), PEFT's fused pairs for the "
        "models vLLM adapts that way (gpt-oss, Qwen3.5-MoE, Qwen3-VL-MoE), rsLoRA folded into B. Reads the "
        "checkpoint's headers only. Router LoRA, modules_to_save and LoRA experts are refused (no engine applies "
        "them). The adapter as trained stays the one stock PEFT loads. With --merge, or given LLaMA-Factory's "
        "merge config (llamafactory-cli export's YAML), write the base checkpoint with the adapter merged into "
        "its weights instead: same names, shards and format (FP8 block and compressed-tensors INT4 weights "
        "quantized again), loadable with no adapter.",
    )
    p.add_argument(
        "config",
        nargs="?",
        help="LLaMA-Factory merge config (model_name_or_path, adapter_name_or_path, export_dir, ...): merge",
    )
    p.add_argument("--model", help="the base model folder the adapter was trained on")
    p.add_argument("--adapter", help="adapter folder written by moetune train (stock PEFT format)")
    p.add_argument("--out", help="folder to write: new or empty (or an earlier export of the same kind)")
    p.add_argument(
        "--merge", action="store_true", help="write the base checkpoint with the adapter merged in"
    )
    p.add_argument(
        "--quantized",
        choices=("bfloat16", "requantize"),
        default="bfloat16",
        help="merging into a quantized checkpoint (FP8, INT4, MXFP4): write its weights dequantized in bf16 "
        "(default: the adapter kept to bf16's precision, no quantization_config) or quantize the merged ones again "
        "(same size and format; a change below half a quantization step is lost: the share kept is printed)",
    )
    p.add_argument(
        "--overwrite", action="store_true", help="replace an earlier export of the same kind in --out"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moetune.errors import ConfigError

    if args.config is not None:
        if args.model or args.adapter or args.out:
            raise ConfigError("give either a merge config or --model / --adapter / --out, not both")
        from moetune.config.export import load_merge_config

        config = load_merge_config(args.config)
        return _merge(
            config.model_name_or_path,
            config.adapter_name_or_path,
            config.export_dir,
            args,
            config.trust_remote_code,
        )
    missing = [f"--{n}" for n in ("model", "adapter", "out") if getattr(args, n) is None]
    if missing:
        raise ConfigError(f"moetune export needs {', '.join(missing)} (or a merge config)")
    if args.merge:
        return _merge(args.model, args.adapter, args.out, args, False)
    from moetune.export import export_serving_adapter

    result = export_serving_adapter(args.model, args.adapter, args.out, overwrite=args.overwrite)
    pairs = sum(k.endswith(".lora_A.weight") for k in result.tensors)
    print(
        f"wrote {args.out}: {pairs} LoRA pairs; routed experts {result.per_expert} modules per expert, "
        f"{result.fused} fused; r={result.config['r']}, lora_alpha={result.config['lora_alpha']} "
        f"(serve with vLLM --max-lora-rank >= {result.config['r']})"
    )
    return 0


def _merge(
    model: object, adapter: object, out: object, args: argparse.Namespace, trust_remote_code: bool
) -> int:
    from moetune.export import export_merged_checkpoint

    result = export_merged_checkpoint(
        str(model),
        str(adapter),
        str(out),
        overwrite=args.overwrite,
        quantized=args.quantized,
        trust_remote_code=trust_remote_code,
    )
    print(
        f"wrote {out}: the checkpoint with the adapter merged into {len(result.changed)} weights; "
        f"{len(result.written)} shards rewritten, {len(result.copied)} files copied as they were"
        + (f"; left out: {', '.join(result.left_out)}" if result.left_out else "")
    )
    if result.dequantized:
        print(
            f"{len(result.dequantized)} quantized weights written in bf16 and quantization_config removed "
            "(--quantized requantize keeps the checkpoint's format instead)"
        )
    if result.kept is not None:
        print(
            f"the requantized weights keep {result.kept:.0%} of the adapter's change"
            + (
                ": the rest fell below half a quantization step; --quantized bfloat16 keeps it all"
                if result.kept < KEPT_WARNING
                else ""
            )
        )
    return 0
