"""``bench/codegen.py``: counting vector instructions with a stack operand inside loops, on a hand-written
disassembly whose loops and spills are known, and end to end on the tree's kernels (slow: a kernel build)."""

from __future__ import annotations

import re
import runpy
import shutil

import pytest

from tests.unit.bench.scripts import ROOT, run_script

SCRIPT = ROOT / "bench" / "codegen.py"

# objdump -d -C --no-show-raw-insn's form: an outer loop 1008-1030 around an inner one 100c-1018
DISASSEMBLY = """
0000000000001000 <void moetune_x::f<4>(long, float const*)>:
    1000:\tpush   %rbp
    1004:\tvmovaps %ymm0,-0x20(%rsp)
    1008:\tvaddps -0x20(%rsp),%ymm1,%ymm1
    100c:\tvfmadd231ps (%rax),%ymm2,%ymm3
    1010:\tvpaddd 0x40(%rsp),%ymm4,%ymm4
    1014:\tlea    -0x20(%rsp),%rdi
    1016:\tvmovaps %ymm5,(%rdi)
    1018:\tjne    100c <void moetune_x::f<4>(long, float const*)+0xc>
    101c:\tvmovaps %ymm3,0x60(%rbp)
    1020:\tmov    -0x8(%rbp),%rax
    1024:\tjg     1040 <void moetune_x::f<4>(long, float const*)+0x40>
    1030:\tjmp    1008 <void moetune_x::f<4>(long, float const*)+0x8>
    1034:\tvmovaps 0x20(%rsp),%ymm0
    1038:\tret

0000000000002000 <void moetune_x::f<4>(int)>:
    2000:\tvmovaps %xmm1,(%rsp,%rax,4)
    2004:\tjne    2000 <void moetune_x::f<4>(int)>

0000000000002800 <moetune_x::g()>:
    2800:	vmovaps %ymm1,-0x40(%rbp)
    2808:	call   2900 <h()>
    280c:	jne    2800 <moetune_x::g()>

0000000000002a00 <moetune_x::k()>:
    2a00:	vmovaps (%rax),%ymm0
    2a04:	jne    2a20 <moetune_x::k()+0x20>
    2a08:	jne    2a00 <moetune_x::k()>
    2a0c:	vmovaps %ymm0,0x20(%rsp)
    2a10:	ret
    2a20:	vaddps 0x40(%rsp),%ymm0,%ymm0
    2a24:	jmp    2a00 <moetune_x::k()>

0000000000003000 <other(int)>:
    3000:\tvmovaps %ymm1,(%rsp)
    3004:\tjne    3000 <other(int)>

0000000000004000 <void moetune_x::f<4>(long, float const*)@plt>:
    4000:\tvmovaps %ymm1,(%rsp)
    4004:\tjne    4000 <void moetune_x::f<4>(long, float const*)@plt>
"""


@pytest.fixture(scope="module")
def codegen() -> dict:
    return runpy.run_path(str(SCRIPT))


def test_spills_are_counted_in_loops_and_innermost_loops_only(codegen) -> None:
    use = codegen["stack_vector_use"](DISASSEMBLY)
    # 1008 and 101c in the outer loop only, 1010 in the inner one; 1004 / 1034 outside, lea and the general
    # register's load and the store through %rdi are no spills; the (int) overload's one (innermost) summed in;
    # other() has no moetune in its name, the PLT stub is left out
    # g()'s loop has a call in it: in a loop, not an innermost one; k()'s loop has a block out of line (after the
    # code that follows the loop, jumping back to the header): its spill counts, the one after the loop does not
    assert use == {
        "void moetune_x::f<4>()": codegen["StackUse"](in_loops=4, innermost=2),
        "moetune_x::g()": codegen["StackUse"](in_loops=1, innermost=0),
        "moetune_x::k()": codegen["StackUse"](in_loops=1, innermost=1),
    }


def test_the_listing_marks_the_spills_of_innermost_loops(codegen) -> None:
    lines = codegen["innermost_listing"](DISASSEMBLY, "f<4>")
    heads = [line for line in lines if "loop" in line]
    assert heads == [
        "void moetune_x::f<4>(): loop at 100c, 5 instructions, 1 spilled",
        "void moetune_x::f<4>(): loop at 2000, 2 instructions, 1 spilled",
    ]
    marked = [line.split()[1] for line in lines if line.startswith("  *")]
    assert marked == ["1010", "2000"]
    assert [line for line in codegen["innermost_listing"](DISASSEMBLY, "k()") if "loop" in line] == [
        "moetune_x::k(): loop at 2a00, 5 instructions, 1 spilled"  # 2a00, 2a04, 2a08 and the block at 2a20
    ]


def test_names_lose_their_parameters_and_build_hashes(codegen) -> None:
    short = codegen["short_name"]
    assert (
        short(
            "void (anonymous namespace)::run<(anonymous namespace)::A, x::B>(x::B const&, long) [clone .constprop.0]"
        )
        == "void {anon}::run<{anon}::A, x::B>() [clone .constprop.0]"
    )
    assert short("PyInit_moetune_ab_tree_0123456789abcdef") == "PyInit_<module>"
    assert (
        short("a::{lambda(long, long)#1}::operator()(long, long) const")
        == "a::{lambda()#1}::operator()() const"
    )


@pytest.mark.slow  # a kernel build (~1-2 min)
@pytest.mark.skipif(
    shutil.which("objdump") is None or shutil.which("g++") is None, reason="needs g++ and objdump"
)
def test_the_tree_kernels_are_disassembled_and_counted() -> None:
    lines = run_script("codegen.py", "--variant", "AVX2", "--all", timeout=900)
    assert lines[1].startswith("variant AVX2;")
    total = re.fullmatch(r"(\d+) functions, (\d+) shown; totals: tree (\d+)/(\d+)", lines[-1])
    assert total, lines[-1]
    functions, shown, in_loops, innermost = map(int, total.groups())
    assert functions == shown == len(lines) - 3 > 20 and in_loops >= innermost
    # the register blocks and the loops around them are among the functions counted
    assert any("forward_range" in line for line in lines) and any("backward_range" in line for line in lines)
