"""The binary interface between ggml-base and a backend library, probed by the C compiler.

A backend library (Vulkan, CUDA, a CPU backend) is compiled against GGML's headers and loaded into a ggml-base
compiled from the same pin with our patch series. What it takes from those headers, and so what must not differ
between the headers it was built with and ggml-base's:

- the layout of every struct and union (``ggml_tensor``, ``ggml_cgraph``, the backend interface tables
  ``ggml_backend_i``, ``ggml_backend_device_i``, ...): its size and alignment, each member's offset, size and
  type (a function pointer's type is its signature), and its list of members (one added into padding leaves
  every number as it was);
- the value of every enum member (ops, types, flags); a member may be added at the end, before a ``*_COUNT``
  sentinel, which may then grow: a backend built before it does not know the new value, and GGML asks it with
  ``supports_op`` before using it;
- the signature of every function declared (a backend calls ggml-base's) and the type of every typedef;
- the text of every macro and of every inline function of those headers, which are compiled into the backend.

``describe(tree)`` lists all of this from a GGML source folder's headers (the C preprocessor, then pycparser);
``probe_source`` writes a C program that prints, for each item, what the compiler makes of it (``sizeof``,
``_Alignof``, ``offsetof``, enum values, and ``__builtin_types_compatible_p`` of each member, function and
typedef against the type the reference headers give it). ``compare(reference, candidate)`` builds that program
from the reference headers (the unpatched pin), compiles and runs it against both trees and returns every
difference; none means a backend library built from the reference headers works with a ggml-base built from the
candidate ones. A program that does not compile against the candidate (a member or function removed) is a
difference too, with the compiler's words. Not seen: what a function does (a patch that keeps a signature and
changes the contract bumps ``buildinfo.ABI_SCHEME``) and the C++-only parts of the internal headers.

Pure Python plus pycparser (a dependency of cffi); part of the build (``ggml_hybrid_build``), never of the package
that runs, which has no use for it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Bump when what is probed changes: the verdicts cached by the build (abi.py) are keyed by it.
PROBE_SCHEME = "1"

# The headers a backend library sees of ggml-base, relative to GGML's folder: the public ones and the internal ones
# that backends include (the backend interface, the graph, the quantization blocks). C declarations only: the
# C++-only parts of ggml-impl.h (under __cplusplus) are not probed.
HEADERS = ("include/ggml.h", "include/ggml-alloc.h", "include/ggml-backend.h", "include/gguf.h",
           "include/ggml-opt.h", "src/ggml-impl.h", "src/ggml-backend-impl.h", "src/ggml-quants.h",
           "src/ggml-threading.h", "src/ggml-common.h")
_INCLUDES = ("include", "src")
# before the headers: ggml-common.h declares its block structs for C only when asked
_PRELUDE = "#define GGML_COMMON_DECL_C\n"

# The C library as a parser needs it: typedef names only (the real headers are used to compile the probe)
_FAKE_LIBC = """
typedef unsigned long size_t; typedef long ssize_t; typedef long ptrdiff_t; typedef int wchar_t;
typedef signed char int8_t; typedef unsigned char uint8_t; typedef short int16_t; typedef unsigned short uint16_t;
typedef int int32_t; typedef unsigned int uint32_t; typedef long int64_t; typedef unsigned long uint64_t;
typedef long intptr_t; typedef unsigned long uintptr_t; typedef long intmax_t; typedef unsigned long uintmax_t;
typedef struct _fake_FILE FILE; typedef int va_list; typedef int __builtin_va_list;
#define bool _Bool
#define true 1
#define false 0
#define NULL ((void *) 0)
#define assert(x) ((void) 0)
"""
_FAKE_NAMES = ("stddef.h", "stdint.h", "stdbool.h", "stdio.h", "stdlib.h", "string.h", "assert.h", "math.h",
               "stdarg.h", "limits.h", "float.h", "inttypes.h", "errno.h", "time.h", "pthread.h", "signal.h")
# GCC's extensions that pycparser does not parse, as the parser's preprocessing removes them
_STRIP = ("-D__attribute__(x)=", "-D__extension__=", "-D__restrict=", "-D__inline=inline", "-D__asm__(x)=",
          "-D__declspec(x)=", "-D__builtin_offsetof(t,m)=0", "-U__SIZEOF_INT128__")


# where GGML_ASSERT and GGML_ABORT are written (``ggml_abort(__FILE__, __LINE__, ...)``): not the code itself
_WHERE = re.compile(r'"[^"]*\.(?:h|c|cpp)", \d+')


class ProbeError(RuntimeError):
    """The headers could not be read or the probe could not be built against the reference headers."""


@dataclass
class Interface:
    """What a backend library takes from one header tree (names only; the compiler gives the numbers)."""

    structs: dict[str, list[tuple[str, str | None]]] = field(default_factory=dict)  # C type -> (member, type)
    enums: dict[str, list[str]] = field(default_factory=dict)  # enum (or its first member) -> members in order
    functions: dict[str, str] = field(default_factory=dict)  # name -> pointer-to-function type
    typedefs: dict[str, str | None] = field(default_factory=dict)  # name -> underlying type (None: an anonymous one)
    inline: dict[str, str] = field(default_factory=dict)  # inline function -> its text
    macros: dict[str, str] = field(default_factory=dict)  # macro -> its definition

    def size(self) -> int:
        return (sum(1 + len(m) for m in self.structs.values()) + sum(len(m) for m in self.enums.values())
                + len(self.functions) + len(self.typedefs) + len(self.inline) + len(self.macros))


def _cc() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise ProbeError("no C compiler (cc) to probe GGML's headers with")
    return cc


def _tu() -> str:
    return _PRELUDE + "".join(f'#include "{Path(h).name}"\n' for h in HEADERS)


def _include_args(tree: Path) -> list[str]:
    return [f"-I{tree / d}" for d in _INCLUDES]


def _run(cmd: list[str], what: str, stdin: str | None = None) -> str:
    res = subprocess.run(cmd, input=stdin, capture_output=True, text=True)
    if res.returncode:
        raise ProbeError(f"{what} failed ({' '.join(cmd[:2])} ...):\n{_first_errors(res.stderr)}")
    return res.stdout


def _first_errors(stderr: str, n: int = 8) -> str:
    lines = [ln for ln in stderr.splitlines() if "error" in ln] or stderr.splitlines()
    return "\n".join(lines[:n])


def _preprocessed(tree: Path, tmp: Path) -> str:
    fake = tmp / "fakelibc"
    fake.mkdir(exist_ok=True)
    for name in _FAKE_NAMES:
        (fake / name).write_text(_FAKE_LIBC)
    return _run([_cc(), "-E", "-std=gnu11", "-nostdinc", f"-I{fake}", *_include_args(tree), *_STRIP, "-"],
                "preprocessing GGML's headers", _tu())


def _macros(tree: Path) -> dict[str, str]:
    """GGML's macros: those the headers define beyond the C library's (with the real C library)."""
    def defined(code: str, args: list[str]) -> dict[str, str]:
        out = _run([_cc(), "-E", "-dM", "-std=gnu11", *args, "-"], "listing GGML's macros", code)
        found = {}
        for line in out.splitlines():
            m = re.match(r"#define (\w+)(\([^)]*\))?\s?(.*)$", line)
            if m:
                found[m.group(1)] = (m.group(2) or "") + " " + m.group(3).strip()
        return found

    libc = "".join(f"#include <{n}>\n" for n in _FAKE_NAMES)
    base = defined(libc, [])
    ours = defined(libc + _tu(), _include_args(tree))
    return {k: v for k, v in ours.items() if k not in base or base[k] != v}


# -- the parse ---------------------------------------------------------------------------------------------------

def _strip_names(node: Any) -> Any:
    """A copy of a type with its declarator names removed (parameter names included), ready to be a type name."""
    import copy

    from pycparser import c_ast
    node = copy.deepcopy(node)

    def visit(n: Any) -> None:
        if isinstance(n, c_ast.TypeDecl):
            n.declname = None
        if isinstance(n, c_ast.Decl):
            n.name = None
        for _, child in n.children():
            visit(child)
    visit(node)
    return node


def _type_text(type_node: Any) -> str | None:
    """C's name of a type (``struct ggml_tensor *``, ``void (*)(int)``), or None for a type without one (an anonymous
    struct, union or enum defined in place, a flexible array)."""
    from pycparser import c_ast, c_generator
    node = _strip_names(type_node)
    decls = _declarators(node)
    if any(isinstance(n, c_ast.ArrayDecl) and n.dim is None for n in decls):
        return None  # a flexible array member: its type has no size to compare
    inner = decls[-1].type if decls else node
    if isinstance(inner, (c_ast.Struct, c_ast.Union, c_ast.Enum)):
        if inner.name is None:
            return None
        import copy
        tag = copy.copy(inner)  # a tagged type defined in place: its tag alone
        if isinstance(tag, c_ast.Enum):
            tag.values = None
        else:
            tag.decls = None
        _replace_innermost(node, tag)
    return str(c_generator.CGenerator().visit(c_ast.Typename(None, [], None, node))).strip()


def _declarators(node: Any) -> list[Any]:
    from pycparser import c_ast
    out = []
    while isinstance(node, (c_ast.PtrDecl, c_ast.ArrayDecl, c_ast.TypeDecl, c_ast.FuncDecl)):
        out.append(node)
        node = node.type
    return out


def _replace_innermost(node: Any, replacement: Any) -> None:
    from pycparser import c_ast
    while isinstance(node.type, (c_ast.PtrDecl, c_ast.ArrayDecl, c_ast.TypeDecl, c_ast.FuncDecl)):
        node = node.type
    node.type = replacement


# a member's type in Interface.structs when it has no name: an anonymous struct or union, a flexible array
ANONYMOUS, FLEXIBLE = "", "[]"
# before a function's type in Interface.functions: it is declared _Noreturn
NORETURN = "_Noreturn "


def _members(struct: Any, prefix: str, out: list[tuple[str, str | None]]) -> None:
    """Every member of a struct or union as a designator (``a``, ``a.b``, or ``b`` for a member of an anonymous
    one) with its type (:data:`ANONYMOUS`, :data:`FLEXIBLE`); bit-fields, which have no offset, as ``a:bits`` with
    None."""
    from pycparser import c_ast, c_generator
    for d in struct.decls or []:
        inner = d.type
        while isinstance(inner, c_ast.TypeDecl):
            inner = inner.type
        nested = inner if isinstance(inner, (c_ast.Struct, c_ast.Union)) and inner.decls is not None else None
        if d.name is None:
            if nested is not None:  # an anonymous struct or union: its members are the parent's
                _members(nested, prefix, out)
            continue
        if d.bitsize is not None:
            out.append((f"{prefix}{d.name}:{c_generator.CGenerator().visit(d.bitsize)}", None))
            continue
        flexible = isinstance(d.type, c_ast.ArrayDecl) and d.type.dim is None
        tp = _type_text(d.type)
        out.append((prefix + d.name, FLEXIBLE if flexible else ANONYMOUS if tp is None else tp))
        if nested is not None and isinstance(d.type, c_ast.TypeDecl):
            _members(nested, f"{prefix}{d.name}.", out)


def describe(tree: Path) -> Interface:
    """The interface of the GGML source folder ``tree``: every struct, enum, function, typedef, inline function
    and macro of :data:`HEADERS` (and of the GGML headers they include)."""
    from pycparser import CParser, c_ast, c_generator

    with tempfile.TemporaryDirectory() as tmp:
        text = _preprocessed(tree, Path(tmp))
    try:
        ast = CParser().parse(text, "ggml-headers")
    except Exception as e:  # pycparser's ParseError names the line; nothing else is raised for bad input
        raise ProbeError(f"pycparser could not read GGML's headers in {tree}: {e}") from e
    root = str(tree.resolve())
    iface = Interface()
    gen = c_generator.CGenerator()

    def ours(node: Any) -> bool:
        f = node.coord.file if node.coord is not None else ""
        return bool(f) and str(Path(f).resolve()).startswith(root)

    def record(tp: Any, typedef: str | None) -> None:
        """A struct, union or enum defined at the top level (tagged, or named by its typedef)."""
        while isinstance(tp, c_ast.TypeDecl):
            tp = tp.type
        if isinstance(tp, (c_ast.Struct, c_ast.Union)) and tp.decls is not None:
            name = f"{'struct' if isinstance(tp, c_ast.Struct) else 'union'} {tp.name}" if tp.name else typedef
            if name:
                members: list[tuple[str, str | None]] = []
                _members(tp, "", members)
                iface.structs[name] = members
        elif isinstance(tp, c_ast.Enum) and tp.values is not None:
            names = [e.name for e in tp.values.enumerators]
            key = f"enum {tp.name}" if tp.name else (typedef or f"enum <{names[0]}>")
            iface.enums[key] = names

    for node in ast.ext:
        if not ours(node):
            continue
        if isinstance(node, c_ast.FuncDef):
            iface.inline[node.decl.name] = _WHERE.sub('"<file>", <line>', gen.visit(node))
        elif isinstance(node, c_ast.Typedef):
            record(node.type, node.name)
            iface.typedefs[node.name] = _type_text(node.type)
        elif isinstance(node, c_ast.Decl):
            if isinstance(node.type, c_ast.FuncDecl) and node.name:
                tp = _type_text(c_ast.PtrDecl([], node.type)) or ""
                # a _Noreturn function's type differs from the one its pointer type names: checked by assignment
                iface.functions[node.name] = NORETURN + tp if "_Noreturn" in (node.funcspec or []) else tp
            else:
                record(node.type, None)
    iface.macros = _macros(tree)
    return iface


# -- the probe ---------------------------------------------------------------------------------------------------

def _c_string(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def probe_source(iface: Interface) -> str:
    """A C program that prints one line per item of ``iface``: sizes, offsets, enum values, and 1 or 0 for whether
    each member, function and typedef has the type ``iface`` gives it, in the headers it is compiled against."""
    lines = ["#include <stdio.h>", "#include <stddef.h>", _tu().rstrip("\n"),
             "#define P(...) printf(__VA_ARGS__)",
             "#define SAME(a, b) __builtin_types_compatible_p(__typeof__(a), b)",
             "int main(void) {"]
    for name, members in iface.structs.items():
        lines.append(f'P("%s size %zu align %zu\\n", {_c_string(name)}, sizeof({name}), _Alignof({name}));')
        for member, tp in members:
            if tp is None:
                continue  # a bit-field: its struct's size covers it
            obj = f"(({name} *) 0)->{member}"
            where = f'P("%s.%s offset %zu", {_c_string(name)}, {_c_string(member)}, offsetof({name}, {member}));'
            if tp == FLEXIBLE:
                lines.append(where + ' P("\\n");')
            elif tp == ANONYMOUS:
                lines.append(where + f' P(" size %zu\\n", sizeof({obj}));')
            else:
                lines.append(where + f' P(" size %zu type %d\\n", sizeof({obj}), SAME({obj}, {tp}));')
    for enum, names in iface.enums.items():
        for m in names:
            lines.append(f'P("{enum}: %s = %lld\\n", {_c_string(m)}, (long long) {m});')
    for fn, tp in iface.functions.items():
        if tp.startswith(NORETURN):  # an error (-Werror=incompatible-pointer-types) if the signature differs
            lines.append(f'{{ {tp[len(NORETURN):].replace("(*)", "(*p)", 1)} = &{fn}; (void) p; }} '
                         f'P("function %s type 1\\n", {_c_string(fn)});')
        else:
            lines.append(f'P("function %s type %d\\n", {_c_string(fn)}, SAME(&{fn}, {tp}));')
    for td, tp in iface.typedefs.items():
        if tp is not None:
            lines.append(f'P("typedef %s type %d\\n", {_c_string(td)}, __builtin_types_compatible_p({td}, {tp}));')
    lines += ["return 0;", "}"]
    return "\n".join(lines) + "\n"


def run_probe(source: str, tree: Path) -> list[str]:
    """Compile ``source`` against the headers of ``tree`` and run it: its lines. ProbeError with the compiler's
    words if it does not compile."""
    with tempfile.TemporaryDirectory() as tmp:
        c, exe = Path(tmp) / "probe.c", Path(tmp) / "probe"
        c.write_text(source)
        # -O1 and sections collected: the headers' static functions, which call ggml-base, are left out (the
        # probe calls none of them, and links no GGML library)
        _run([_cc(), "-std=gnu11", "-w", "-Werror=incompatible-pointer-types", "-O1", "-ffunction-sections",
              *_include_args(tree), "-o", str(exe), str(c), "-Wl,--gc-sections"],
             f"compiling the ABI probe against {tree}")
        return _run([str(exe)], "running the ABI probe").splitlines()


@dataclass
class Verdict:
    """The outcome of :func:`compare`: the differences (none: compatible), how much was checked, how long."""

    differences: list[str]
    checked: int
    seconds: float

    @property
    def compatible(self) -> bool:
        return not self.differences


_COUNT_LINE = re.compile(r"^(enum [^:]*|\w+): (\w+_COUNT) = (-?\d+)$")


def compare(reference: Path, candidate: Path) -> Verdict:
    """Whether a backend library built from the headers of ``reference`` (the pin) fits a ggml-base built from
    those of ``candidate`` (the patched pin): every difference, in words."""
    import time
    t0 = time.monotonic()
    ref, source, want = _reference(reference)
    cand = describe(candidate)
    differences: list[str] = []
    try:
        got = run_probe(source, candidate)
    except ProbeError as e:
        got = []
        differences.append(str(e))
    if got:
        differences += _line_differences(want, got, ref)
    for name, members in ref.structs.items():  # a member added where padding was leaves every number as it was
        theirs = cand.structs.get(name)
        if theirs is not None and [m for m, _ in theirs] != [m for m, _ in members]:
            added = [m for m, _ in theirs if m not in {n for n, _ in members}]
            differences.append(f"{name}: members {[m for m, _ in members]} -> {[m for m, _ in theirs]}"
                               + (f" (added: {', '.join(added)})" if added else ""))
    for kind, a, b in (("inline function", ref.inline, cand.inline), ("macro", ref.macros, cand.macros)):
        for name, text in a.items():
            if name not in b:
                differences.append(f"{kind} {name} removed")
            elif b[name] != text:
                differences.append(f"{kind} {name} changed" + (f": {text.strip()} -> {b[name].strip()}"
                                                               if kind == "macro" else ""))
    return Verdict(differences, ref.size(), time.monotonic() - t0)


_REFERENCES: dict[str, tuple[Interface, str, list[str]]] = {}


def _reference(tree: Path) -> tuple[Interface, str, list[str]]:
    """The interface of the reference headers, its probe program and what it prints there; kept per process by the
    headers' contents (several candidates are compared with one pin)."""
    import hashlib
    h = hashlib.sha256(str(tree.resolve()).encode())
    for rel in sorted(str(p.relative_to(tree)) for d in _INCLUDES for p in (tree / d).glob("*.h")):
        h.update(rel.encode() + b"\0" + (tree / rel).read_bytes())
    key = h.hexdigest()
    if key not in _REFERENCES:
        ref = describe(tree)
        source = probe_source(ref)
        want = run_probe(source, tree)
        bad = [ln for ln in want if re.search(r" type 0$", ln)]
        if bad:  # the probe's own type names must hold where they were read
            raise ProbeError(f"the ABI probe's types do not hold in the reference headers: {bad[:3]}")
        _REFERENCES[key] = (ref, source, want)
    return _REFERENCES[key]


def _line_differences(want: list[str], got: list[str], ref: Interface) -> list[str]:
    out = []
    if len(want) != len(got):
        return [f"the probe printed {len(got)} lines against the candidate, {len(want)} against the reference"]
    for w, g in zip(want, got):
        if w == g:
            continue
        mw, mg = _COUNT_LINE.match(w), _COUNT_LINE.match(g)
        last = mw is not None and ref.enums.get(mw.group(1), [None])[-1] == mw.group(2)
        if mw and mg and last and mw.group(2) == mg.group(2) and int(mg.group(3)) >= int(mw.group(3)):
            continue  # a sentinel grown by members added before it
        out.append(f"{w} -> {g}")
    return out


__all__ = ["HEADERS", "PROBE_SCHEME", "Interface", "ProbeError", "Verdict", "compare", "describe", "probe_source",
           "run_probe"]
