"""The generated bindings against the C header and the library: every struct's size and field
offsets as a C compiler lays them out from include/kvrelay.h, the enum labels as the library
names them, the library's version as the header's; the compiled helper's calls typed by the
header. What needs a C compiler skips without one, except in CI (``CI`` set, or
``KVRELAY_REQUIRE_FAST=1`` as the test command sets), where it fails: there a missing compiler
is a broken machine, not a reason to check nothing."""

import ctypes
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from kvrelay import _bindings as B
from kvrelay import _lib as L

ROOT = Path(__file__).resolve().parents[2]
STRUCTS = {n: v for n, v in vars(B).items() if isinstance(v, type) and issubclass(v, ctypes.Structure) and v is not ctypes.Structure}


def in_ci():
    ci = os.environ.get("CI", "").strip().lower()
    return ci not in ("", "0", "false", "no") or os.environ.get("KVRELAY_REQUIRE_FAST") == "1"


def missing(what):
    """Skip for want of ``what``; in CI, fail."""
    if in_ci():
        pytest.fail(f"{what}, in CI (CI or KVRELAY_REQUIRE_FAST=1 set): this test must run there")
    pytest.skip(what)


def c_compiler():
    """The C compiler: $CC (its first word) if set, else gcc or cc on PATH."""
    cc = shlex.split(os.environ.get("CC", ""))
    found = shutil.which(cc[0]) if cc else (shutil.which("gcc") or shutil.which("cc"))
    if found is None:
        missing("no C compiler (gcc, cc or $CC) to read the header with")
    return [found] + cc[1:]


def test_every_struct_of_the_header_is_bound():
    assert len(STRUCTS) >= 20
    assert {"kvrelay_fetch_callbacks", "kvrelay_agent_stats", "kvrelay_provider"} <= set(STRUCTS)


def test_struct_layouts_match_the_header(tmp_path):
    cc = c_compiler()
    lines = ["#include <stdio.h>", "#include <stddef.h>", '#include "kvrelay.h"', "int main(void) {"]
    for c, py in STRUCTS.items():
        lines.append(f'printf("{c} :sizeof %zu\\n", sizeof(struct {c}));')
        for f, _ in py._fields_:
            lines.append(f'printf("{c} {f} %zu\\n", offsetof(struct {c}, {f}));')
    lines.append("return 0; }")
    src = tmp_path / "layout.c"
    src.write_text("\n".join(lines))
    exe = tmp_path / "layout"
    subprocess.run([*cc, "-std=c11", "-I", str(ROOT / "include"), str(src), "-o", str(exe)], check=True)
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


def compile_helper(cc, include):
    """Compile the helper's source (syntax and types only) with setup.py's flags against the
    header in ``include``: the compiler's output, or None when it compiles."""
    py = sysconfig.get_paths()["include"]
    if not (Path(py) / "Python.h").is_file():
        missing(f"no Python.h in {py} to compile the helper against")
    src = ROOT / "python" / "src" / "kvrelay" / "_fast.c"
    p = subprocess.run(
        [*cc, "-fsyntax-only", "-O2", "-Wall", "-Wextra", "-Werror", "-I", str(include), "-I", py, str(src)],
        capture_output=True,
        text=True,
    )
    return None if p.returncode == 0 else p.stderr


@pytest.mark.parametrize(
    "declaration, changed",
    [
        ("kvrelay_status kvrelay_agent_submit(const struct kvrelay_agent *agent,",
         "kvrelay_status kvrelay_agent_submit(uint32_t flags, const struct kvrelay_agent *agent,"),
        ("kvrelay_status kvrelay_admit(const struct kvrelay_admission *admission,",
         "kvrelay_status kvrelay_admit(const struct kvrelay_admission *admission, uint32_t flags,"),
        ("void kvrelay_snapshot_release(struct kvrelay_snapshot *snapshot);",
         "void kvrelay_snapshot_release(struct kvrelay_snapshot *snapshot, uint32_t flags);"),
    ],
)
def test_the_helper_calls_the_library_as_the_header_declares(tmp_path, declaration, changed):
    # the helper calls kvrelay_admit, kvrelay_agent_submit and kvrelay_snapshot_release through
    # addresses; their types come from the header, so that a changed declaration fails the
    # build instead of making the old call (hand-written prototypes compiled either way)
    cc = c_compiler()
    assert compile_helper(cc, ROOT / "include") is None, "the helper does not compile against the header"
    header = (ROOT / "include" / "kvrelay.h").read_text()
    assert header.count(declaration) == 1
    (tmp_path / "kvrelay.h").write_text(header.replace(declaration, changed))
    err = compile_helper(cc, tmp_path)
    assert err is not None, f"the helper still compiles with {changed!r}"
    assert "error" in err


@pytest.mark.parametrize("ci_env", [{"CI": "true"}, {"KVRELAY_REQUIRE_FAST": "1"}, {}])
def test_a_missing_compiler_fails_in_ci_and_skips_elsewhere(tmp_path, ci_env):
    # test_struct_layouts_match_the_header with no compiler to be found (an empty PATH, no $CC):
    # skipped outside CI, failed in CI (it was skipped there too)
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "KVRELAY_REQUIRE_FAST", "CC")}
    env.update(ci_env, PATH=str(tmp_path), PYTHONPATH=os.pathsep.join(sys.path))
    test = f"{Path(__file__).resolve()}::test_struct_layouts_match_the_header"
    p = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", test],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    out = p.stdout + p.stderr
    assert "no C compiler" in out, out[-3000:]
    if ci_env:
        assert p.returncode == 1 and "1 failed" in out, out[-3000:]
    else:
        assert p.returncode == 0 and "1 skipped" in out, out[-3000:]
