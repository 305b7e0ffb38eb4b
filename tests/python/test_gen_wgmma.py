"""src/ptx/wgmma.cuh is what tools/gen_wgmma.py writes, and what it writes is self-consistent:
each wrapper's asm names exactly the operands its constraint lists bind, the accumulator has the
N / 2 registers a thread holds of m64nN, and the predicate reads `accumulate`."""
import pathlib
import re
import subprocess
import sys

from conftest import load_tool

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "gen_wgmma.py"
gen = load_tool("gen_wgmma")


def test_the_file_is_the_generators_output():
    assert (ROOT / "src" / "ptx" / "wgmma.cuh").read_text() == gen.generate(), (
        "src/ptx/wgmma.cuh differs from tools/gen_wgmma.py's output: edit the script and run "
        "`python3 tools/gen_wgmma.py > src/ptx/wgmma.cuh`")
    out = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def _asm_blocks(text):
    """(function name, asm template text, [constraints]) of each wrapper with an operand list."""
    for m in re.finditer(r"void (wgmma_m64n\w+)\((.*?)\n#else", text, re.S):
        name, body = m.group(1), m.group(2)
        asm = body[body.index("asm volatile(") + len("asm volatile("):]
        template_part, _, operands = asm.partition("\n      : ")
        template = "".join(re.findall(r'"((?:[^"\\]|\\.)*)"', template_part))
        constraints = re.findall(r'"([+=]?[a-z])"\(', operands)
        yield name, template, constraints


def test_every_wrapper_names_each_operand_once():
    blocks = list(_asm_blocks(gen.generate()))
    assert [b[0] for b in blocks] == [w.name for w in gen.WRAPPERS]
    for (name, template, constraints), w in zip(blocks, gen.WRAPPERS):
        used = [int(i) for i in re.findall(r"%(\d+)", template)]
        assert sorted(used) == list(range(len(constraints))), name
        regs = w.n // 2
        acc = "+f" if w.float_accumulator else "+r"
        assert constraints[:regs] == [acc] * regs, name
        assert constraints[regs:] == (["r"] * 4 if w.a_in_registers else ["l"]) + ["l", "r"], name
        m = re.search(rf"setp\.ne\.b32 p, %(\d+), 0;.*m64n{w.n}k{w.k}\.{re.escape(w.types)} ",
                      template, re.S)
        assert m and int(m.group(1)) == len(constraints) - 1, name  # the predicate: accumulate
        # The accumulator list is the N / 2 registers in order, then A, then B's descriptor.
        acc_list = template[template.index("{", template.index("wgmma.mma_async")):]
        assert acc_list.startswith("{" + ",".join(f"%{i}" for i in range(regs)) + "}, "), name


def test_generated_wrappers_refuse_other_architectures():
    # Every wrapper with PTX in it has the SAGE_PTX_REQUIRE branch (ptx/arch.cuh).
    text = gen.generate()
    bodies = re.findall(r"__device__ __forceinline__ \w+ (\w+)\(.*?\n}\n", text, re.S)
    asm_wrappers = [n for n in bodies if n not in ("wgmma_desc", "wgmma_fence_regs")]
    assert len(asm_wrappers) >= len(gen.WRAPPERS) + 5
    for name in asm_wrappers:
        body = re.search(rf"void {name}\(.*?\n}}\n", text, re.S).group(0)
        assert "#ifdef SAGE_PTX_HAS_WGMMA" in body and "SAGE_PTX_REQUIRE(" in body, name
