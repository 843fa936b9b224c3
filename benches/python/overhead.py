"""The Python package's call overhead against the same C calls, in one run
(`python3 benches/python/overhead.py`, with the package importable: `pip install ./python`, or
KVRELAY_LIBRARY and PYTHONPATH=python/src). Compiles overhead_c.c with gcc against the same
libkvrelay.so (the anchor), then times, best of 5 loops each: `Admission.admit` of a small
envelope, the bare ctypes call underneath it, and `Agent.fetch` submissions (to a closed
loopback port: submission only, the fetch fails on the agent's thread). Bounded: fixed counts."""

import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import kvrelay
from kvrelay import _lib as L

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
ENV = json.dumps(
    {
        "protocol_version": "0.1",
        "message_id": "bench",
        "actions": [
            {
                "action_id": "a1",
                "action_type": "kv.fetch",
                "action_version": "1.0",
                "payload": {"source_control_endpoint": "tcp://127.0.0.1:7000", "block_hashes": [1, 2]},
            }
        ],
    },
    separators=(",", ":"),
)


def best_ns(f, n):
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            f()
        best = min(best, (time.perf_counter_ns() - t0) / n)
    return best


def main():
    libpath = Path(L.lib._name).resolve()
    with tempfile.TemporaryDirectory() as d:
        exe = Path(d) / "overhead_c"
        subprocess.run(
            ["gcc", "-O2", "-I", str(ROOT / "include"), str(HERE / "overhead_c.c"), "-o", str(exe), str(libpath),
             f"-Wl,-rpath,{libpath.parent}"],
            check=True,
        )
        out = subprocess.run([str(exe), ENV, "200000"], capture_output=True, text=True, check=True).stdout
    c = {k: float(v) for k, v in (line.split() for line in out.splitlines())}

    edge = kvrelay.Admission(trusted=True)
    raw = ENV.encode()
    py_admit = best_ns(lambda: edge.admit(raw), 50000)
    o, s = L.Outcome(), ctypes.c_void_p()
    buf = ctypes.create_string_buffer(raw, len(raw))
    n = len(raw)

    def bare():
        L.lib.kvrelay_admit(edge._ptr, buf, n, ctypes.byref(o), ctypes.byref(s))
        L.lib.kvrelay_snapshot_release(s)

    bare_admit = best_ns(bare, 50000)

    pool = bytearray(16 * 4096)

    class Holder:
        def pin(self, names):
            return []

        def unpin(self, ids):
            pass

    fp = kvrelay.Fingerprint(32, 1, 1, 64, 2, 1)
    layout = kvrelay.KvLayout.from_buffer(pool, 16, 4096)
    with kvrelay.Agent(fp, layout, Holder(), listen=None, limits={"max_queued_fetches": 100000}) as agent:
        fetches = []

        def submit():
            fetches.append(agent.fetch("tcp://127.0.0.1:9", [1, 2, 3, 4], [0, 1, 2, 3], deadline_ms=1000))

        py_fetch = float("inf")
        for _ in range(5):
            t0 = time.perf_counter_ns()
            for _ in range(2000):
                submit()
            py_fetch = min(py_fetch, (time.perf_counter_ns() - t0) / 2000)
            for f in fetches:
                f.result(timeout=30)
            fetches.clear()

    print(f"python {sys.version.split()[0]}, kvrelay {kvrelay.version()}, {os.cpu_count()} CPUs")
    print(f"{'call':<34} {'C ns':>9} {'bare ctypes ns':>15} {'kvrelay (Python) ns':>20} {'overhead ns':>12}")
    print(f"{'admit (small envelope)':<34} {c['admit_ns']:>9.0f} {bare_admit:>15.0f} {py_admit:>20.0f} {py_admit - c['admit_ns']:>12.0f}")
    print(f"{'fetch submission':<34} {c['fetch_submit_ns']:>9.0f} {'':>15} {py_fetch:>20.0f} {py_fetch - c['fetch_submit_ns']:>12.0f}")


if __name__ == "__main__":
    main()
