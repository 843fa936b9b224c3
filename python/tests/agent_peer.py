"""The serving side of test_agent.py, in its own process: a pool of N blocks filled with a
known pattern, named 1000 + i, checksums recorded; prints its endpoint, then serves until its
stdin closes."""

import sys

import kvrelay

from test_agent import BLOCK, DIGESTS, FP, N, pattern


class Holder:
    def __init__(self):
        self.ids = {1000 + i: i for i in range(N)}
        self.pins = 0

    def pin(self, names):
        out = []
        for n in names:
            if n not in self.ids:
                break
            out.append(self.ids[n])
        self.pins += len(out)
        return out

    def unpin(self, ids):
        self.pins -= len(ids)


def main():
    pool = bytearray(pattern(N))
    layout = kvrelay.KvLayout.from_buffer(pool, N, BLOCK)
    with kvrelay.Agent(FP, layout, Holder(), key=b"a shared secret of the two") as agent:
        agent.record_checksums(range(N))
        agent.record_digests(range(N), DIGESTS)
        print(agent.endpoint, flush=True)
        sys.stdin.read()
        print(agent.stats["blocks_sent"], flush=True)


if __name__ == "__main__":
    main()
