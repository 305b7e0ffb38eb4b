"""The ctypes binding (sage_attn._lib) against include/sage/sage.h, field by field.

Read from the header's text: every struct of the header is mirrored, with the same field names in
the same order, each of the ctypes type its C declaration calls for (enums as c_int, pointers as
c_void_p, nested structs as their mirrors). Compiled: every enum and #define constant of the
header has its Python twin with the same value, and every field sits at the same offset with the
same size, every struct the same size. A C compiler (cc) is needed for the compiled half; without
one it skips. And every function the binding declares has the header's parameter and return
types."""
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


# The ctypes type each scalar C type of the header is mirrored by.
SCALARS = {"size_t": ctypes.c_size_t, "int64_t": ctypes.c_int64, "int32_t": ctypes.c_int32,
           "uint32_t": ctypes.c_uint32, "float": ctypes.c_float}


def header_structs():
    """{struct name: [(field, C type), ...]} in declaration order, from the header's text (a
    pointer's type is "*"; `int64_t a, b;` gives two fields)."""
    text = re.sub(r"/\*.*?\*/", " ", HEADER.read_text(), flags=re.S)
    structs = {}
    for m in re.finditer(r"typedef struct (\w+) \{(.*?)\} (\w+);", text, re.S):
        fields = []
        for decl in m.group(2).split(";"):
            decl = " ".join(decl.split())
            if not decl:
                continue
            first, *more = decl.split(",")
            base = re.match(r"(?:const )?(\w+)", first).group(1)
            for declarator in [first[first.index(base) + len(base):]] + more:
                name = re.search(r"(\w+)\s*$", declarator).group(1)
                fields.append((name, "*" if "*" in declarator else base))
        structs[m.group(1)] = fields
    return structs


def header_enums():
    return set(re.findall(r"typedef enum (\w+) \{", HEADER.read_text()))


def ctypes_type(c_type):
    if c_type == "*":
        return ctypes.c_void_p
    if c_type in SCALARS:
        return SCALARS[c_type]
    if c_type in header_enums():
        return ctypes.c_int
    return STRUCTS[c_type]


def test_header_parser_sees_every_struct_and_field():
    # (So the checks below cannot pass by parsing nothing.)
    structs = header_structs()
    assert structs["sage_strides"] == [("batch", "int64_t"), ("head", "int64_t"),
                                       ("token", "int64_t")]
    fields = dict(structs["sage_backward_args"])
    assert fields["q"] == fields["v"] == fields["untrusted"] == "*"
    assert fields["dv_strides"] == "sage_strides" and fields["config"] == "sage_backward_config"
    assert fields["mask"] == "sage_mask" and "sage_mask" in header_enums()
    assert sum(len(f) for f in structs.values()) > 100


def test_every_header_struct_is_mirrored_field_by_field():
    structs = header_structs()
    assert set(structs) == set(STRUCTS), "structs of sage.h and sage_attn._lib differ"
    for cname, fields in structs.items():
        py = STRUCTS[cname]
        assert [f for f, _ in py._fields_] == [f for f, _ in fields], cname
        for (field, c_type), (_, py_type) in zip(fields, py._fields_):
            assert py_type is ctypes_type(c_type), f"{cname}.{field}: {c_type} is {py_type}"


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
            lines.append(f'  printf("%zu\\n", sizeof((({cname}*)0)->{field}));')
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
            assert int(next(compiled)) == getattr(py, field).offset, f"offsetof {cname}.{field}"
            assert int(next(compiled)) == getattr(py, field).size, f"sizeof {cname}.{field}"


def header_functions():
    """{name: (return type, [parameter types])} of every SAGE_API function, from the header's
    text ("T*" for pointers, without const)."""
    text = re.sub(r"/\*.*?\*/", " ", HEADER.read_text(), flags=re.S)
    funcs = {}
    for m in re.finditer(r"^SAGE_API\s+(.*?)\b(sage_\w+)\((.*?)\);", text, re.M | re.S):
        ret = " ".join(m.group(1).replace("const", "").split())
        params = [] if m.group(3).strip() == "void" else [
            " ".join(re.sub(r"\bconst\b", "", re.sub(r"\w+\s*$", "", p)).split()).replace(" *", "*")
            for p in m.group(3).split(",")]
        funcs[m.group(2)] = (ret, params)
    return funcs


def test_every_bound_function_has_the_headers_signature():
    """The functions the binding declares argtypes/restype for take, in order, what sage.h says:
    a pointer to the mirrored struct where the header has one, c_int for an enum, and return
    c_int for a sage_status and c_char_p for a string."""
    funcs = header_functions()
    assert len(funcs) >= 12 and funcs["sage_attention_plan"] == (
        "sage_status", ["sage_attention_args*", "sage_plan_info*"])
    lib = _lib.library()
    bound = set(re.findall(r"\blib\.(sage_\w+)\.(?:argtypes|restype)",
                           pathlib.Path(_lib.__file__).read_text()))
    assert bound and bound <= set(funcs), bound - set(funcs)
    enums = header_enums()
    for name in sorted(bound):
        ret, params = funcs[name]
        f = getattr(lib, name)
        want_ret = {"sage_status": ctypes.c_int, "char*": ctypes.c_char_p}[ret]
        assert f.restype is want_ret, name
        if params or f.argtypes is not None:
            assert f.argtypes is not None and len(f.argtypes) == len(params), name
            for c_type, py in zip(params, f.argtypes):
                if c_type.endswith("*") and c_type[:-1] in STRUCTS:
                    assert py is ctypes.POINTER(STRUCTS[c_type[:-1]]), (name, c_type)
                elif c_type in enums:
                    assert py is ctypes.c_int, (name, c_type)
                else:
                    assert py is {"size_t*": ctypes.POINTER(ctypes.c_size_t)}[c_type], (name, c_type)
