"""Checks of a built wheel (scripts/wheel): what it holds and what its libsage.so asks of the host.

  python3 tests/python/check_wheel.py dist/sage_attn-*.whl [--archs "89;90a;120a"] [--install]

Static checks (stdlib only, no CUDA toolkit: the ELF is read here):
- the package's Python files and sage_attn/libsage.so, where _lib.py looks first;
- a manylinux platform tag (auditwheel repair gave it);
- libsage.so's NEEDED entries are the C and C++ runtimes' (libc, libm, libstdc++, libgcc_s: in
  every manylinux policy) only: no libcudart (the CUDA runtime is linked in), no libcuda (the
  runtime loads the driver at run time), no torch or Python library;
- it exports the C API (sage_*) and nothing else (the static archives' symbols stay hidden);
- its fatbin holds the machine code (SASS, not only PTX) of every architecture asked for.
--install additionally installs the wheel into a fresh venv (timed) and runs a CPU call.
tests/python/test_wheel.py runs the static checks under pytest where a wheel has been built.
"""
from __future__ import annotations

import argparse
import pathlib
import re
import struct
import subprocess
import sys
import tempfile
import time
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
LIB = "sage_attn/libsage.so"
ALLOWED_NEEDED = {"libc.so.6", "libm.so.6", "libdl.so.2", "libpthread.so.0", "librt.so.1",
                  "ld-linux-x86-64.so.2", "libstdc++.so.6", "libgcc_s.so.1"}
PY_FILES = ("sage_attn/__init__.py", "sage_attn/_lib.py", "sage_attn/_numpy.py",
            "sage_attn/_torch.py", "sage_attn/_fastpath.py", "sage_attn/fastpath.py",
            "sage_attn/_dropin_fast.cpp")


def default_archs() -> list[str]:
    """SAGE_CUDA_ARCHS's default in CMakeLists.txt: the archs a release wheel must hold."""
    text = (ROOT / "CMakeLists.txt").read_text()
    m = re.search(r'set\(SAGE_CUDA_ARCHS "([^"]*)"', text)
    return m.group(1).split(";")


def latest_wheel() -> pathlib.Path | None:
    wheels = sorted((ROOT / "dist").glob("sage_attn-*.whl"), key=lambda p: p.stat().st_mtime)
    return wheels[-1] if wheels else None


# --- a small ELF64 reader (little-endian x86-64 shared objects) ------------------------------------
class Elf:
    def __init__(self, data: bytes):
        if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
            raise ValueError("not a little-endian ELF64 file")
        self.data = data
        shoff, = struct.unpack_from("<Q", data, 0x28)
        shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
        self.sections = []
        for i in range(shnum):
            name, typ, flags, addr, off, size, link, info, align, entsize = struct.unpack_from(
                "<IIQQQQIIQQ", data, shoff + i * shentsize)
            self.sections.append(dict(name_off=name, type=typ, offset=off, size=size, link=link,
                                      entsize=entsize))
        strtab = self.sections[shstrndx]
        for s in self.sections:
            s["name"] = self._str(strtab, s["name_off"])

    def _str(self, strtab, off) -> str:
        start = strtab["offset"] + off
        end = self.data.index(b"\0", start)
        return self.data[start:end].decode()

    def section(self, name):
        return next((s for s in self.sections if s["name"] == name), None)

    def body(self, s) -> bytes:
        return self.data[s["offset"]:s["offset"] + s["size"]]

    def needed(self) -> list[str]:
        dyn = self.section(".dynamic")
        strtab = self.sections[dyn["link"]]
        out = []
        for off in range(0, dyn["size"], 16):
            tag, val = struct.unpack_from("<qQ", self.data, dyn["offset"] + off)
            if tag == 0:
                break
            if tag == 1:  # DT_NEEDED
                out.append(self._str(strtab, val))
        return out

    def exported(self) -> list[str]:
        """Defined symbols of default visibility with global or weak binding in .dynsym."""
        sym = self.section(".dynsym")
        strtab = self.sections[sym["link"]]
        out = []
        for off in range(sym["entsize"], sym["size"], sym["entsize"]):
            name, info, other, shndx, value, size = struct.unpack_from(
                "<IBBHQQ", self.data, sym["offset"] + off)
            if shndx != 0 and (info >> 4) in (1, 2) and (other & 3) == 0:
                out.append(self._str(strtab, name))
        return out


def fatbin_entries(fatbin: bytes) -> list[tuple[str, int, bool]]:
    """(kind 'sass'|'ptx', sm, arch-specific) of every entry of every fatbin in .nv_fatbin.

    The layout is NVIDIA's and undocumented; as nvcc 13.0 writes it (read from its output): a
    16-byte header (magic 0xBA55ED50, version u16, header size u16, payload size u64), then
    entries each with a header of its own size: kind u16 at 0 (1 PTX, 2 ELF), header size u32
    at 4, payload size u64 at 8, the SM number u32 at 28, flags u32 at 40 where bit 20 marks an
    arch-specific target (sm_90a vs sm_90)."""
    out, off = [], 0
    while off + 16 <= len(fatbin):
        magic, _ver, hsize, size = struct.unpack_from("<IHHQ", fatbin, off)
        if magic != 0xBA55ED50:
            off += 8  # fatbins are 8-byte aligned in the section
            continue
        p, end = off + hsize, off + hsize + size
        while p < end:
            kind, _u, ehsize, psize = struct.unpack_from("<HHIQ", fatbin, p)
            sm, = struct.unpack_from("<I", fatbin, p + 28)
            flags, = struct.unpack_from("<I", fatbin, p + 40)
            out.append(({1: "ptx", 2: "sass"}.get(kind, f"kind{kind}"), sm,
                        bool(flags & (1 << 20))))
            p += ehsize + psize
        off = end
    return out


def arch_name(sm: int, specific: bool) -> str:
    return f"{sm}{'a' if specific else ''}"


# --- the checks -----------------------------------------------------------------------------------
def check(wheel: pathlib.Path, archs: list[str]) -> dict:
    """Raises AssertionError on the first failed check; returns what it found."""
    found = {"wheel": wheel.name, "size_mb": round(wheel.stat().st_size / 2**20, 1)}
    tag = wheel.name[:-4].split("-")[-1]
    found["platform_tag"] = tag
    assert re.fullmatch(r"manylinux_\d+_\d+_x86_64(\.manylinux\w+)*", tag), \
        f"platform tag {tag!r} is not manylinux (was the wheel repaired by auditwheel?)"
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        for f in PY_FILES + (LIB,):
            assert f in names, f"{f} missing from the wheel"
        grafted = sorted(n for n in names if ".libs/" in n)
        assert not grafted, f"auditwheel bundled libraries: {grafted}"
        elf = Elf(z.read(LIB))
    needed = elf.needed()
    found["needed"] = needed
    bad = [n for n in needed if n not in ALLOWED_NEEDED]
    assert not bad, f"libsage.so needs {bad} (only the C/C++ runtimes' may be NEEDED)"
    exported = elf.exported()
    found["exported"] = len(exported)
    others = [s for s in exported if not s.startswith("sage_") and s not in ("_init", "_fini")]
    assert not others, f"libsage.so exports more than the C API: {others[:10]} ..."
    fb = elf.section(".nv_fatbin")
    assert fb is not None, "libsage.so has no .nv_fatbin section: built without CUDA kernels"
    entries = fatbin_entries(elf.body(fb))
    sass = {arch_name(sm, a) for kind, sm, a in entries if kind == "sass"}
    ptx = {arch_name(sm, a) for kind, sm, a in entries if kind == "ptx"}
    found["sass"], found["ptx"] = sorted(sass, key=lambda s: int(s.rstrip("a"))), \
        sorted(ptx, key=lambda s: int(s.rstrip("a")))
    missing = [a for a in archs if a not in sass]
    assert not missing, f"no machine code for sm_{missing} in libsage.so (has {sorted(sass)})"
    # The ptxas command lines that uncompressed cubins record, a reading independent of the
    # layout above (informative: a compressed cubin's is not readable here).
    found["ptxas_arch_strings"] = sorted(set(
        m.decode() for m in re.findall(rb"-arch sm_(\d+a?) ", elf.body(fb))),
        key=lambda s: int(s.rstrip("a")))
    return found


def install_and_run(wheel: pathlib.Path) -> float:
    """Installs the wheel into a fresh venv (no build: --only-binary) and runs a CPU call."""
    with tempfile.TemporaryDirectory() as tmp:
        venv = pathlib.Path(tmp) / "venv"
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        py = venv / "bin" / "python"
        t = time.perf_counter()
        subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                        "--only-binary", ":all:", str(wheel)], check=True)
        seconds = time.perf_counter() - t
        code = ("import numpy as np, sage_attn; print('version', sage_attn.version()); "
                "r = np.random.default_rng(0); q, k, v = (r.standard_normal((1, 2, 64, 64))"
                ".astype(np.float16) for _ in range(3)); o = sage_attn.attention_numpy(q, k, v); "
                "e = sage_attn.attention_numpy(q, k, v, exact=True); "
                "m = sage_attn.metrics(o, e); print('CPU call, sage-8b vs exact:', m); "
                "assert m['cos'] > 0.99, m; print('library', sage_attn._lib._lib._name)")
        subprocess.run([str(py), "-c", code], check=True, cwd=tmp)  # not the source tree's python/
    return seconds


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("wheel", nargs="?", help="the wheel (default: the newest dist/sage_attn-*.whl)")
    ap.add_argument("--archs", default="", help="';'-separated (default: CMakeLists.txt's)")
    ap.add_argument("--install", action="store_true", help="also install into a venv and run")
    args = ap.parse_args()
    wheel = pathlib.Path(args.wheel) if args.wheel else latest_wheel()
    if wheel is None:
        sys.exit("no wheel in dist/ (build it with scripts/wheel)")
    archs = args.archs.split(";") if args.archs else default_archs()
    for k, v in check(wheel, archs).items():
        print(f"{k}: {v}")
    print("static checks passed")
    if args.install:
        print(f"install into a fresh venv: {install_and_run(wheel):.1f} s")


if __name__ == "__main__":
    main()
