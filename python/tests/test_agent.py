import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import kvrelay

N = 12
BLOCK = 8192
FP = kvrelay.Fingerprint(block_tokens=32, layers=2, kv_heads=2, head_dim=16, dtype_bytes=2, naming=0x6B76)
# the source's blocks hold the KV of these tokens; a checked fetch asks for their digests
IDENTITY = b"the test engine: its model by content and every setting that changes KV"
NAMING = kvrelay.Naming(seed=0x6B76, block_tokens=32)
TOKENS = [7 * i % 50257 for i in range(N * 32)]
DIGESTS = NAMING.digests(IDENTITY, TOKENS)


def pattern(n):
    return bytes((i * 31 + i // BLOCK) & 0xFF for i in range(n * BLOCK))


class Pool:
    def __init__(self, blocks):
        self.buf = bytearray(blocks * BLOCK)
        self.layout = kvrelay.KvLayout.from_buffer(self.buf, blocks, BLOCK)

    def pin(self, names):
        return []

    def unpin(self, ids):
        pass


@pytest.fixture(scope="module")
def source():
    here = Path(__file__).parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))  # the same kvrelay as this process
    p = subprocess.Popen(
        [sys.executable, str(here / "agent_peer.py")],
        cwd=here,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    endpoint = p.stdout.readline().strip()
    assert endpoint.startswith("tcp://127.0.0.1:"), endpoint
    yield p, endpoint
    p.stdin.close()
    p.wait(timeout=30)


def test_two_processes_serve_and_fetch_byte_exact(source):
    proc, endpoint = source
    dst = Pool(16)
    with kvrelay.Agent(FP, dst.layout, dst, listen=None, key=b"a shared secret of the two") as agent:
        names = [1000 + i for i in range(N)]
        dst_blocks = list(range(4, 4 + N - 2))
        # by name alone: refused unless the agent's limit allows it
        with pytest.raises(kvrelay.KvrelayError, match="unchecked_fetch"):
            agent.fetch(endpoint, names, dst_blocks, held=2)
        with pytest.raises(ValueError):
            agent.fetch(endpoint, names, dst_blocks, held=2, digests=DIGESTS[:3])  # one per name
        f = agent.fetch(endpoint, names, dst_blocks, held=2, digests=DIGESTS)
        r = f.result(timeout=30)
        assert (r.failure, r.blocks, r.bytes, r.withheld) == ("ok", N - 2, (N - 2) * BLOCK, 0), r
        want = pattern(N)
        assert bytes(dst.buf[4 * BLOCK : (4 + N - 2) * BLOCK]) == want[2 * BLOCK :]
        assert bytes(dst.buf[: 4 * BLOCK]) == bytes(4 * BLOCK), "nothing written outside the destination blocks"
        s = agent.stats
        assert (s["fetches_ok"], s["blocks_fetched"]) == (1, N - 2)
        # completion by future and by callback
        got = threading.Event()
        seen = []
        f2 = agent.fetch(endpoint, names, [0], digests=DIGESTS, callback=lambda res: (seen.append(res), got.set()))
        assert f2.future.result(timeout=30).blocks == 1
        assert got.wait(30) and seen[0].ok
        assert bytes(dst.buf[:BLOCK]) == want[:BLOCK]
        # landed blocks hold what was recorded for them; one changed in place after landing is
        # found (the blocks before it still count), one with nothing recorded fails
        landed = list(range(4, 4 + N - 2))
        assert agent.verify_blocks(landed) == N - 2
        dst.buf[7 * BLOCK + 100] ^= 0x01
        assert agent.verify_blocks(landed) == 3
        dst.buf[7 * BLOCK + 100] ^= 0x01
        assert agent.verify_blocks([4, 15]) == 1, "block 15 never landed: nothing recorded"
        with pytest.raises(kvrelay.KvrelayError):
            agent.verify_blocks([16])  # past the pool
        # a name the source lacks: the source offers nothing
        miss = agent.fetch(endpoint, [5, 6], [0, 1], digests=DIGESTS[:2]).result(timeout=30)
        assert (miss.failure, miss.blocks) == ("source_miss", 0) and miss.detail
        # the names held, but other content asked for (other tokens: a collision, crafted or
        # not): nothing of it is written
        other = NAMING.digests(IDENTITY, [t + 1 for t in TOKENS])
        before = bytes(dst.buf[14 * BLOCK : 16 * BLOCK])
        bad = agent.fetch(endpoint, names[:2], [14, 15], digests=other[:2]).result(timeout=30)
        assert (bad.failure, bad.blocks) == ("digest_mismatch", 0), bad
        assert bytes(dst.buf[14 * BLOCK : 16 * BLOCK]) == before
        # the digests are the library's: a name of the same tokens under another identity differs
        assert NAMING.digests(b"another engine", TOKENS)[0] != DIGESTS[0]
        assert NAMING.names(TOKENS) == kvrelay.Naming(0x6B76, 32).names(TOKENS) and len(NAMING.names(TOKENS)) == N
        with kvrelay.Agent(FP, dst.layout, dst, listen=None, key=b"a shared secret of the two",
                           limits={"unchecked_fetch": 1}) as by_name:
            assert by_name.fetch(endpoint, names, [1]).result(timeout=30).blocks == 1
        assert "kvrelay_kv_agent_" in agent.prometheus()
        assert agent.estimate(endpoint, 10) > 0


def test_a_wrong_key_or_fingerprint_is_refused(source):
    _, endpoint = source
    dst = Pool(4)
    # no key given: the per-user key (not the source's); authentication off: no key at all
    for kw in ({}, {"per_user_key": False}):
        with kvrelay.Agent(FP, dst.layout, dst, listen=None, **kw) as a:
            assert a.fetch(endpoint, [1000], [0], digests=DIGESTS[:1]).result(timeout=30).failure == "auth_failed"
    with kvrelay.Agent(FP, dst.layout, dst, listen=None, key=b"another key, 16 bytes at least") as a:
        assert a.fetch(endpoint, [1000], [0], digests=DIGESTS[:1]).result(timeout=30).failure == "auth_failed"
    other = kvrelay.Fingerprint(32, 2, 2, 16, 2, naming=1)
    with kvrelay.Agent(other, dst.layout, dst, listen=None, key=b"a shared secret of the two") as a:
        assert a.fetch(endpoint, [1000], [0], digests=DIGESTS[:1]).result(timeout=30).failure == "fingerprint_mismatch"
    assert bytes(dst.buf) == bytes(4 * BLOCK)


def test_copy_engine_over_a_buffer_and_tensor_like_objects():
    buf = bytearray(pattern(4))
    layout = kvrelay.KvLayout.from_buffer(buf, 4, BLOCK)
    eng = kvrelay.CpuEngine(layout)
    out = bytearray(2 * BLOCK)
    eng.gather([3, 1], out)
    assert bytes(out) == bytes(buf[3 * BLOCK :]) + bytes(buf[BLOCK : 2 * BLOCK])
    eng.scatter(bytes(2 * BLOCK), [0, 2])
    assert bytes(buf[:BLOCK]) == bytes(BLOCK) and bytes(buf[2 * BLOCK : 3 * BLOCK]) == bytes(BLOCK)
    with pytest.raises(kvrelay.KvrelayError):
        eng.gather([9], bytearray(BLOCK))
    with pytest.raises(ValueError):
        eng.gather([-1], bytearray(BLOCK))
    with pytest.raises(ValueError):
        kvrelay.KvLayout.from_buffer(bytes(BLOCK), 1, BLOCK)

    class FakeTensor:
        """What KvLayout.from_tensors reads of a torch.Tensor: [blocks, heads, dim] of 2 bytes."""

        def __init__(self, mem, shape):
            self.mem, self.shape = mem, shape

        def data_ptr(self):
            import ctypes

            return ctypes.addressof((ctypes.c_char * len(self.mem)).from_buffer(self.mem))

        def element_size(self):
            return 2

        def stride(self):
            return (self.shape[1] * self.shape[2], self.shape[2], 1)

    k, v = bytearray(4 * 256), bytearray(4 * 256)
    t = kvrelay.KvLayout.from_tensors([FakeTensor(k, (4, 2, 64)), FakeTensor(v, (4, 2, 64))])
    assert (t.num_blocks, t.block_bytes) == (4, 512)
    v[256:512] = b"\x07" * 256
    stage = bytearray(512)
    kvrelay.CpuEngine(t).gather([1], stage)
    assert bytes(stage) == bytes(256) + b"\x07" * 256


def test_bad_agent_arguments():
    dst = Pool(2)
    with pytest.raises(TypeError):
        kvrelay.Agent("fp", dst.layout, dst)
    with pytest.raises(TypeError):
        kvrelay.Agent(FP, dst.layout, object())
    with pytest.raises(ValueError):
        kvrelay.Agent(FP, dst.layout, dst, limits={"no_such_limit": 1})
    # a limit past its field's range is refused, never wrapped (2**32 + 4 would become 4)
    with pytest.raises(kvrelay.KvrelayError):
        kvrelay.Agent(FP, dst.layout, dst, limits={"streams": 2**32 + 4})
    with pytest.raises(ValueError):
        kvrelay.Agent(FP, dst.layout, dst, limits={"streams": -1})
    with kvrelay.Agent(FP, dst.layout, dst, listen=None, limits={"streams": 2, "idle_timeout_ms": 0}) as a:
        assert a.stats["fetches_submitted"] == 0
    with pytest.raises(TypeError):
        kvrelay.Agent(FP, dst.layout, dst, per_user_key="no")
    with kvrelay.Agent(FP, dst.layout, dst, listen=None) as a:
        with pytest.raises(ValueError):
            a.fetch("tcp://127.0.0.1:1", [1, 2], [])
        with pytest.raises(ValueError):
            a.fetch("tcp://127.0.0.1:1", [1], [0, 1])
        with pytest.raises(kvrelay.KvrelayError):
            a.fetch("tcp://127.0.0.1:1", [1], [7])  # past the pool
