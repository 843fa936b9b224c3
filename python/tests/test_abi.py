"""The generated bindings against the C header and the library: every struct's size and field
offsets as a C compiler lays them out from include/kvrelay.h, the enum labels as the library
names them, the library's version as the header's."""

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

from kvrelay import _bindings as B
from kvrelay import _lib as L

ROOT = Path(__file__).resolve().parents[2]
STRUCTS = {n: v for n, v in vars(B).items() if isinstance(v, type) and issubclass(v, ctypes.Structure) and v is not ctypes.Structure}


def test_every_struct_of_the_header_is_bound():
    assert len(STRUCTS) >= 20
    assert {"kvrelay_fetch_callbacks", "kvrelay_agent_stats", "kvrelay_provider"} <= set(STRUCTS)


@pytest.mark.skipif(shutil.which("gcc") is None, reason="no C compiler to read the header with")
def test_struct_layouts_match_the_header(tmp_path):
    lines = ["#include <stdio.h>", "#include <stddef.h>", '#include "kvrelay.h"', "int main(void) {"]
    for c, py in STRUCTS.items():
        lines.append(f'printf("{c} :sizeof %zu\\n", sizeof(struct {c}));')
        for f, _ in py._fields_:
            lines.append(f'printf("{c} {f} %zu\\n", offsetof(struct {c}, {f}));')
    lines.append("return 0; }")
    src = tmp_path / "layout.c"
    src.write_text("\n".join(lines))
    exe = tmp_path / "layout"
    subprocess.run(["gcc", "-std=c11", "-I", str(ROOT / "include"), str(src), "-o", str(exe)], check=True)
    got = dict(line.rsplit(" ", 1) for line in subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.splitlines())
    for c, py in STRUCTS.items():
        assert int(got[f"{c} :sizeof"]) == ctypes.sizeof(py), c
        for f, _ in py._fields_:
            assert int(got[f"{c} {f}"]) == getattr(py, f).offset, f"{c}.{f}"


@pytest.mark.parametrize(
    "enum, name_of",
    [
        (B.Reason, "kvrelay_reason_name"),
        (B.Discard, "kvrelay_discard_name"),
        (B.FetchFailure, "kvrelay_fetch_failure_name"),
        (B.AgentLimit, "kvrelay_agent_limit_name"),
    ],
)
def test_enum_labels_are_the_librarys(enum, name_of):
    f = getattr(L.lib, name_of)
    for m in enum:
        assert f(m.c).decode() == m.value, m
    assert enum.from_c(10_000) is None and f(10_000).decode() == "unknown"


def test_the_library_is_the_headers_version():
    want = f"{B.KVRELAY_VERSION_MAJOR}.{B.KVRELAY_VERSION_MINOR}.{B.KVRELAY_VERSION_PATCH}"
    assert L.lib.kvrelay_version().decode() == want
