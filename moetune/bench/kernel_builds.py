"""The fused kernels built from a git revision's sources or from the working tree's, side by side, for the scripts
that compare them (``bench/kernel_ab.py``: speed and outputs; ``bench/codegen.py``: what the compiler made of
the loops). Each build is torch's ``cpp_extension.load``, named by a hash of its text and flags (``build_key``),
so a rebuild happens only when a source or a flag changed."""

from __future__ import annotations

import ast
import subprocess
import tempfile
from pathlib import Path
from types import ModuleType

from torch.utils import cpp_extension

from moetune.engine.kernels.loader import CFLAGS, HERE, KernelVariant, build_key

ROOT = HERE.parents[2]  # the repository


def git(*args: str) -> bytes:
    """The output of ``git args`` in the repository."""
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, check=True).stdout


def sources_at(rev: str, dest: Path) -> Path:
    """The kernel folder's C++ sources at git revision ``rev``, written under ``dest``."""
    rel = HERE.relative_to(ROOT).as_posix()
    for name in git("ls-tree", "--name-only", f"{rev}:{rel}").decode().split():
        if name.endswith((".h", ".cpp")):
            (dest / name).write_bytes(git("show", f"{rev}:{rel}/{name}"))
    return dest


def cflags_at(rev: str) -> list[str]:
    """The kernels' compile flags (loader.py's ``CFLAGS``) at git revision ``rev``: flags change code as much as
    sources do (GCC's inlining limits, for one)."""
    rel = (HERE / "loader.py").relative_to(ROOT).as_posix()
    text = git("show", f"{rev}:{rel}").decode()
    for node in ast.parse(text).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "CFLAGS" for t in node.targets
        ):
            return list(ast.literal_eval(node.value))
    raise SystemExit(f"--base {rev}: its {rel} has no CFLAGS = [...]")


def build(folder: Path, source: str, flags: list[str], tag: str) -> ModuleType:
    """The kernel module built from ``folder / source`` (and the headers beside it)."""
    text = b"".join(p.read_bytes() for p in sorted(folder.iterdir()) if p.suffix in (".h", ".cpp"))
    return cpp_extension.load(
        name=f"moetune_ab_{tag}_{build_key(text, flags, folder)}",
        sources=[str(folder / source)],
        extra_cflags=flags,
        extra_ldflags=["-fopenmp"],
    )


def build_at(rev: str, variant: KernelVariant) -> ModuleType:
    """``variant``'s module built from its sources and compile flags at git revision ``rev``."""
    with tempfile.TemporaryDirectory() as tmp:
        return build(sources_at(rev, Path(tmp)), variant.source, cflags_at(rev) + list(variant.flags), "base")


def build_tree(variant: KernelVariant) -> ModuleType:
    """``variant``'s module built from the working tree's sources and flags."""
    return build(HERE, variant.source, CFLAGS + list(variant.flags), "tree")
