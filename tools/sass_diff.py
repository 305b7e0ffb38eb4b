#!/usr/bin/env python3
"""Whether a kernel change changes the machine code, without a GPU: compiles CUDA files of the
working tree and of a base commit with nvcc, disassembles both with cuobjdump, and compares every
kernel's SASS per architecture.

    python tools/sass_diff.py HEAD src/bwd/backward_d128.cu          # against the last commit
    python tools/sass_diff.py 193f6f0 src/fp4/fp4.cu --archs 89,90a,120a --show attention_kernel
    python tools/sass_diff.py main src/quant/prepass.cu --regs   # + ptxas -v registers, spills
    python tools/sass_diff.py main src/attn/sm90/attention_d64.cu --loop MUFU.EX2  # + hot loop

A refactor whose kernels come out identical needs no device A/B; one that does not is timed on the
device (scripts/gpu-check's ab stage). Normalized before comparing: instruction addresses and
encodings, kernel-parameter offsets (c[0x0][...]: they move when arguments are regrouped), branch
and call targets, and the hash nvcc puts in anonymous-namespace names. Kernels are matched by
architecture and demangled name with template arguments, not by parameter types. Needs nvcc
(/usr/local/cuda/bin) and cuobjdump + nvdisasm on PATH: scripts/sass-tools installs the latter two
from NVIDIA's wheels where the toolkit lacks them. Exit status 1 when a kernel differs.
"""
from __future__ import annotations

import argparse
import difflib
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NVCC = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"


def normalize(line: str) -> str | None:
    """One SASS line as compared, or None for lines that are not instructions."""
    if not re.search(r"/\*[0-9a-f]{4,}\*/", line):
        return None
    s = re.sub(r"/\*[0-9a-f]{4,}\*/", "", line)
    s = re.sub(r"/\* 0x[0-9a-f]+ \*/", "", s)
    s = re.sub(r"c\[0x0\]\[0x[0-9a-f]+\]", "c[0x0][P]", s)
    s = re.sub(r"\b(BRA|CALL\.REL\.NOINC|CALL\.REL|BSSY(?:\.\w+)?|BREAK|JMP)(.*?)0x[0-9a-f]+",
               r"\1\2ADDR", s)
    s = " ".join(s.split())
    return None if not s or s.startswith("NOP") else s  # (padding NOPs follow the code's length)


def kernel_key(arch: str, mangled: str) -> str:
    # (Demangled, an anonymous namespace reads "(anonymous namespace)", without nvcc's hash.)
    try:
        name = subprocess.run(["c++filt", mangled], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        name = mangled
    name = re.sub(r"_GLOBAL__N__\w+?_[0-9a-f]{8}", "_GLOBAL__N_", name)
    name = re.sub(r"^void ", "", name).replace("(anonymous namespace)", "{anonymous}")
    depth = 0
    for i, c in enumerate(name):  # cut the parameter list: the first '(' outside template args
        depth += c == "<"
        depth -= c == ">"
        if c == "(" and depth == 0:
            name = name[:i]
            break
    return f"{arch} {name}"


def parse(dump: str) -> dict[str, list[str]]:
    """Kernel -> normalized instructions, from cuobjdump -sass output."""
    out: dict[str, list[str]] = {}
    arch, cur = "", None
    for line in dump.splitlines():
        m = re.search(r"arch = (sm_\w+)", line)
        if m:
            arch, cur = m.group(1), None
            continue
        m = re.match(r"\s+Function : (\S+)", line)
        if m:
            cur = kernel_key(arch, m.group(1))
            out[cur] = []
            continue
        if cur is not None:
            s = normalize(line)
            if s is not None:
                out[cur].append(s)
    return out


def hot_loop(dump: str, op: str, least: int = 16) -> dict[str, tuple[int, int, int]]:
    """Kernel -> (instructions, local loads, local stores) of its smallest loop holding at least
    `least` `op` instructions (a loop: the code from a backward branch's target to the branch),
    from cuobjdump -sass output; kernels without one are left out. That is the step loop, where a
    spill costs (--regs counts a kernel's spills wherever they are); `least` keeps out a loop
    with a few of them, such as a split tail's merge."""
    out: dict[str, tuple[int, int, int]] = {}
    arch, cur, ins = "", None, []

    def close():
        if cur is None:
            return
        at = {a: i for i, (a, _) in enumerate(ins)}
        # Running counts of the op, LDL and STL (count[k][i]: among the first i instructions),
        # so that each loop's counts are two lookups.
        pats = [r"(^|\s)" + re.escape(op) + r"(\s|$)", r"\bLDL\b", r"\bSTL\b"]
        count = [[0] for _ in pats]
        for _, text in ins:
            for c, pat in zip(count, pats):
                c.append(c[-1] + bool(re.search(pat, text)))
        best = None
        for i, (a, text) in enumerate(ins):
            m = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
            if not m or int(m.group(1), 16) >= a or int(m.group(1), 16) not in at:
                continue
            s = at[int(m.group(1), 16)]
            ops, ldl, stl = (c[i + 1] - c[s] for c in count)
            if ops >= least and (best is None or i + 1 - s < best[0]):
                best = (i + 1 - s, ldl, stl)
        if best is not None:
            out[cur] = best

    for line in dump.splitlines():
        m = re.search(r"arch = (sm_\w+)", line)
        if m:
            close()
            arch, cur, ins = m.group(1), None, []
            continue
        m = re.match(r"\s+Function : (\S+)", line)
        if m:
            close()
            cur, ins = kernel_key(arch, m.group(1)), []
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if cur is not None and m:
            ins.append((int(m.group(1), 16), m.group(2)))
    close()
    return out


def ptxas_usage(log: str) -> dict[str, str]:
    """Kernel -> "R registers, S/L bytes spilled (stores/loads)", from ptxas -v output."""
    out: dict[str, str] = {}
    cur = None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\S+)' for '(sm_\w+)'", line)
        if m:
            cur = kernel_key(m.group(2), m.group(1))
            out[cur] = ""
            continue
        if cur is None:
            continue
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            out[cur] += f", {m.group(1)}/{m.group(2)} bytes spilled"
        m = re.search(r"Used (\d+) registers", line)
        if m:
            out[cur] = f"{m.group(1)} registers" + out[cur]
    return out


def sass(tree: str, files: list[str], archs: list[str], out_dir: str,
         usage: dict[str, str] | None = None, loop_op: str | None = None,
         loops: dict[str, tuple[int, int, int]] | None = None) -> dict[str, list[str]]:
    """Kernel -> normalized SASS; with `usage`, also fills it from ptxas -v (kernel -> usage), with
    `loops` from hot_loop(loop_op)."""
    kernels: dict[str, list[str]] = {}
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    for f in files:
        obj = os.path.join(out_dir, f.replace("/", "_") + ".o")
        r = subprocess.run([NVCC, "-std=c++17", "-c", "-O3", "--expt-relaxed-constexpr", *gencode,
                            "-Isrc", "-Iinclude", *(["-Xptxas", "-v"] if usage is not None else []),
                            f, "-o", obj], cwd=tree, check=True, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)
        if usage is not None:
            usage.update(ptxas_usage(r.stderr))
        dump = subprocess.run(["cuobjdump", "-sass", obj], capture_output=True, text=True,
                              check=True).stdout
        kernels.update(parse(dump))
        if loops is not None:
            loops.update(hot_loop(dump, loop_op))  # (the softmax step: 64+ 2^x a block)
    return kernels


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("base", help="the commit to compare with (e.g. HEAD)")
    ap.add_argument("files", nargs="+", help="CUDA translation units, relative to the root")
    ap.add_argument("--archs", default="90a", help="comma list (default 90a)")
    ap.add_argument("--show", default=None, help="print the diff of kernels whose name has this")
    ap.add_argument("--regs", action="store_true",
                    help="also compare ptxas -v registers and spills per kernel")
    ap.add_argument("--loop", default=None, metavar="OP",
                    help="also compare each kernel's smallest loop holding 16 or more OP "
                         "instructions (e.g. MUFU.EX2: the softmax step): its length and local "
                         "loads/stores")
    a = ap.parse_args(argv)
    archs = [x.strip() for x in a.archs.split(",") if x.strip()]
    with tempfile.TemporaryDirectory() as tmp:
        base_tree = os.path.join(tmp, "base")
        os.makedirs(base_tree)
        archive = subprocess.run(["git", "-C", ROOT, "archive", a.base], capture_output=True,
                                 check=True).stdout
        subprocess.run(["tar", "-x", "-C", base_tree], input=archive, check=True)
        os.makedirs(os.path.join(tmp, "ob"))
        os.makedirs(os.path.join(tmp, "on"))
        use_old: dict[str, str] | None = {} if a.regs else None
        use_new: dict[str, str] | None = {} if a.regs else None
        loop_old: dict[str, tuple[int, int, int]] = {}
        loop_new: dict[str, tuple[int, int, int]] = {}
        old = sass(base_tree, a.files, archs, os.path.join(tmp, "ob"), use_old, a.loop,
                   loop_old if a.loop else None)
        new = sass(ROOT, a.files, archs, os.path.join(tmp, "on"), use_new, a.loop,
                   loop_new if a.loop else None)
    same = 0
    changed = []
    for k in sorted(set(old) | set(new)):
        if k not in old or k not in new:
            print(("only in base: " if k in old else "only in new:  ") + k)
            changed.append(k)
        elif old[k] == new[k]:
            same += 1
        else:
            print(f"DIFF {k}: {len(old[k])} -> {len(new[k])} instructions")
            changed.append(k)
            if a.show and a.show in k:
                sys.stdout.writelines(l + "\n" for l in difflib.unified_diff(
                    old[k], new[k], "base", "new", n=1, lineterm=""))
    if a.regs:
        moved = 0
        for k in sorted(set(use_old) & set(use_new)):
            if use_old[k] != use_new[k]:
                moved += 1
                print(f"REGS {k}: {use_old[k]} -> {use_new[k]}")
        print(f"ptxas -v: {moved} kernels with other registers or spills")
    if a.loop:
        def show(x):
            return "none" if x is None else f"{x[0]} instructions, LDL {x[1]}, STL {x[2]}"
        for k in sorted(set(loop_old) | set(loop_new)):
            if loop_old.get(k) != loop_new.get(k):
                print(f"LOOP {k}: {show(loop_old.get(k))} -> {show(loop_new.get(k))}")
    print(f"{same} kernels identical, {len(changed)} different or unmatched")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
