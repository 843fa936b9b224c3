"""The ctypes mirror of every struct the package passes must match the C header: compile a
program against include/kvrelay.h that prints each struct's size and field offsets."""

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

from kvrelay import _lib as L

ROOT = Path(__file__).resolve().parents[2]
STRUCTS = {
    "kvrelay_outcome": L.Outcome,
    "kvrelay_counters": L.Counters,
    "kvrelay_agent_fingerprint": L.AgentFingerprint,
    "kvrelay_block_holder": L.BlockHolder,
    "kvrelay_str": L.Str,
    "kvrelay_bytes": L.Bytes,
    "kvrelay_fetch_params": L.FetchParams,
    "kvrelay_fetch_result": L.FetchResult,
    "kvrelay_source_speed": L.SourceSpeed,
    "kvrelay_agent_stats": L.AgentStats,
    "kvrelay_kv_segment": L.KvSegment,
    "kvrelay_kv_extent": L.KvExtent,
    "kvrelay_candidate": L.Candidate,
    "kvrelay_candidate_counts": L.CandidateCounts,
    "kvrelay_fetch_request": L.FetchRequest,
    "kvrelay_provider": L.Provider,
    "kvrelay_request_info": L.RequestInfo,
    "kvrelay_decision": L.Decision,
    "kvrelay_policy_counters": L.PolicyCounters,
    "kvrelay_action": L.Action,
    "kvrelay_fetch_callbacks": L.FetchCallbacks,
}


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
