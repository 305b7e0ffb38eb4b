"""tools/sass_diff.py's comparison on hand-written cuobjdump output: what it normalizes away
(addresses, encodings, parameter offsets, branch targets, padding, the anonymous-namespace hash,
parameter types) and what it must still see (an opcode, a register, an extra instruction)."""
from conftest import load_tool

sd = load_tool("sass_diff")


def dump(kernel, body, arch="sm_90a"):
    lines = [f"\tcode for {arch}", "\t\tFunction : " + kernel, "\t.headerflags @\"EF_CUDA_SM90\""]
    for i, ins in enumerate(body):
        lines.append(f"        /*{i * 16:04x}*/                   {ins} ;"
                     f"                /* 0x{i:016x} */")
        lines.append(f"                                                     /* 0x{i + 7:016x} */")
    return f"\tarch = {arch}\n" + "\n".join(lines) + "\n"


K1 = "_ZN4sage3bwd12judge_kernelILi64EEEvNS0_6ParamsE"
K2 = "_ZN4sage3bwd12judge_kernelILi64EEEvNS0_8ParamsOfIJNS0_5ShapeEEEE"
BODY = ["LDC R1, c[0x0][0x28]", "S2R R0, SR_TID.X", "BRA 0x120", "IADD3 R2, R0, 0x4, RZ",
        "EXIT"]


def test_what_is_normalized_away():
    a = sd.parse(dump(K1, BODY))
    moved = ["LDC R1, c[0x0][0x390]", "S2R R0, SR_TID.X", "BRA 0x140", "IADD3 R2, R0, 0x4, RZ",
             "EXIT", "NOP", "NOP"]
    b = sd.parse(dump(K2, moved))
    assert list(a) == list(b) == ["sm_90a sage::bwd::judge_kernel<64>"]
    assert a == b


def test_what_is_still_seen():
    base = sd.parse(dump(K1, BODY))
    for changed in (BODY[:3] + ["IADD3 R3, R0, 0x4, RZ"] + BODY[4:],   # a register
                    BODY[:3] + ["IADD3 R2, R0, 0x8, RZ"] + BODY[4:],   # an immediate
                    BODY[:3] + ["LOP3.LUT R2, R0, 0x4, RZ, 0xfc, !PT"] + BODY[4:],
                    BODY[:4] + ["MOV R5, R2"] + BODY[4:]):             # one more instruction
        assert sd.parse(dump(K1, changed)) != base
    # The same kernel on another architecture is another entry.
    assert set(sd.parse(dump(K1, BODY, "sm_89"))) != set(base)


def test_anonymous_namespace_hash():
    name = "_ZN4sage3fp438_GLOBAL__N__ef10613d_6_fp4_cu_d255c85d14quant_v_kernelI6__halfEEvNS0_6ParamsE"
    other = name.replace("ef10613d", "496dc092").replace("d255c85d", "0badcafe")
    assert sd.kernel_key("sm_90a", name) == sd.kernel_key("sm_90a", other)
    assert sd.kernel_key("sm_90a", name).endswith("quant_v_kernel<__half>")


def test_ptxas_usage():
    log = "\n".join([
        f"ptxas info    : Compiling entry function '{K1}' for 'sm_90a'",
        f"ptxas info    : Function properties for {K1}",
        "    0 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads",
        "ptxas info    : Used 95 registers, used 1 barriers, 14080 bytes smem, 464 bytes cmem[0]",
        f"ptxas info    : Compiling entry function '{K1}' for 'sm_89'",
        "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads",
        "ptxas info    : Used 40 registers, 464 bytes cmem[0]",
    ])
    u = sd.ptxas_usage(log)
    assert u == {"sm_90a sage::bwd::judge_kernel<64>": "95 registers, 8/4 bytes spilled",
                 "sm_89 sage::bwd::judge_kernel<64>": "40 registers, 0/0 bytes spilled"}


def test_hot_loop_is_the_smallest_loop_with_the_op():
    # An outer loop (0x00-0x50) around an inner one (0x10-0x40) that holds MUFU.EX2 and a spill
    # reload and store; a branch forward and a second kernel without the op are not loops of it.
    body = ["S2R R0, SR_TID.X", "LDL R2, [R1+0x4]", "@P0 MUFU.EX2 R3, R2",
            "STL [R1+0x4], R3", "@P0 BRA 0x10", "@P1 BRA 0x0", "@P2 BRA 0x80", "EXIT"]
    other = ["S2R R0, SR_TID.X", "LDL R2, [R1]", "@P0 BRA 0x0", "EXIT"]
    loops = sd.hot_loop(dump(K1, body) + dump(K2.replace("judge", "other"), other), "MUFU.EX2",
                        least=1)
    assert loops == {"sm_90a sage::bwd::judge_kernel<64>": (4, 1, 1)}
    # Without the inner loop the outer one is the smallest that holds it.
    flat = body[:4] + ["NOP"] + body[5:]
    assert sd.hot_loop(dump(K1, flat), "MUFU.EX2", least=1) == {
        "sm_90a sage::bwd::judge_kernel<64>": (6, 1, 1)}
    # A loop with fewer of them than `least` is not the one (a split tail's merge).
    assert sd.hot_loop(dump(K1, body), "MUFU.EX2", least=2) == {}
    # An op named by its full mnemonic only: MUFU.EX2.F16 is not MUFU.EX2.
    half = [x.replace("MUFU.EX2", "MUFU.EX2.F16") for x in body]
    assert sd.hot_loop(dump(K1, half), "MUFU.EX2", least=1) == {}
