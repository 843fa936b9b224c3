"""Generate python/src/kvrelay/_bindings.py from include/kvrelay.h (stdlib only).

    python3 python/tools/gen_bindings.py            # rewrite the committed file
    python3 python/tools/gen_bindings.py --check    # exit 1 when it is stale

The header is cbindgen's output, one declaration per statement; this reads exactly that form:
``#define`` integer constants, ``enum`` blocks, opaque ``typedef struct X X;``, struct bodies
(scalars, arrays, nested structs, function pointers) and the function prototypes. Everything
the package passes to C comes from here: struct layouts, callback types, enums and the
prototypes (restype, argtypes) of every function; python/tests/test_bindings.py fails when the
committed file differs from what this makes of the header. Anything the generator does not
understand is an error, never a guess.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[2]
HEADER = ROOT / "include" / "kvrelay.h"
OUT = ROOT / "python" / "src" / "kvrelay" / "_bindings.py"

SCALARS = {
    "int32_t": "c_int32",
    "uint32_t": "c_uint32",
    "uint64_t": "c_uint64",
    "uint8_t": "c_uint8",
    "size_t": "c_size_t",
    "double": "c_double",
    "bool": "c_bool",
    "char": "c_char",
}
BYTES = {"char", "uint8_t", "void"}  # pointers to these are addresses: c_void_p


class HeaderError(ValueError):
    pass


def camel(c_name: str) -> str:
    return "".join(w.capitalize() for w in c_name.removeprefix("kvrelay_").split("_"))


def split_top(s: str, sep: str = ",") -> list[str]:
    """Split at ``sep`` outside parentheses."""
    out: list[str] = []
    depth = 0
    cur: list[str] = []
    for ch in s:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == sep and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        out.append("".join(cur).strip())
    return out


class Header:
    def __init__(self, text: str):
        self.consts: list[tuple[str, int, str]] = []
        self.enums: list[tuple[str, list[tuple[str, int, str]], str]] = []
        self.int_aliases: set[str] = {"kvrelay_status"}
        self.opaque: list[tuple[str, str]] = []
        self.structs: list[tuple[str, list[tuple[str, str, str]], str]] = []
        self.functions: list[tuple[str, str, list[tuple[str, str]], str]] = []
        self.callbacks: list[tuple[str, str]] = []  # (python name, CFUNCTYPE expression)
        self._parse(text)

    # --- reading -------------------------------------------------------------------------

    def _parse(self, text: str) -> None:
        if '"""' in text or "\\" in text:
            raise HeaderError("the header has a triple quote or a backslash (the generator copies its comments)")
        text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
        doc: list[str] = []
        lines = iter(text.splitlines())
        stmt = ""
        for raw in lines:
            line = raw.strip()
            if not line:
                doc = []
                continue
            if line.startswith("//"):
                doc.append(line[2:].strip())
                continue
            if line.startswith("#"):
                m = re.match(r"#define\s+(\w+)\s+(-?\d+)\s*$", line)
                if m:
                    self.consts.append((m.group(1), int(m.group(2)), " ".join(doc)))
                doc = []
                continue
            if line in ('extern "C" {', "}") or line.startswith("}  // extern"):
                continue
            m = re.match(r"enum (\w+)$", line)
            if m:
                self._enum(m.group(1), lines, " ".join(doc))
                doc = []
                continue
            m = re.match(r"typedef (?:enum \w+|int32_t) (\w+);$", line)
            if m:
                self.int_aliases.add(m.group(1))
                continue
            m = re.match(r"typedef struct (\w+) (\w+);$", line)
            if m:
                self.opaque.append((m.group(1), " ".join(doc)))
                doc = []
                continue
            m = re.match(r"typedef struct (\w+) \{$", line)
            if m:
                self._struct(m.group(1), lines, " ".join(doc))
                doc = []
                continue
            stmt = (stmt + " " + line).strip()
            if stmt.endswith(";"):
                self._function(stmt[:-1], " ".join(doc))
                stmt, doc = "", []
        if stmt:
            raise HeaderError(f"unterminated declaration: {stmt!r}")

    def _enum(self, name: str, lines: Iterator[str], doc: str) -> None:
        members: list[tuple[str, int, str]] = []
        mdoc: list[str] = []
        for raw in lines:
            line = raw.strip()
            if not line or line.startswith("#") or line.startswith(":") or line == "{":
                continue
            if line.startswith("//"):
                mdoc.append(line[2:].strip())
                continue
            if line == "};":
                break
            m = re.match(r"(\w+) = (-?\d+),$", line)
            if not m:
                raise HeaderError(f"enum {name}: cannot read {line!r}")
            members.append((m.group(1), int(m.group(2)), " ".join(mdoc)))
            mdoc = []
        self.enums.append((name, members, doc))

    def _struct(self, name: str, lines: Iterator[str], doc: str) -> None:
        fields: list[tuple[str, str, str]] = []
        fdoc: list[str] = []
        stmt = ""
        for raw in lines:
            line = raw.strip()
            if line.startswith("//"):
                fdoc.append(line[2:].strip())
                continue
            if line == f"}} {name};":
                break
            stmt = (stmt + " " + line).strip()
            if not stmt.endswith(";"):
                continue
            decl, stmt = stmt[:-1], ""
            m = re.match(r"(.+?)\(\*(\w+)\)\((.*)\)$", decl)
            if m:  # a function pointer
                cb = f"{name}_{m.group(2)}_fn"
                self.callbacks.append((cb, self._cfunctype(m.group(1), m.group(3), f"{name}.{m.group(2)}")))
                fields.append((m.group(2), cb, " ".join(fdoc)))
            else:
                m = re.match(r"(.+?)\s*\b(\w+)(?:\[(\w+)\])?$", decl)
                if not m:
                    raise HeaderError(f"struct {name}: cannot read {decl!r}")
                t = self.ctype(m.group(1), f"{name}.{m.group(2)}", field=True)
                if m.group(3):
                    t = f"({t} * {m.group(3)})"
                fields.append((m.group(2), t, " ".join(fdoc)))
            fdoc = []
        self.structs.append((name, fields, doc))

    def _cfunctype(self, ret: str, params: str, where: str) -> str:
        args = [self.ctype(self._param(p, where)[0], where) for p in split_top(params) if p != "void"]
        return f"CFUNCTYPE({self.ctype(ret, where, ret=True)}, {', '.join(args)})" if args else f"CFUNCTYPE({self.ctype(ret, where, ret=True)})"

    def _param(self, p: str, where: str) -> tuple[str, str]:
        m = re.match(r"(.+?)\s*\b(\w+)$", p)
        if not m:
            raise HeaderError(f"{where}: cannot read the parameter {p!r}")
        return m.group(1), m.group(2)

    def _function(self, decl: str, doc: str) -> None:
        m = re.match(r"(.+?)\b(kvrelay_\w+)\((.*)\)$", decl)
        if not m:
            raise HeaderError(f"cannot read the declaration {decl!r}")
        ret, name, params = m.group(1).strip(), m.group(2), m.group(3)
        args = []
        for p in split_top(params):
            if p == "void":
                continue
            fm = re.match(r"(.+?)\(\*(\w+)\)\((.*)\)$", p)
            if fm:  # a function-pointer parameter
                cb = f"{name}_{fm.group(2)}_fn"
                self.callbacks.append((cb, self._cfunctype(fm.group(1), fm.group(3), f"{name}({fm.group(2)})")))
                args.append((fm.group(2), cb))
            else:
                t, n = self._param(p, name)
                args.append((n, self.ctype(t, f"{name}({n})")))
        self.functions.append((name, self.ctype(ret, name, ret=True), args, doc))

    # --- types ---------------------------------------------------------------------------

    def ctype(self, c: str, where: str, ret: bool = False, field: bool = False) -> str:
        c = re.sub(r"\b(const|struct)\b", "", c)
        stars = c.count("*")
        base = c.replace("*", "").strip()
        structs = {s for s, _, _ in self.structs}
        opaque = {s for s, _ in self.opaque}
        if stars == 0:
            if base == "void":
                return "None"
            if base in SCALARS:
                return SCALARS[base]
            if base in self.int_aliases:
                return "c_int32"
            if base in structs:
                return base
            raise HeaderError(f"{where}: unknown type {c.strip()!r}")
        if stars == 1:
            if base == "char" and ret:
                return "c_char_p"  # static NUL-terminated strings
            if base in BYTES or base in opaque:
                return "c_void_p"
            if base in structs:
                return f"POINTER({base})"
            if base in SCALARS:
                return f"POINTER({SCALARS[base]})"
        if stars == 2 and base in opaque:
            return "POINTER(c_void_p)"
        raise HeaderError(f"{where}: unsupported type {c.strip()!r}")

    # --- writing -------------------------------------------------------------------------

    def render(self) -> str:
        out = [
            '"""The C ABI of libkvrelay, generated from include/kvrelay.h by python/tools/gen_bindings.py:',
            "do not edit by hand (python/tests/test_bindings.py fails when this file is stale). Constants,",
            "enums (labels and C values), struct layouts, callback types and the prototype of every",
            'function of the header."""',
            "",
            "# fmt: off",
            "from __future__ import annotations",
            "",
            "import enum",
            "from ctypes import CFUNCTYPE, POINTER, Structure, c_bool, c_char, c_char_p, c_double, c_int32, c_size_t, c_uint8, c_uint32, c_uint64, c_void_p  # noqa: F401",
            "from typing import Any, Optional, TypeVar",
            "",
            "# --- constants",
            "",
        ]
        for n, v, d in self.consts:
            out.append(f"{n} = {v}  # {d}" if d else f"{n} = {v}")
        out += [
            "",
            "# --- enums: each C enum as a str enum whose values are the labels of its constants (the",
            "# C name after the enum's common prefix, lower case), each member's C value in .c",
            "",
            "",
            '_E = TypeVar("_E", bound="CEnum")',
            "",
            "",
            "class CEnum(str, enum.Enum):",
            '    """A C enum: the value is the label (compares equal to the str), ``.c`` the C value."""',
            "",
            "    _value_: str",
            "    c: int",
            "",
            "    def __new__(cls, label: str, c: int) -> CEnum:",
            "        obj = str.__new__(cls, label)",
            "        obj._value_ = label",
            "        obj.c = c",
            "        return obj",
            "",
            "    def __str__(self) -> str:",
            "        return str.__str__(self)",
            "",
            "    def __format__(self, spec: str) -> str:",
            "        return str.__format__(str(self), spec)",
            "",
            "    @classmethod",
            "    def from_c(cls: type[_E], c: int) -> Optional[_E]:",
            '        """The member of C value ``c``; None for a value this header does not define."""',
            "        for m in cls:",
            "            if m.c == c:",
            "                return m",
            "        return None",
        ]
        for name, members, doc in self.enums:
            names = [m for m, _, _ in members]
            prefix = names[0]
            for other in names[1:]:
                while not other.startswith(prefix):
                    prefix = prefix[: prefix.rstrip("_").rfind("_") + 1]
            if len(names) < 2 or not prefix.endswith("_"):
                raise HeaderError(f"enum {name}: no common prefix")
            out += ["", "", f"class {camel(name)}(CEnum):", f'    """``{name}``: {doc}"""' if doc else f'    """``{name}``"""', ""]
            for m, v, d in members:
                short = m[len(prefix):]
                if not short.isidentifier() or short[0].isdigit():
                    raise HeaderError(f"enum {name}: {m} has no usable name")
                out.append(f'    {short} = ("{short.lower()}", {v})')
        out += ["", "", "# every enumerator as an int, for the calls"]
        for name, members, _ in self.enums:
            for m, v, _ in members:
                out.append(f"{m} = {v}")
        out += ["", "", "# --- structs (in header order: what one uses is defined before it)"]
        cbs = dict(self.callbacks)
        done: set[str] = set()
        for name, fields, doc in self.structs:
            for _, t, _ in fields:
                if t in cbs and t not in done:
                    out += ["", f"{t} = {cbs[t]}"]
                    done.add(t)
            out += ["", "", f"class {name}(Structure):", f'    """{doc}"""' if doc else f'    """``{name}``"""', "", "    _fields_ = ["]
            for f, t, d in fields:
                out.append(f'        ("{f}", {t}),' + (f"  # {d}" if d else ""))
            out.append("    ]")
        out += ["", "", "# --- callback types of function parameters", ""]
        for n, expr in self.callbacks:
            if n not in done:
                out.append(f"{n} = {expr}")
                done.add(n)
        out += [
            "",
            "# --- functions: name -> (restype, [(parameter, argtype), ...])",
            "",
            "PROTOTYPES: dict[str, tuple[Any, list[tuple[str, Any]]]] = {",
        ]
        for name, ret, args, _ in self.functions:
            params = ", ".join('("%s", %s)' % (n, t) for n, t in args)
            out.append(f'    "{name}": ({ret}, [{params}]),')
        out += ["}", "", "OPAQUE = (" + "".join(f'"{n}", ' for n, _ in self.opaque) + ")", ""]
        return "\n".join(out)


def generate(header: Path = HEADER) -> str:
    return Header(header.read_text()).render()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when the committed file is stale")
    ap.add_argument("--header", type=Path, default=HEADER)
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args()
    text = generate(a.header)
    if a.check:
        if not a.out.is_file() or a.out.read_text() != text:
            print(f"{a.out} is stale: run python3 python/tools/gen_bindings.py", file=sys.stderr)
            return 1
        return 0
    a.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
