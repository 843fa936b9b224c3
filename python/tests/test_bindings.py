"""kvrelay/_bindings.py is generated from include/kvrelay.h by python/tools/gen_bindings.py:
this fails when the committed (or installed) file is not what the generator makes of the
header today (a new parameter, field, enum value or function), so that nothing mis-calls."""

import importlib.util
from pathlib import Path

import kvrelay._bindings

ROOT = Path(__file__).resolve().parents[2]


def generator():
    spec = importlib.util.spec_from_file_location("gen_bindings", ROOT / "python" / "tools" / "gen_bindings.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bindings_are_generated_from_the_header():
    want = generator().generate(ROOT / "include" / "kvrelay.h")
    got = Path(kvrelay._bindings.__file__).read_text()
    assert got == want, "kvrelay/_bindings.py is stale: run python3 python/tools/gen_bindings.py"


def test_the_generator_sees_a_changed_prototype(tmp_path):
    header = (ROOT / "include" / "kvrelay.h").read_text()
    old = "kvrelay_status kvrelay_fetch_cancel(const struct kvrelay_fetch *fetch);"
    assert old in header
    changed = tmp_path / "kvrelay.h"
    changed.write_text(header.replace(old, "kvrelay_status kvrelay_fetch_cancel(const struct kvrelay_fetch *fetch, uint32_t grace_ms);"))
    text = generator().generate(changed)
    assert '"kvrelay_fetch_cancel": (c_int32, [("fetch", c_void_p), ("grace_ms", c_uint32)])' in text
    assert text != Path(kvrelay._bindings.__file__).read_text()
