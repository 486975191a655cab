"""``moetune convert SRC DST --format int8|int4|fp8|mxfp4|bf16``: write a checkpoint's routed experts once, quantized,
as a store that ``load_model(..., expert_path=DST)`` memory-maps (``moetune.loading.convert``)."""

from __future__ import annotations

import argparse
import re

from moetune.errors import ConfigError

# moetune.store.manifest.CONVERT_FORMATS' names, written out: the store package imports torch, and building the
# parser stays light (`moetune --help`); tests/integration/test_convert.py checks that the two agree
FORMAT_CHOICES = ("int8", "int4", "fp8", "mxfp4", "bf16")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "convert",
        help="quantize a checkpoint's routed experts once into a store (load it with expert_path)",
        description="Read SRC's routed experts layer by layer (bounded RAM: one layer at a time), quantize them "
        "and write DST: one safetensors file per experts module plus manifest.json (format, shapes, "
        "quantization parameters, each file's size and SHA-256, SRC's identity). The store is written beside DST "
        "and swapped in whole at the end, so an interrupted conversion leaves DST as it was and a rerun works. "
        "NaN/Inf weights in SRC are refused by name. Load with moetune.load_model(SRC, expert_path=DST) or "
        "`expert_path: DST` under `moetune:` in a training YAML.",
    )
    p.add_argument("src", metavar="SRC", help="Hugging Face checkpoint directory (safetensors)")
    p.add_argument(
        "dst",
        metavar="DST",
        help="store directory to write: new, empty, or a store (never a folder holding other files)",
    )
    p.add_argument(
        "--format",
        required=True,
        choices=FORMAT_CHOICES,
        help="int8 (per channel), int4 (group-wise), fp8 (e4m3, 128x128 blocks; FP8 checkpoints kept as "
        "stored), mxfp4 (e2m1, a power-of-two scale per 32; MXFP4 checkpoints such as gpt-oss kept as stored) "
        "or bf16 (unquantized, for disk residency)",
    )
    p.add_argument("--group-size", type=int, help="int4: inputs per scale, 32, 64 or 128 (default 64)")
    sym = p.add_mutually_exclusive_group()
    sym.add_argument(
        "--symmetric",
        dest="symmetric",
        action="store_true",
        default=None,
        help="int4: no zero points (default)",
    )
    sym.add_argument("--asymmetric", dest="symmetric", action="store_false", help="int4: uint8 zero points")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace DST if it is a finished store (it stays loadable until the new one is whole)",
    )
    p.add_argument("--threads", type=int, help="CPU threads for quantizing (default: the physical cores)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


# convert_checkpoint's option names -> this command's flags
FLAGS = {
    "int4_group_size": "--group-size",
    "int4_symmetric": "--symmetric/--asymmetric",
    "expert_format": "--format",
    "num_threads": "--threads",
}


def as_flags(message: str) -> str:
    """``message`` with the library's option names as this command's flags."""
    for name, flag in FLAGS.items():
        message = re.sub(rf"\b{name}\b", flag, message)
    return message


def run(args: argparse.Namespace) -> int:
    from moetune.loading.convert import convert_checkpoint
    from moetune.progress import format_bytes

    try:
        manifest = convert_checkpoint(
            args.src,
            args.dst,
            args.format,
            int4_group_size=args.group_size,
            int4_symmetric=args.symmetric,
            overwrite=args.overwrite,
            num_threads=args.threads,
            progress=not args.quiet,
        )
    except ConfigError as err:  # the library names its options; on this command line they are flags
        raise ConfigError(as_flags(str(err))) from None
    params = ", ".join(f"{k}={v}" for k, v in manifest.params.items())
    stored = sum(f.size for f in manifest.files.values())
    print(
        f"wrote {len(manifest.layers)} experts modules of {manifest.model_type} as {manifest.format}"
        f"{f' ({params})' if params else ''} to {args.dst}: {format_bytes(stored)}"
    )
    return 0
