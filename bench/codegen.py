"""What the compiler made of the fused kernels' loops: vector registers spilled to the stack inside loops, per
function, for a git revision's kernels against the working tree's (or the tree's alone).

    python bench/codegen.py [--variant AVX2 | AVX512-BF16 | AMX-BF16] [--base REV] [--all] [--loops NAME]

GCC 12 has cost the kernels speed without any output changing: an inlined 1-row register block whose int32 sums
lived on the stack (a store and a reload per product: int8's forward 1.05-1.33x once it was out of line,
docs/performance.md, "AVX2: int8's 1-row register block"), int4's 8-bit rows' group sums spilled within a group.
Such code shows in the disassembly as instructions on a vector register (xmm / ymm / zmm) with a stack operand
(``(%rsp)``, ``(%rbp)``) between a backward jump and its target. This script builds the variant's kernels (as
``bench/kernel_ab.py`` does: ``--base REV`` with that revision's sources and compile flags, and the working tree's),
disassembles each (``objdump -d -C``, binutils, which GCC's builds need anyway) and prints, per function of the
kernels (a demangled name with ``moetune`` in it, parameter lists dropped), how many such instructions lie in any
loop and how many in innermost loops (no loop and no call inside them: where register blocks run); with
``--base``, the functions whose counts differ between the builds and each build's totals; alone, the functions
with any; ``--loops NAME`` then lists the tree's innermost loops with spills in the functions named so. A count is
not a time: a spill outside the hot path costs nothing, and time is ``bench/kernel_ab.py``'s to measure. It runs
on any x86-64 CPU for any variant (nothing is executed).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from moetune.bench.kernel_builds import build_at, build_tree
from moetune.engine.kernels.loader import VARIANTS, variant_named
from moetune.sysinfo import cpu_info

HEADER = re.compile(r"^([0-9a-f]+) <(.+)>:$")
INSTRUCTION = re.compile(r"^\s+([0-9a-f]+):\s+(\S+)\s*(.*)$")
JUMP_TARGET = re.compile(r"^([0-9a-f]+) <")
VECTOR = re.compile(r"%[xyz]mm\d+")
STACK = re.compile(r"\(%r[sb]p[,)]")


@dataclass(frozen=True)
class StackUse:
    """One function's vector instructions with a stack operand: inside any loop, inside innermost loops."""

    in_loops: int
    innermost: int


# a build's module name (its text's hash)
MODULE = re.compile(r"moetune_(?:ab_base|ab_tree|fused)_[0-9a-f]{16}")


def short_name(name: str) -> str:
    """A demangled name with every parameter list emptied and a build's module name as ``<module>`` (the same
    function in two builds has one name): ``void ns::f<4, 4>(A const&, long)`` -> ``void ns::f<4, 4>()``."""
    name = MODULE.sub("<module>", name.replace("(anonymous namespace)", "{anon}"))
    out: list[str] = []
    depth = 0
    for ch in name:
        if ch == "(":
            if depth == 0:
                out.append("(")
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth == 0:
                out.append(")")
        elif depth == 0:
            out.append(ch)
    return "".join(out)


Instruction = tuple[int, str, str]  # address, mnemonic, operands


def functions(disassembly: str, keep: str = "moetune") -> dict[str, list[Instruction]]:
    """``objdump -d -C --no-show-raw-insn`` text -> each function's instructions, per function whose demangled name
    contains ``keep`` (PLT stubs left out), keyed by its raw name."""
    found: dict[str, list[Instruction]] = {}
    body: list[Instruction] | None = None
    for line in disassembly.splitlines():
        head = HEADER.match(line)
        if head:
            name = head.group(2)
            body = found.setdefault(name, []) if keep in name and "@plt" not in name else None
            continue
        ins = INSTRUCTION.match(line)
        if ins and body is not None:
            body.append((int(ins.group(1), 16), ins.group(2), ins.group(3)))
    return found


@dataclass(frozen=True)
class Loop:
    """A natural loop: its header's address and the addresses of its instructions."""

    header: int
    body: frozenset[int]
    calls: (
        bool  # a call inside: every vector register is saved around it anyway; not where register blocks run
    )


def loops(body: list[Instruction]) -> tuple[list[Loop], list[Loop]]:
    """A function's natural loops and, of them, the innermost ones (no other loop's header and no call inside).
    The control-flow graph is built from the direct jumps (an indirect one ends a path); a back edge is an edge to
    a block that dominates its source, and its loop is that header with every block that reaches the edge's source
    without passing the header: the blocks GCC moves out of line count where they are reached from, and the code
    after a loop (or a block out of line jumping back to where it left) does not."""
    if not body:
        return [], []
    addrs = [ins[0] for ins in body]
    index = {addr: i for i, addr in enumerate(addrs)}
    targets: dict[int, int] = {}  # instruction -> the jump's target instruction, within the function
    for i, (_, mnemonic, operands) in enumerate(body):
        target = JUMP_TARGET.match(operands)
        if mnemonic.startswith("j") and target and int(target.group(1), 16) in index:
            targets[i] = index[int(target.group(1), 16)]
    ends = {i for i, ins in enumerate(body) if ins[1].startswith(("j", "ret", "ud2"))}
    leaders = sorted({0, *targets.values(), *(i + 1 for i in ends if i + 1 < len(body))})
    blocks = list(zip(leaders, leaders[1:] + [len(body)], strict=True))  # [first, end) instruction indices
    block_of = {first: n for n, (first, _) in enumerate(blocks)}
    succ: list[list[int]] = []
    for _, end in blocks:
        last = end - 1
        mnemonic = body[last][1]
        nxt = [block_of[end]] if end < len(body) and not mnemonic.startswith(("jmp", "ret", "ud2")) else []
        succ.append(nxt + ([block_of[targets[last]]] if last in targets else []))
    pred: list[list[int]] = [[] for _ in blocks]
    for n, ss in enumerate(succ):
        for m in ss:
            pred[m].append(n)
    reached, todo = {0}, [0]  # from the entry; blocks never reached take no part
    while todo:
        for m in succ[todo.pop()]:
            if m not in reached:
                reached.add(m)
                todo.append(m)
    everything = sum(1 << n for n in reached)
    dom = {n: (1 << n) if n == 0 else everything for n in reached}  # bit m of dom[n]: block m dominates n
    changed = True
    while changed:
        changed = False
        for n in sorted(reached - {0}):
            meet = everything
            for m in pred[n]:
                if m in reached:
                    meet &= dom[m]
            new = meet | (1 << n)
            if new != dom[n]:
                dom[n], changed = new, True
    # header block -> the blocks of its loops (back edges to one header: merged)
    members: dict[int, set[int]] = {}
    for n in reached:
        for h in succ[n]:
            if dom[n] >> h & 1:
                seen = members.setdefault(h, {h})
                todo = [n]
                while todo:
                    m = todo.pop()
                    if m not in seen:
                        seen.add(m)
                        todo += [x for x in pred[m] if x in reached]
    found = []
    for h, group in sorted(members.items()):
        ins = [body[i] for m in group for i in range(*blocks[m])]
        found.append(
            Loop(
                body[blocks[h][0]][0], frozenset(x[0] for x in ins), any(x[1].startswith("call") for x in ins)
            )
        )
    inner = [
        loop
        for loop in found
        if not loop.calls
        and not any(other.header != loop.header and other.header in loop.body for other in found)
    ]
    return found, inner


def spills(body: list[Instruction]) -> list[Instruction]:
    """The instructions on a vector register with a stack operand."""
    return [ins for ins in body if VECTOR.search(ins[2]) and STACK.search(ins[2]) and ins[1] != "lea"]


def stack_vector_use(disassembly: str, keep: str = "moetune") -> dict[str, StackUse]:
    """Per function (``short_name``; overloads that differ only in their parameters summed): its vector
    instructions with a stack operand inside any loop and inside innermost loops."""
    found: dict[str, StackUse] = {}
    for name, body in functions(disassembly, keep).items():
        every, inner = loops(body)
        at = [ins[0] for ins in spills(body)]

        def within(group: list[Loop], at: list[int] = at) -> int:
            return sum(any(addr in loop.body for loop in group) for addr in at)

        key = short_name(name)
        prev = found.get(key, StackUse(0, 0))
        found[key] = StackUse(prev.in_loops + within(every), prev.innermost + within(inner))
    return found


def innermost_listing(disassembly: str, pattern: str) -> list[str]:
    """Every innermost loop with a spill in the functions whose short name contains ``pattern``: a line naming the
    function and the loop, then the loop's instructions, spills marked ``*``."""
    out: list[str] = []
    for name, body in functions(disassembly).items():
        if pattern not in short_name(name):
            continue
        marked = {ins[0] for ins in spills(body)}
        for loop in loops(body)[1]:
            inside = [ins for ins in body if ins[0] in loop.body]
            count = sum(ins[0] in marked for ins in inside)
            if count:
                out.append(
                    f"{short_name(name)}: loop at {loop.header:x}, {len(inside)} instructions, {count} spilled"
                )
                out += [f"  {'*' if i[0] in marked else ' '} {i[0]:x}  {i[1]} {i[2]}" for i in inside]
    return out


def disassemble(library: Path) -> str:
    """``objdump -d -C --no-show-raw-insn`` of ``library``."""
    run = subprocess.run(
        ["objdump", "-d", "-C", "--no-show-raw-insn", str(library)],
        capture_output=True,
        text=True,
        check=True,
    )
    return run.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cpu = cpu_info()
    here = next((v.name for v in VARIANTS if v.isa in cpu.isa), "AVX2")
    ap.add_argument("--variant", default=here, help=f"default: the variant this CPU runs ({here})")
    ap.add_argument("--base", help="git revision whose kernels to compare with (e.g. HEAD)")
    ap.add_argument("--all", action="store_true", help="every function, those without any too")
    ap.add_argument(
        "--loops",
        metavar="PATTERN",
        help="then list the innermost loops with spills of the functions named so (tree)",
    )
    args = ap.parse_args()
    variant = variant_named(args.variant)
    if variant is None:
        raise SystemExit(
            f"--variant: no kernel variant {args.variant!r}; the variants: {[v.name for v in VARIANTS]}"
        )
    if shutil.which("objdump") is None:
        raise SystemExit(
            "objdump not found: install binutils (the package GCC's assembler and linker come from)"
        )
    print(f"bench/codegen.py | {cpu.model} ({', '.join(cpu.isa) or 'no SIMD flags found'})")
    builds = {"tree": build_tree(variant)}
    if args.base:
        builds = {"base": build_at(args.base, variant), **builds}
    texts = {tag: disassemble(Path(str(m.__file__))) for tag, m in builds.items()}
    uses = {tag: stack_vector_use(text) for tag, text in texts.items()}
    names = sorted(set().union(*uses.values()))
    print(
        f"variant {variant.name}; vector instructions with a stack operand, in any loop / in innermost loops"
        + (f"; base {args.base}" if args.base else "")
    )

    def cell(tag: str, name: str) -> str:
        use = uses[tag].get(name)
        return "-" if use is None else f"{use.in_loops}/{use.innermost}"

    shown = 0
    for name in names:
        cells = [cell(tag, name) for tag in uses]
        differs = len(set(cells)) > 1
        if args.all or (differs if args.base else cells[0] not in ("0/0", "-")):
            print(f"  {'  '.join(f'{c:>7}' for c in cells)}  {name}")
            shown += 1
    totals = "  ".join(
        f"{tag} {sum(u.in_loops for u in use.values())}/{sum(u.innermost for u in use.values())}"
        for tag, use in uses.items()
    )
    print(f"{len(names)} functions, {shown} shown; totals: {totals}")
    if args.loops:
        print("\n".join(innermost_listing(texts["tree"], args.loops)))


if __name__ == "__main__":
    main()
