#!/usr/bin/env python3
"""Writes a tiny random-weight llama GGUF for smoke tests (no dependencies, same bytes every run).

    python3 integrations/llama.cpp/tests/tiny_gguf.py OUT.gguf
    python3 integrations/llama.cpp/tests/tiny_gguf.py --phi3-longrope OUT.gguf

2 layers, n_embd 64, 4 heads / 2 KV heads, FFN 128, F32 weights from a fixed LCG; a byte-level
SentencePiece vocabulary (<unk>, <s>, </s> and the 256 byte tokens) and a ChatML chat template.
Its answers are noise: it exists so llama-server can load something where no real model can travel.
--phi3-longrope writes the same shapes as a "phi3" model with LongRoPE factors (write_phi3_longrope).
"""
import struct
import sys

ALIGN = 32
N_VOCAB, N_EMBD, N_HEAD, N_HEAD_KV, N_FF, N_LAYER, N_CTX = 259, 64, 4, 2, 128, 2, 4096
HEAD_DIM = N_EMBD // N_HEAD

T_U32, T_I32, T_F32, T_BOOL, T_STR, T_ARR = 4, 5, 6, 7, 8, 9

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def s(text):
    b = text.encode()
    return struct.pack("<Q", len(b)) + b


def kv(key, typ, value):
    out = s(key) + struct.pack("<I", typ)
    if typ == T_U32:
        out += struct.pack("<I", value)
    elif typ == T_I32:
        out += struct.pack("<i", value)
    elif typ == T_F32:
        out += struct.pack("<f", value)
    elif typ == T_BOOL:
        out += struct.pack("<?", value)
    elif typ == T_STR:
        out += s(value)
    elif typ == T_ARR:
        etyp, items = value
        out += struct.pack("<IQ", etyp, len(items))
        for it in items:
            out += s(it) if etyp == T_STR else struct.pack({T_F32: "<f", T_I32: "<i"}[etyp], it)
    return out


class Lcg:
    def __init__(self, seed):
        self.x = seed

    def floats(self, n, scale):
        out = []
        x = self.x
        for _ in range(n):
            x = (x * 6364136223846793005 + 1442695040888963407) & 0xFFFFFFFFFFFFFFFF
            out.append(((x >> 40) / float(1 << 24) * 2.0 - 1.0) * scale)
        self.x = x
        return out


def vocab_meta():
    tokens = ["<unk>", "<s>", "</s>"] + ["<0x%02X>" % i for i in range(256)]
    types = [2, 3, 3] + [6] * 256
    return [
        kv("tokenizer.ggml.model", T_STR, "llama"),
        kv("tokenizer.ggml.tokens", T_ARR, (T_STR, tokens)),
        kv("tokenizer.ggml.scores", T_ARR, (T_F32, [0.0] * N_VOCAB)),
        kv("tokenizer.ggml.token_type", T_ARR, (T_I32, types)),
        kv("tokenizer.ggml.unknown_token_id", T_U32, 0),
        kv("tokenizer.ggml.bos_token_id", T_U32, 1),
        kv("tokenizer.ggml.eos_token_id", T_U32, 2),
        kv("tokenizer.chat_template", T_STR, CHATML),
    ]


def write_gguf(path, meta, tensors, seed=20261203):
    """tensors: (name, ne) or (name, ne, values), ne[0] innermost as GGUF stores it. Without values,
    *norm.weight tensors are all 1.0 and the others take the next floats of one LCG, in list order."""
    rng = Lcg(seed)
    infos, blobs, offset = b"", [], 0
    for t in tensors:
        name, ne = t[0], t[1]
        n = 1
        for d in ne:
            n *= d
        if len(t) > 2:
            vals = list(t[2])
            assert len(vals) == n, name
        else:
            vals = [1.0] * n if name.endswith("norm.weight") else rng.floats(n, 0.2)
        data = struct.pack("<%df" % n, *vals)
        infos += s(name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<Q", d) for d in ne)
        infos += struct.pack("<IQ", 0, offset)  # type F32, offset in the data section
        pad = (-len(data)) % ALIGN
        blobs.append(data + b"\0" * pad)
        offset += len(data) + pad

    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(meta)) + b"".join(meta) + infos
    head += b"\0" * ((-len(head)) % ALIGN)
    with open(path, "wb") as f:
        f.write(head)
        for b in blobs:
            f.write(b)


def main(path):
    meta = [
        kv("general.architecture", T_STR, "llama"),
        kv("general.name", T_STR, "kvrelay-tiny"),
        kv("general.alignment", T_U32, ALIGN),
        kv("llama.context_length", T_U32, N_CTX),
        kv("llama.embedding_length", T_U32, N_EMBD),
        kv("llama.block_count", T_U32, N_LAYER),
        kv("llama.feed_forward_length", T_U32, N_FF),
        kv("llama.attention.head_count", T_U32, N_HEAD),
        kv("llama.attention.head_count_kv", T_U32, N_HEAD_KV),
        kv("llama.rope.dimension_count", T_U32, HEAD_DIM),
        kv("llama.attention.layer_norm_rms_epsilon", T_F32, 1e-5),
    ] + vocab_meta()

    # (name, ne) with ne[0] the innermost dimension, as GGUF stores it
    tensors = [("token_embd.weight", (N_EMBD, N_VOCAB)), ("output_norm.weight", (N_EMBD,)),
               ("output.weight", (N_EMBD, N_VOCAB))]
    for i in range(N_LAYER):
        p = "blk.%d." % i
        tensors += [
            (p + "attn_norm.weight", (N_EMBD,)),
            (p + "attn_q.weight", (N_EMBD, N_HEAD * HEAD_DIM)),
            (p + "attn_k.weight", (N_EMBD, N_HEAD_KV * HEAD_DIM)),
            (p + "attn_v.weight", (N_EMBD, N_HEAD_KV * HEAD_DIM)),
            (p + "attn_output.weight", (N_HEAD * HEAD_DIM, N_EMBD)),
            (p + "ffn_norm.weight", (N_EMBD,)),
            (p + "ffn_gate.weight", (N_EMBD, N_FF)),
            (p + "ffn_up.weight", (N_EMBD, N_FF)),
            (p + "ffn_down.weight", (N_FF, N_EMBD)),
        ]
    write_gguf(path, meta, tensors)


def write_phi3_longrope(path, n_ctx_train=4096, n_ctx_orig=512):
    """Writes a tiny "phi3" GGUF with LongRoPE factors (same sizes, vocabulary and template as main).

    llama.cpp picks the factors per context, not per position: llama_model::get_rope_factors uses
    rope_factors_long when the context's n_ctx_seq > phi3.rope.scaling.original_context_length
    (n_ctx_orig here), else rope_factors_short. n_ctx_seq is n_ctx rounded up to a multiple of 256, or
    with several slots and no unified KV cache (llama-server -np N without --kv-unified) n_ctx / N
    rounded up to 256; llama-server's default (-np auto) is 4 slots with a unified cache, so
    n_ctx_seq = n_ctx. With n_ctx_orig 512: -c 256 or -c 512 take the short factors (all 1.0, plain
    RoPE), -c 768 and up (e.g. -c 2048, or -c 0 = n_ctx_train) take the long ones (1.0 .. 8.0),
    which divide the rotary frequencies, so K at the same positions differs.
    """
    assert n_ctx_orig < n_ctx_train
    n_rot = HEAD_DIM
    meta = [
        kv("general.architecture", T_STR, "phi3"),
        kv("general.name", T_STR, "kvrelay-tiny-longrope"),  # no "phi3" in it: that sets token attributes
        kv("general.alignment", T_U32, ALIGN),
        kv("phi3.context_length", T_U32, n_ctx_train),
        kv("phi3.rope.scaling.original_context_length", T_U32, n_ctx_orig),
        kv("phi3.embedding_length", T_U32, N_EMBD),
        kv("phi3.block_count", T_U32, N_LAYER),
        kv("phi3.feed_forward_length", T_U32, N_FF),
        kv("phi3.attention.head_count", T_U32, N_HEAD),
        kv("phi3.attention.head_count_kv", T_U32, N_HEAD_KV),
        kv("phi3.rope.dimension_count", T_U32, n_rot),
        kv("phi3.attention.layer_norm_rms_epsilon", T_F32, 1e-5),
    ] + vocab_meta()

    n_qkv = N_HEAD * HEAD_DIM + 2 * N_HEAD_KV * HEAD_DIM
    # global (not per-layer) factors, n_rot/2 each: the loader reads them at layer 0 and shares them
    tensors = [("token_embd.weight", (N_EMBD, N_VOCAB)), ("output_norm.weight", (N_EMBD,)),
               ("output.weight", (N_EMBD, N_VOCAB)),
               ("rope_factors_long.weight", (n_rot // 2,), [1.0 + i for i in range(n_rot // 2)]),
               ("rope_factors_short.weight", (n_rot // 2,), [1.0] * (n_rot // 2))]
    for i in range(N_LAYER):
        p = "blk.%d." % i
        tensors += [
            (p + "attn_norm.weight", (N_EMBD,)),
            (p + "attn_qkv.weight", (N_EMBD, n_qkv)),  # Q | K | V rows, K and V with N_HEAD_KV heads
            (p + "attn_output.weight", (N_HEAD * HEAD_DIM, N_EMBD)),
            (p + "ffn_norm.weight", (N_EMBD,)),
            (p + "ffn_up.weight", (N_EMBD, 2 * N_FF)),  # gate and up fused (SwiGLU split)
            (p + "ffn_down.weight", (N_FF, N_EMBD)),
        ]
    write_gguf(path, meta, tensors, seed=20261204)


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--phi3-longrope"] and len(args) == 2:
        write_phi3_longrope(args[1])
    elif len(args) == 1 and not args[0].startswith("--"):
        main(args[0])
    else:
        sys.exit(__doc__)
