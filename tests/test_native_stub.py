"""The type stub of the compiled module (``_native/_ggml.pyi``, written by the build's ``stub.py`` from the compiled
module and the cdef) against the module itself: every name ``lib`` exports, each function's arity and the kind of each
argument and result, as cffi's compiled module describes them (``ffi.typeof``); the typed part of ``ffi`` against
cffi's; and the stub's argument types against what cffi accepts, on a sample module compiled here."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from cffi import FFI

from ggml_hybrid._native import ffi, lib
from ggml_hybrid_build import cffi_module, paths, stub

STUB = paths.NATIVE / "_ggml.pyi"


def _stub_lib() -> dict[str, ast.FunctionDef | ast.AnnAssign]:
    tree = ast.parse(STUB.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "_Lib")
    members: dict[str, ast.FunctionDef | ast.AnnAssign] = {}
    for node in cls.body:
        if isinstance(node, ast.FunctionDef):
            members[node.name] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            members[node.target.id] = node
    return members


MEMBERS = _stub_lib()
EXPORTED = sorted(n for n in dir(lib) if not n.startswith("__"))
FUNCTIONS = [n for n in EXPORTED if type(getattr(lib, n)).__name__ == "builtin_function_or_method"]


def _expected(ctype, value: bool = False) -> str:
    """What the stub must say for an argument of a C type (a value of it with ``value``: a result, an argument
    of a callback), from the compiled module's description of that type (a regex)."""
    if ctype.kind == "primitive":
        if ctype.cname == "_Bool":
            return "bool"
        if ctype.cname in ("float", "double"):
            return "float"
        return "bytes" if ctype.cname == "char" else "int"
    if ctype.kind == "enum":
        return "int"
    if ctype.kind == "void":
        return "None"
    if value or ctype.kind == "pointer" and ctype.item.kind in ("struct", "union"):
        return "CData"
    if ctype.kind in ("struct", "union"):
        return re.escape("CData | dict[str, Any]")
    if ctype.kind == "function":  # a function pointer argument: a cdata, or one of lib's functions
        return re.escape("CData | Callable[[") + r".*\], .*\]"
    assert ctype.kind in ("pointer", "array"), ctype
    return r"CData( \| .*)?"  # const pointers may also take bytes or a list


def _annotation(node: ast.expr | None) -> str:
    assert node is not None
    return ast.unparse(node)


def test_the_stub_names_exactly_what_lib_exports():
    assert sorted(MEMBERS) == EXPORTED
    assert len(FUNCTIONS) > 200  # the whole cdef, not an empty module


def test_constants_and_callbacks_have_their_types():
    for name in EXPORTED:
        value, node = getattr(lib, name), MEMBERS[name]
        if name in FUNCTIONS:
            continue
        assert isinstance(node, ast.AnnAssign), name
        if isinstance(value, int):
            assert _annotation(node.annotation) == "int", name
        else:  # extern "Python": a function pointer to hand to C
            assert ffi.typeof(value).kind == "function" and _annotation(node.annotation) == "CData", name


@pytest.mark.parametrize("name", FUNCTIONS)
def test_each_function_has_its_arity_and_argument_kinds(name):
    node, ctype = MEMBERS[name], ffi.typeof(getattr(lib, name))
    assert isinstance(node, ast.FunctionDef), name
    params = node.args.posonlyargs + node.args.args
    assert params[0].arg == "self" and not node.args.kwonlyargs and node.args.kwarg is None
    params = params[1:]
    assert len(params) == len(ctype.args), f"{name}: {len(params)} parameters in the stub, {len(ctype.args)} in C"
    assert (node.args.vararg is not None) == ctype.ellipsis
    for i, (p, c) in enumerate(zip(params, ctype.args)):
        ann = _annotation(p.annotation)
        assert re.fullmatch(_expected(c), ann), f"{name} argument {i} ({c.cname}): {ann}"
        if c.kind == "function":  # the callable's own signature, as C will call it
            callable_args, callable_result = _callable(p.annotation)
            assert len(callable_args) == len(c.args), f"{name} argument {i}: {ann}"
            for a, want in zip([*callable_args, callable_result], [*c.args, c.result]):
                assert re.fullmatch(_expected(want, value=True), a), f"{name} argument {i} ({c.cname}): {ann}"
    ann = _annotation(node.returns)
    assert re.fullmatch(_expected(ctype.result, value=True), ann), f"{name} result ({ctype.result.cname}): {ann}"


def _callable(ann: ast.expr | None) -> tuple[list[str], str]:
    """``CData | Callable[[A, B], R]``: its argument and result types."""
    assert isinstance(ann, ast.BinOp) and isinstance(ann.right, ast.Subscript)
    params, result = ann.right.slice.elts  # type: ignore[attr-defined]
    return [ast.unparse(a) for a in params.elts], ast.unparse(result)


def test_the_typed_part_of_ffi_is_cffis():
    tree = ast.parse(STUB.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "_FFI")
    names = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
    names |= {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    assert {"new", "cast", "from_buffer", "string", "NULL"} <= names
    assert [n for n in sorted(names) if not hasattr(ffi, n)] == []
    assert isinstance(ffi.string(ffi.new("char[]", b"ab")), bytes)  # the stub's result type for char arrays


def test_the_stub_is_the_one_the_cdef_gives():
    # a stub older than the headers would check calls against signatures that are gone
    assert STUB.read_text() == stub.stub_source(ffi, lib, cffi_module.cdef_source(True))


# --- the argument types against cffi's own rules -------------------------------------------------------------

SAMPLE_CDEF = """
typedef struct { int a; double b; } pair;
enum colour { RED, GREEN = 5 };
#define LIMIT ...
typedef int (*visit_t)(const pair * p, int n);
int f_ints(int a, unsigned long long b, size_t c, enum colour d, _Bool e, signed char g);
double f_floats(float a, double b);
void f_text(const char * a, char * b, const void * c, void * d, const uint8_t * e, uint8_t * g);
pair * f_arrays(const int64_t * a, int64_t * b, const float * c, const pair * d, const char * const * e,
        pair ** g, int h[4]);
pair f_struct(pair a, visit_t b, int (*c)(void));
int f_var(int n, ...);
void f_none(void);
"""
# the sample's definitions, so that cffi compiles it into a module whose functions the stub describes
SAMPLE_SOURCE = """
#include <stddef.h>
#include <stdint.h>
typedef struct { int a; double b; } pair;
enum colour { RED, GREEN = 5 };
#define LIMIT 3
typedef int (*visit_t)(const pair * p, int n);
static int f_ints(int a, unsigned long long b, size_t c, enum colour d, _Bool e, signed char g) { return a; }
static double f_floats(float a, double b) { return b; }
static void f_text(const char * a, char * b, const void * c, void * d, const uint8_t * e, uint8_t * g) {}
static pair * f_arrays(const int64_t * a, int64_t * b, const float * c, const pair * d, const char * const * e,
        pair ** g, int h[4]) { return NULL; }
static pair f_struct(pair a, visit_t b, int (*c)(void)) { return a; }
static int f_var(int n, ...) { return n; }
static void f_none(void) {}
"""


@pytest.fixture(scope="module")
def sample_stub(tmp_path_factory) -> str:
    """The stub of SAMPLE_CDEF, compiled (API mode, as the package's module is)."""
    sample = FFI()
    sample.cdef(SAMPLE_CDEF)
    sample.set_source("_stub_sample", SAMPLE_SOURCE)
    mod = stub.load_module(Path(sample.compile(tmpdir=str(tmp_path_factory.mktemp("sample")), verbose=False)))
    return stub.stub_source(mod.ffi, mod.lib, SAMPLE_CDEF)

def _sample(py: str, ctype, cffi: FFI):
    """A value of the Python type ``py`` (one member of a stub annotation) for a C argument of type ``ctype``."""
    if py in ("int", "float", "bool", "bytes"):
        return {"int": 3, "float": 1.5, "bool": True, "bytes": b"ab"}[py]
    if py == "dict[str, Any]":
        return {}
    if py.startswith(("list[", "tuple[")):
        item = _sample(_split(py[py.index("[") + 1:-1].split(",")[0])[0], ctype.item, cffi)
        return [item, item] if py.startswith("list[") else (item, item)
    if ctype.kind == "function":  # a cdata function pointer (lib's functions, also admitted, need a compiled lib)
        return cffi.callback(ctype, lambda *a: 0)
    assert py == "CData", py
    if ctype.kind == "struct":
        return cffi.new(ctype.cname + " *")[0]
    return cffi.new("char[1]") if ctype.item.kind == "void" else cffi.new(ctype)


def test_every_type_the_stub_admits_is_one_cffi_accepts(sample_stub):
    sigs = _signatures(sample_stub)
    # each function as a function pointer type, to be called through a Python callback of it: cffi converts the
    # arguments as for a compiled function (a callback cannot be variadic: f_var's fixed arguments are checked)
    cdef = re.sub(r"^(\w[\w *]*?)(f_\w+)\(", r"typedef \1(*\2)(", SAMPLE_CDEF, flags=re.M)
    cffi = FFI()
    cffi.cdef(cdef.replace("#define LIMIT ...", "").replace(", ...)", ")"))
    seen = set()
    for name, anns in sigs.items():
        ctype = cffi.typeof(name)
        fn = cffi.callback(ctype, _returning(ctype.result, cffi))
        alternatives = [[(py, _sample(py, c, cffi)) for py in _split(ann)] for ann, c in zip(anns, ctype.args)]
        for i, values in enumerate(alternatives):
            for py, value in values:
                args = [alts[0][1] for alts in alternatives]
                args[i] = value
                fn(*args)  # raises TypeError if cffi refuses the value
                seen.add(py.split("[")[0])
    assert seen == {"int", "float", "bool", "bytes", "CData", "dict", "list", "tuple", "Callable"}


def _returning(result, cffi: FFI):
    value = None if result.kind == "void" else cffi.new(result.cname + " *")[0] if result.kind == "struct" else 0
    if result.kind == "pointer":
        value = cffi.NULL
    return lambda *args: value


def _signatures(stub: str) -> dict[str, list[str]]:
    tree = ast.parse(stub)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "_Lib")
    return {f.name: [_annotation(a.annotation) for a in (f.args.posonlyargs + f.args.args)[1:]]
            for f in cls.body if isinstance(f, ast.FunctionDef)}


def _split(ann: str) -> list[str]:
    """The members of a union annotation (brackets kept whole)."""
    parts, depth, cur = [], 0, ""
    for ch in ann:
        depth += ch == "["
        depth -= ch == "]"
        if ch == "|" and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return parts + [cur.strip()]


@pytest.mark.parametrize(("function", "index", "want"), [
    ("f_text", 0, "CData | bytes"),  # read only: a bytes object's buffer will do
    ("f_text", 1, "CData"),  # C writes into it: never a bytes object
    ("f_text", 2, "CData | bytes"),
    ("f_text", 3, "CData"),
    ("f_arrays", 0, "CData | list[int] | tuple[int, ...]"),  # read only: cffi fills a temporary array
    ("f_arrays", 1, "CData"),  # written: a temporary array would be lost
    ("f_arrays", 4, "CData | list[CData] | tuple[CData, ...]"),
    ("f_arrays", 5, "CData"),
    ("f_arrays", 6, "CData"),  # int h[4] is a pointer, not const
    ("f_ints", 3, "int"),  # an enum takes its value, not its name
    ("f_ints", 4, "bool"),
])
def test_what_c_may_write_into_takes_no_python_object(sample_stub, function, index, want):
    assert _signatures(sample_stub)[function][index] == want


def test_varargs_results_and_constants_in_the_sample(sample_stub):
    text = sample_stub
    assert "def f_var(self, n: int, /, *varargs: Any) -> int: ..." in text
    assert "def f_none(self) -> None: ..." in text
    assert "def f_floats(self, a: float, b: float, /) -> float: ..." in text
    assert "def f_struct(self, a: CData | dict[str, Any], b: CData | Callable[[CData, int], int], " \
           "c: CData | Callable[[], int], /) -> CData: ..." in text
    for constant in ("LIMIT", "RED", "GREEN"):
        assert f"    {constant}: int\n" in text
    compile(text, "stub", "exec")  # valid Python
