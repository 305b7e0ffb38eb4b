"""The ctypes binding (sage_attn._lib) against include/sage/sage.h, compiled: every enum and
#define constant of the header has its Python twin with the same value, and every struct the
binding mirrors has the same fields at the same offsets and the same size. A C compiler (cc) is
needed; without one the test skips."""
import ctypes
import pathlib
import re
import shutil
import subprocess

import pytest

from sage_attn import _lib

ROOT = pathlib.Path(__file__).resolve().parents[2]
HEADER = ROOT / "include" / "sage" / "sage.h"

# Header names that are not API constants, and the status names the binding spells otherwise.
NOT_CONSTANTS = {"SAGE_SAGE_H", "SAGE_API", "SAGE_VERSION_MAJOR", "SAGE_VERSION_MINOR",
                 "SAGE_VERSION_PATCH"}
RENAMED = {"SAGE_ERROR_INVALID_ARGUMENT": "INVALID_ARGUMENT", "SAGE_ERROR_UNSUPPORTED":
           "UNSUPPORTED", "SAGE_ERROR_CUDA": "CUDA_ERROR", "SAGE_ERROR_OUT_OF_MEMORY":
           "OUT_OF_MEMORY", "SAGE_ERROR_WORKSPACE_TOO_SMALL": "WORKSPACE_TOO_SMALL",
           "SAGE_ERROR_INTERNAL": "INTERNAL"}
STRUCTS = {"sage_quant_config": _lib.QuantConfig, "sage_strides": _lib.Strides,
           "sage_attention_args": _lib.AttentionArgs, "sage_backward_config": _lib.BackwardConfig,
           "sage_backward_args": _lib.BackwardArgs, "sage_plan_info": _lib.PlanInfo}


def header_constants():
    text = HEADER.read_text()
    names = set(re.findall(r"^#define (SAGE_[A-Z0-9_]+)\b", text, re.M))
    names |= set(re.findall(r"^\s+(SAGE_[A-Z0-9_]+)\s*=", text, re.M))
    return sorted(names - NOT_CONSTANTS)


def python_name(c_name):
    return RENAMED.get(c_name, c_name[len("SAGE_"):])


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """What the compiler says of each constant (as double) and each field (offset) and struct
    (size), in the order written."""
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.skip("no C compiler")
    lines = ["#include <stddef.h>", "#include <stdio.h>", '#include "sage/sage.h"',
             "int main(void) {"]
    for name in header_constants():
        lines.append(f'  printf("%.9g\\n", (double)({name}));')
    for cname, py in STRUCTS.items():
        lines.append(f'  printf("%zu\\n", sizeof({cname}));')
        for field, _ in py._fields_:
            lines.append(f'  printf("%zu\\n", offsetof({cname}, {field}));')
    lines += ["  return 0;", "}"]
    tmp = tmp_path_factory.mktemp("abi")
    src, exe = tmp / "abi.c", tmp / "abi"
    src.write_text("\n".join(lines) + "\n")
    subprocess.run([cc, "-std=c99", "-I", str(ROOT / "include"), str(src), "-o", str(exe)],
                   check=True, capture_output=True, text=True)
    return iter(subprocess.run([str(exe)], check=True, capture_output=True,
                               text=True).stdout.split())


def test_constants_and_struct_layouts_match_the_header(compiled):
    missing, wrong = [], []
    for name in header_constants():
        value = float(next(compiled))
        py = getattr(_lib, python_name(name), None)
        if py is None:
            missing.append(name)
        elif abs(float(py) - value) > 1e-6 * max(1.0, abs(value)):
            wrong.append(f"{name} = {value} in sage.h, {py} in _lib")
    assert not missing, f"constants of sage.h without a twin in sage_attn._lib: {missing}"
    assert not wrong, wrong
    for cname, py in STRUCTS.items():
        assert int(next(compiled)) == ctypes.sizeof(py), f"sizeof({cname})"
        for field, _ in py._fields_:
            assert int(next(compiled)) == getattr(py, field).offset, f"{cname}.{field}"
