#!/usr/bin/env python3
"""Writes a random-weight llama GGUF of a chosen shape, F16 weights, for timing runs where no
real model can travel (the GPU machine: nothing outside it can be reached and a call carries at
most 64 MiB). Standard library only; fast at any size: one buffer of small F16 values from a
fixed LCG is tiled over every weight tensor, so the same arguments give the same bytes.

    python3 benches/llama_server/random_gguf.py OUT.gguf [--layers 16] [--embd 2048] [--heads 32]
        [--heads-kv 8] [--ff 8192]

The defaults are the shape of a 1B-parameter Llama 3.2 (16 layers, n_embd 2048, 32 heads and 8 KV
heads of 64, FFN 8192), with a byte-level SentencePiece vocabulary (259 tokens) instead of its
own: about 2 GB. Its answers are noise; its prefill costs what the shape costs.
"""
import argparse
import struct

ALIGN = 32
T_U32, T_I32, T_F32, T_STR, T_ARR = 4, 5, 6, 8, 9
GGML_F32, GGML_F16 = 0, 1


def s(text):
    b = text.encode()
    return struct.pack("<Q", len(b)) + b


def kv(key, typ, value):
    out = s(key) + struct.pack("<I", typ)
    if typ == T_U32:
        out += struct.pack("<I", value)
    elif typ == T_F32:
        out += struct.pack("<f", value)
    elif typ == T_STR:
        out += s(value)
    elif typ == T_ARR:
        etyp, items = value
        out += struct.pack("<IQ", etyp, len(items))
        for it in items:
            out += s(it) if etyp == T_STR else struct.pack({T_F32: "<f", T_I32: "<i"}[etyp], it)
    return out


def tile(n_bytes, unit):
    reps, rest = divmod(n_bytes, len(unit))
    return unit * reps + unit[:rest]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--embd", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--heads-kv", type=int, default=8)
    ap.add_argument("--ff", type=int, default=8192)
    ap.add_argument("--ctx", type=int, default=8192)
    a = ap.parse_args()
    head_dim = a.embd // a.heads
    tokens = ["<unk>", "<s>", "</s>"] + ["<0x%02X>" % i for i in range(256)]
    n_vocab = len(tokens)
    meta = [
        kv("general.architecture", T_STR, "llama"),
        kv("general.name", T_STR, "kvrelay-random-%dL-%d" % (a.layers, a.embd)),
        kv("general.alignment", T_U32, ALIGN),
        kv("llama.context_length", T_U32, a.ctx),
        kv("llama.embedding_length", T_U32, a.embd),
        kv("llama.block_count", T_U32, a.layers),
        kv("llama.feed_forward_length", T_U32, a.ff),
        kv("llama.attention.head_count", T_U32, a.heads),
        kv("llama.attention.head_count_kv", T_U32, a.heads_kv),
        kv("llama.rope.dimension_count", T_U32, head_dim),
        kv("llama.attention.layer_norm_rms_epsilon", T_F32, 1e-5),
        kv("tokenizer.ggml.model", T_STR, "llama"),
        kv("tokenizer.ggml.tokens", T_ARR, (T_STR, tokens)),
        kv("tokenizer.ggml.scores", T_ARR, (T_F32, [0.0] * n_vocab)),
        kv("tokenizer.ggml.token_type", T_ARR, (T_I32, [2, 3, 3] + [6] * 256)),
        kv("tokenizer.ggml.unknown_token_id", T_U32, 0),
        kv("tokenizer.ggml.bos_token_id", T_U32, 1),
        kv("tokenizer.ggml.eos_token_id", T_U32, 2),
    ]
    tensors = [("token_embd.weight", (a.embd, n_vocab)), ("output_norm.weight", (a.embd,)),
               ("output.weight", (a.embd, n_vocab))]
    for i in range(a.layers):
        p = "blk.%d." % i
        tensors += [
            (p + "attn_norm.weight", (a.embd,)),
            (p + "attn_q.weight", (a.embd, a.heads * head_dim)),
            (p + "attn_k.weight", (a.embd, a.heads_kv * head_dim)),
            (p + "attn_v.weight", (a.embd, a.heads_kv * head_dim)),
            (p + "attn_output.weight", (a.heads * head_dim, a.embd)),
            (p + "ffn_norm.weight", (a.embd,)),
            (p + "ffn_gate.weight", (a.embd, a.ff)),
            (p + "ffn_up.weight", (a.embd, a.ff)),
            (p + "ffn_down.weight", (a.ff, a.embd)),
        ]
    # 64 Ki small F16 values in (-0.04, 0.04), from a fixed LCG (an odd count, so that tiled
    # rows do not repeat in step with the tensors' widths)
    x, vals = 20261203, []
    for _ in range(65521):
        x = (x * 6364136223846793005 + 1442695040888963407) & 0xFFFFFFFFFFFFFFFF
        vals.append(((x >> 40) / float(1 << 24) * 2.0 - 1.0) * 0.04)
    unit = struct.pack("<%de" % len(vals), *vals)
    infos, layout, offset = b"", [], 0
    for name, ne in tensors:
        n = 1
        for d in ne:
            n *= d
        norm = name.endswith("norm.weight")
        size = n * (4 if norm else 2)
        infos += s(name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<Q", d) for d in ne)
        infos += struct.pack("<IQ", GGML_F32 if norm else GGML_F16, offset)
        layout.append((norm, n, size))
        offset += size + (-size) % ALIGN
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(meta)) + b"".join(meta) + infos
    head += b"\0" * ((-len(head)) % ALIGN)
    with open(a.out, "wb") as f:
        f.write(head)
        for norm, n, size in layout:
            f.write(struct.pack("<%df" % n, *([1.0] * n)) if norm else tile(size, unit))
            f.write(b"\0" * ((-size) % ALIGN))
    print("%s: %d layers, n_embd %d, %d/%d heads, FFN %d: %.2f GB" % (a.out, a.layers, a.embd, a.heads, a.heads_kv,
                                                                   a.ff, (len(head) + offset) / 1e9))


if __name__ == "__main__":
    main()
