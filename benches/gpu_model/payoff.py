"""The real GPU payoff: fetch against a real 8B prefill on one GPU (run on the H200 machine).

A Llama-3-8B-shaped model (32 layers, hidden 4096, 32 heads / 8 KV heads, head size 128,
vocab 128,256) with seeded random weights in bf16 (no download), in two processes on one GPU,
each with a static KV cache (transformers' `StaticCache`, one [1, 8, max_len, 128] K and V
tensor per layer). Process A (the source) prefills each prompt and serves its KV through the
kvrelay agent straight from the cache tensors: the layout has one segment per (layer, K/V,
head), block `b` of a segment being that head's 32 rows at positions 32b..32b+31 (8 KiB), so a
block is 512 strided runs, 4 MiB. Process B (this one) fetches the prompt's prefix (every block
but the last) through the agent straight into its own cache tensors, over TCP (the agent stages
through pinned host memory), with `--nixl-lib-dir` over NIXL (VRAM to VRAM) and with
`--cuda-ipc` over the same-host CUDA IPC transport (the source serves it, and TCP too; B maps
A's cache tensors and one kernel copies and verifies); with both, all three in the same run (the
source's agent then prefers CUDA IPC, then NIXL, and serves all three). Then B runs the last
block and generates greedily.

Per prompt length (1k-32k tokens) it reports B's time to first token with fetch against its own
real prefill of the whole prompt, the fetch's bytes/s against the copy ceilings measured in
the same run (a device-to-device copy and a pinned host-to-device copy of the same bytes), and
checks the answer two ways: after a fetch, the last block's logits and the greedy tokens must be
bit-identical to B's own cold prefill done in the same two parts (the prefix, then the last
block), which is what a fetch replaces; and the greedy tokens are compared with a one-shot
prefill of the whole prompt too, with that prefill's top-two logit margin (bf16 arithmetic of a
32-token batch and of a whole prompt differ in low bits, and random weights leave near ties).

Usage (PYTHONPATH holding the kvrelay package, KVRELAY_LIBRARY its library, built with the
`nixl` feature for `--nixl-lib-dir`):
    python3 benches/gpu_model/payoff.py [--max-tokens 32768] [--gen 16] [--nixl-lib-dir DIR] [--cuda-ipc] [--streams N]
Bounded: fixed lengths, each fetch has a deadline, the source exits when B closes its stdin.
"""

import argparse
import hashlib
import json
import os
import struct
import subprocess
import sys
import time

# deterministic cuBLAS (no split-K reductions that change with timing): without it, decoding the
# same cache twice gave different greedy tokens at the near ties of random weights
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, StaticCache  # noqa: E402

import kvrelay  # noqa: E402

torch.use_deterministic_algorithms(True, warn_only=True)

BT = 32
LAYERS, HEADS, KV_HEADS, HEAD_DIM = 32, 32, 8, 128
HEAD_BLOCK = BT * HEAD_DIM * 2  # one head's rows of one block, bf16
BLOCK_BYTES = LAYERS * 2 * KV_HEADS * HEAD_BLOCK  # 4 MiB
FP = kvrelay.Fingerprint(BT, LAYERS, KV_HEADS, HEAD_DIM, 2, naming=0x6B76_6770_755F_3862)
LENGTHS = [1024, 2048, 4096, 8192, 16384, 32768]


def config(max_len):
    return LlamaConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        vocab_size=128256,
        max_position_embeddings=max_len,
        rope_theta=500000.0,
    )


def build(max_len):
    torch.manual_seed(1234)
    cfg = config(max_len)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg)
    model = model.to(torch.bfloat16).eval()
    cache = StaticCache(config=cfg, max_cache_len=max_len)
    cache.early_initialization(
        batch_size=1, num_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=torch.bfloat16, device=torch.device("cuda")
    )
    segs, exts = [], []
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            assert t.is_contiguous() and tuple(t.shape) == (1, KV_HEADS, max_len, HEAD_DIM), t.shape
            base = t.data_ptr()
            exts.append((base, t.numel() * t.element_size()))
            for h in range(KV_HEADS):
                segs.append((base + h * max_len * HEAD_DIM * 2, HEAD_BLOCK, HEAD_BLOCK))
    layout = kvrelay.KvLayout(max_len // BT, segs, exts, keep=cache)
    assert layout.block_bytes == BLOCK_BYTES
    return model, cache, layout


def prompt(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128256, (n,), generator=g).tolist()


def names(tokens):
    out, prev = [], 0
    for b in range(len(tokens) // BT):
        h = hashlib.blake2b(prev.to_bytes(8, "little") + struct.pack(f"<{BT}I", *tokens[b * BT : (b + 1) * BT]), digest_size=8)
        prev = int.from_bytes(h.digest(), "little")
        out.append(prev)
    return out


@torch.inference_mode()
def forward(model, cache, ids, start):
    x = torch.tensor(ids, device="cuda")[None]
    pos = torch.arange(start, start + len(ids), device="cuda")[None]
    out = model(input_ids=x, past_key_values=cache, position_ids=pos, use_cache=True, logits_to_keep=1)
    return out.logits[0, -1].float()


def generate(model, cache, logits, pos, n):
    toks = [int(logits.argmax())]
    for i in range(n - 1):
        toks.append(int(forward(model, cache, [toks[-1]], pos + i).argmax()))
    return toks


def set_length(cache, n):
    for layer in cache.layers:
        layer.cumulative_length.fill_(n)


def source(args):
    model, cache, layout = build(args.max_len)
    index = {}

    class Holder:
        def pin(self, ns):
            ids = []
            for n in ns:
                i = index.get(n)
                if i is None:
                    break
                ids.append(i)
            return ids

        def unpin(self, ids):
            pass

    # with both: one agent that serves CUDA IPC, NIXL and TCP readers
    transport = ",".join(t for t, on in (("cuda-ipc", args.cuda_ipc), ("nixl", args.nixl_lib_dir)) if on) or "tcp"
    agent = kvrelay.Agent(
        FP, layout, Holder(), device=0, transport=transport, nixl_lib_dir=args.nixl_lib_dir, limits=limits(args)
    )
    print(json.dumps({"endpoint": agent.endpoint, "allocator": torch.cuda.get_allocator_backend()}), flush=True)
    for line in sys.stdin:
        n, seed = map(int, line.split())
        toks = prompt(n, seed)
        cache.reset()
        forward(model, cache, toks, 0)
        torch.cuda.synchronize()
        ns = names(toks)
        index.clear()
        index.update({x: i for i, x in enumerate(ns)})
        agent.record_checksums(range(len(ns)))
        print(json.dumps({"ready": len(ns)}), flush=True)
    agent.close()


def ceilings(nbytes):
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    best_d2d = best_h2d = float("inf")
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        best_d2d = min(best_d2d, time.perf_counter() - t0)
        t0 = time.perf_counter()
        dst.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        best_h2d = min(best_h2d, time.perf_counter() - t0)
    del src, dst, host
    torch.cuda.empty_cache()
    return nbytes / best_d2d / 1e9, nbytes / best_h2d / 1e9


def limits(args):
    """The agents' limits: the defaults, or ``--streams`` streams per fetch."""
    return {"streams": args.streams} if args.streams else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--source", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--max-tokens", type=int, default=32768)
    ap.add_argument("--gen", type=int, default=16)
    ap.add_argument("--nixl-lib-dir", default=None)
    ap.add_argument("--cuda-ipc", action="store_true", help="the same-host CUDA IPC transport too")
    ap.add_argument("--check", action="store_true", help="compare the whole cache after each fetch (diagnostics)")
    ap.add_argument("--no-warmup", action="store_true", help="measure first-use costs too (no warm-up fetches)")
    ap.add_argument("--streams", type=int, default=0, help="TCP streams per fetch (0: the library's default)")
    ap.add_argument("--max-len", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    lengths = [n for n in LENGTHS if n <= args.max_tokens]
    if not args.max_len:
        args.max_len = max(lengths) + 2 * BT + args.gen // BT * BT
    if args.source:
        return source(args)

    cmd = [sys.executable, os.path.abspath(__file__), "--source", "--max-len", str(args.max_len)]
    cmd += ["--streams", str(args.streams)]
    if args.nixl_lib_dir:
        cmd += ["--nixl-lib-dir", args.nixl_lib_dir]
    if args.cuda_ipc:
        cmd += ["--cuda-ipc"]
    src = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        hello = json.loads(src.stdout.readline())
        ep = hello["endpoint"]
        model, cache, layout = build(args.max_len)

        class NoHolder:
            def pin(self, ns):
                return []

            def unpin(self, ids):
                pass

        agents = {"tcp": kvrelay.Agent(FP, layout, NoHolder(), listen=None, device=0, limits=limits(args))}
        if args.nixl_lib_dir:
            agents["nixl"] = kvrelay.Agent(
                FP, layout, NoHolder(), listen=None, device=0, transport="nixl", nixl_lib_dir=args.nixl_lib_dir
            )
        if args.cuda_ipc:
            agents["cuda-ipc"] = kvrelay.Agent(FP, layout, NoHolder(), listen=None, device=0, transport="cuda-ipc")
        print(
            f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}, allocator {torch.cuda.get_allocator_backend()} "
            f"(source: {hello['allocator']}); kvrelay {kvrelay.version()}; Llama-3-8B shape, bf16, SDPA, static cache "
            f"of {args.max_len} tokens; KV {BLOCK_BYTES // BT // 1024} KiB/token; {args.gen} greedy tokens; "
            f"TCP streams per fetch: {args.streams or 'the default'}",
            flush=True,
        )
        # warm-up: kernels, cuBLAS handles, and the agents' connections at both ends (the
        # agents make their movers when they start), so the table measures fetches, not
        # first-use setup
        cache.reset()
        forward(model, cache, prompt(1024, 1), 0)
        torch.cuda.synchronize()
        wn = 0 if args.no_warmup else min(8192, max(lengths))
        if wn:
            src.stdin.write(f"{wn} 7\n")
            src.stdin.flush()
            json.loads(src.stdout.readline())
            wnames = names(prompt(wn, 7))
            for agent in agents.values():
                for _ in range(2):
                    r = agent.fetch(ep, wnames, list(range(len(wnames))), deadline_ms=300_000).result(timeout=400)
                    assert r.ok, r
        hdr = (
            f"{'tokens':>7} {'prefill ms':>11} {'transport':>9} {'fetch ms':>9} {'fetch GB/s':>10} {'TTFT ms':>8} "
            f"{'TTFT/prefill':>12} {'D2D GB/s':>9} {'H2D GB/s':>9} {'tokens eq':>10} {'logits eq':>9} "
            f"{'= 1-shot':>9} {'margin':>7}"
        )
        print(hdr, flush=True)
        for n in lengths:
            toks = prompt(n, n)
            ns = names(toks)
            p = n - BT
            nb = p // BT
            src.stdin.write(f"{n} {n}\n")
            src.stdin.flush()
            ready = json.loads(src.stdout.readline())
            assert ready["ready"] == len(ns), ready
            d2d, h2d = ceilings(nb * BLOCK_BYTES)
            # B's own cold prefill of the whole prompt
            cache.reset()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            logits = forward(model, cache, toks, 0)
            first = int(logits.argmax())
            t_cold = time.perf_counter() - t0
            cold = generate(model, cache, logits, n, args.gen)
            assert cold[0] == first
            # B's own two-part prefill: the prefix, then the last block (what a fetch replaces)
            cache.reset()
            forward(model, cache, toks[:p], 0)
            two_part = forward(model, cache, toks[p:], p)
            ref = [(l.keys[:, :, :n].clone(), l.values[:, :, :n].clone()) for l in cache.layers] if args.check else None
            two_part_gen = generate(model, cache, two_part, n, args.gen)
            if args.check:
                cache.reset()
                forward(model, cache, toks[:p], 0)
                again = generate(model, cache, forward(model, cache, toks[p:], p), n, args.gen)
                print(f"check {n}: two-part generation repeats: {again == two_part_gen}", flush=True)
            top2 = torch.topk(logits, 2).values
            margin = float(top2[0] - top2[1])
            for name, agent in agents.items():
                cache.reset()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                r = agent.fetch(ep, ns[:nb], list(range(nb)), deadline_ms=300_000).result(timeout=400)
                t_fetch = time.perf_counter() - t0
                assert r.ok and r.blocks == nb, r
                set_length(cache, p)
                logits_f = forward(model, cache, toks[p:], p)
                if args.check:
                    torch.cuda.synchronize()
                    same = all(torch.equal(l.keys[:, :, :n], k) and torch.equal(l.values[:, :, :n], v) for l, (k, v) in zip(cache.layers, ref))
                    rest = all(int(torch.count_nonzero(l.keys[:, :, n:])) == 0 and int(torch.count_nonzero(l.values[:, :, n:])) == 0 for l in cache.layers)
                    bad = [i for i, (l, (k, v)) in enumerate(zip(cache.layers, ref)) if not torch.equal(l.keys[:, :, :n], k)]
                    print(f"check {n} {name}: cache[:n] equal {same} (layers differing in K: {bad[:8]}), cache[n:] zero {rest}", flush=True)
                int(logits_f.argmax())
                ttft = time.perf_counter() - t0
                got = generate(model, cache, logits_f, n, args.gen)
                print(
                    f"{n:>7} {t_cold * 1e3:>11.1f} {name:>9} {t_fetch * 1e3:>9.1f} {r.bytes / t_fetch / 1e9:>10.2f} "
                    f"{ttft * 1e3:>8.1f} {ttft / t_cold:>12.3f} {d2d:>9.1f} {h2d:>9.1f} {str(got == two_part_gen):>10} "
                    f"{str(torch.equal(logits_f, two_part)):>9} {str(got == cold):>9} {margin:>7.3f}",
                    flush=True,
                )
        for name, a in agents.items():
            print(f"{name} agent: {json.dumps({k: v for k, v in a.stats.items() if v})}")
            a.close()
    finally:
        if src.stdin:
            src.stdin.close()
        src.wait(timeout=120)


if __name__ == "__main__":
    main()
