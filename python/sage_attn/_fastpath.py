"""The C++ fast path of the SDPA drop-in, sageattn and the official-API alias: where its build
lives, building it, loading it.

The package reaches the library through its C API (ctypes), so nothing in it is tied to a torch
version. The price is host time: a call that repeats a signature still reads the tensors'
attributes, checks them and looks its route or plan up in Python, a few microseconds a call.
This module compiles `_dropin_fast.cpp` against the installed torch (its headers, libraries and
C++ ABI) into a cache directory; sage_attn then answers repeated calls in C++ (a route to
torch's SDPA, a direct run of sage) and everything else as before. Without a build it is the
same Python it was.

    python -m sage_attn.fastpath            # build (about half a minute), then load it
    SAGE_FASTPATH=0                         # sage_attn ignores a build
    SAGE_FASTPATH_DIR=/path                 # where builds go (default ~/.cache/sage_attn)

A build is named by torch's version, the Python version and the source's hash, so an upgrade of
either, or a new package version, finds no build and runs the Python path until rebuilt.
"""
from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import pathlib
import subprocess
import sys
import sysconfig

SOURCE = pathlib.Path(__file__).with_name("_dropin_fast.cpp")


def _cache_dir() -> pathlib.Path:
    d = os.environ.get("SAGE_FASTPATH_DIR")
    if d:
        return pathlib.Path(d)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "sage_attn"


def path() -> pathlib.Path:
    """Where the build for this torch, Python and source lives (whether built or not)."""
    import torch
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    tag = f"torch{torch.__version__}-py{sys.version_info[0]}{sys.version_info[1]}-{digest}"
    tag = "".join(c if c.isalnum() or c in ".-_" else "_" for c in tag)
    return _cache_dir() / f"_dropin_fast-{tag}.so"


def _command(out: pathlib.Path) -> list:
    import torch
    from torch.utils import cpp_extension
    cxx = os.environ.get("CXX", "c++")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    includes = cpp_extension.include_paths() + [sysconfig.get_paths()["include"]]
    libdirs = cpp_extension.library_paths()
    cmd = [cxx, "-O2", "-std=c++20", "-shared", "-fPIC", "-fvisibility=hidden",
           f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-DTORCH_API_INCLUDE_EXTENSION_H"]
    cmd += [f"-I{d}" for d in includes]
    cmd += [str(SOURCE), "-o", str(out)]
    cmd += [f"-L{d}" for d in libdirs] + [f"-Wl,-rpath,{d}" for d in libdirs]
    cmd += ["-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python"]
    return cmd


def build(verbose: bool = False) -> pathlib.Path:
    """Compile the fast path for the installed torch (a no-op where that build exists)."""
    out = path()
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".{os.getpid()}.tmp")
    cmd = _command(tmp)
    if verbose:
        print(" ".join(cmd))
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"building sage_attn's fast path failed ({cmd[0]}):\n{r.stderr}")
    os.replace(tmp, out)  # (atomic: a concurrent loader sees no half-written file)
    return out


def load():
    """The built module for this torch, or None (not built, SAGE_FASTPATH=0, or it fails to
    load: sage_attn then runs its Python path)."""
    if os.environ.get("SAGE_FASTPATH", "1") == "0":
        return None
    try:
        p = path()
        if not p.is_file():
            return None
        loader = importlib.machinery.ExtensionFileLoader("_dropin_fast", str(p))
        spec = importlib.util.spec_from_file_location("_dropin_fast", str(p), loader=loader)
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
        return module
    except (ImportError, OSError):
        return None
