"""The Python package's call overhead against the same C calls, in one run
(`python3 benches/python/overhead.py`, with the package importable: `pip install ./python`, or
KVRELAY_LIBRARY and PYTHONPATH=python/src). Compiles overhead_c.c with gcc against the same
libkvrelay.so (the anchor), then times, best of 5 loops each: `Admission.admit` of a small
envelope, the bare ctypes call underneath it, and `Agent.fetch` submissions (to a closed
loopback port: submission only; they queue behind a fetch to a silent listener, then are
cancelled), against the bare `kvrelay_agent_submit` call with prebuilt arguments. The package's
calls are timed twice: with its compiled helper (`kvrelay._fast`, when built) and through
ctypes alone. Bounded: fixed counts."""

import ctypes
import json
import os
import socket
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


def both(f):
    """f() with the package's compiled helper (None when it is not built), then through ctypes
    alone."""
    fast = f() if L.fast is not None else None
    saved, L.fast = L.fast, None
    try:
        slow = f()
    finally:
        L.fast = saved
    return fast, slow


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
    py_admit, ct_admit = both(lambda: best_ns(lambda: edge.admit(raw), 50000))
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

    # one fetch thread, kept busy by a "plug" fetch to a listener that never answers: the timed
    # submissions queue behind it and no agent thread competes for the CPU meanwhile (as in
    # overhead_c.c); then every fetch is cancelled and waited for, untimed
    plug_sock = socket.create_server(("127.0.0.1", 0))
    plug_ep = f"tcp://127.0.0.1:{plug_sock.getsockname()[1]}"
    fp = kvrelay.Fingerprint(32, 1, 1, 64, 2, 1)
    layout = kvrelay.KvLayout.from_buffer(pool, 16, 4096)
    limits = {"max_queued_fetches": 100000, "fetch_threads": 1, "unchecked_fetch": 1}  # the call is measured
    with kvrelay.Agent(fp, layout, Holder(), listen=None, limits=limits) as agent:
        ep, names, dst = "tcp://127.0.0.1:9", [1, 2, 3, 4], [0, 1, 2, 3]
        ebuf = ctypes.create_string_buffer(ep.encode(), len(ep))
        params = L.FetchParams(L.Str(ctypes.addressof(ebuf), len(ep)), (ctypes.c_uint64 * 4)(*names), 4, 0,
                               (ctypes.c_uint32 * 4)(*dst), 4, 1000)
        handles = [ctypes.c_void_p() for _ in range(2000)]

        def plugged(submit_all):
            best = float("inf")
            for _ in range(5):
                plug = agent.fetch(plug_ep, names, dst, deadline_ms=60000)
                time.sleep(0.02)  # the fetch thread takes the plug
                t0 = time.perf_counter_ns()
                fetches = submit_all()
                best = min(best, (time.perf_counter_ns() - t0) / 2000)
                for f in fetches:
                    L.lib.kvrelay_fetch_cancel(f)
                plug.cancel()
                r = L.FetchResult()
                for f in fetches:
                    L.lib.kvrelay_fetch_wait(f, 30000, ctypes.byref(r))
                    L.lib.kvrelay_fetch_free(f)
                plug.result(timeout=30)
            return best

        def bare_all():
            submit, a = L.lib.kvrelay_agent_submit, agent._ptr
            for h in handles:
                submit(a, ctypes.byref(params), None, ctypes.byref(h))
            out = list(handles)
            for h in handles:
                h.value = None
            return out

        def py_all():
            fs = [agent.fetch(ep, names, dst, deadline_ms=1000) for _ in range(2000)]
            out = [ctypes.c_void_p(f._handle.value) for f in fs]
            for f in fs:  # the handles are freed above, after the wait
                f._handle = ctypes.c_void_p()
            return out

        bare_fetch = plugged(bare_all)
        py_fetch, ct_fetch = both(lambda: plugged(py_all))
    plug_sock.close()

    print(f"python {sys.version.split()[0]}, kvrelay {kvrelay.version()}, {os.cpu_count()} CPUs, compiled helper: {'yes' if L.fast else 'no'}")
    print(f"{'call':<30} {'C ns':>7} {'bare ctypes':>12} {'kvrelay, ctypes':>16} {'over C':>8} {'kvrelay, helper':>16} {'over C':>8}")
    for name, cn, bare_ns, ct, py in [
        ("admit (small envelope)", c["admit_ns"], bare_admit, ct_admit, py_admit),
        ("fetch submission (4 blocks)", c["fetch_submit_ns"], bare_fetch, ct_fetch, py_fetch),
    ]:
        fast = f"{py:>16.0f} {py - cn:>8.0f}" if py is not None else f"{'-':>16} {'-':>8}"
        print(f"{name:<30} {cn:>7.0f} {bare_ns:>12.0f} {ct:>16.0f} {ct - cn:>8.0f} {fast}")


if __name__ == "__main__":
    main()
