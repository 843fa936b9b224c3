#!/usr/bin/env python3
"""Writes a tiny random-weight llama GGUF for smoke tests (no dependencies, same bytes every run).

    python3 integrations/llama.cpp/tests/tiny_gguf.py OUT.gguf

2 layers, n_embd 64, 4 heads / 2 KV heads, FFN 128, F32 weights from a fixed LCG; a byte-level
SentencePiece vocabulary (<unk>, <s>, </s> and the 256 byte tokens) and a ChatML chat template.
Its answers are noise: it exists so llama-server can load something where no real model can travel.
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


def main(path):
    tokens = ["<unk>", "<s>", "</s>"] + ["<0x%02X>" % i for i in range(256)]
    types = [2, 3, 3] + [6] * 256
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
        kv("tokenizer.ggml.model", T_STR, "llama"),
        kv("tokenizer.ggml.tokens", T_ARR, (T_STR, tokens)),
        kv("tokenizer.ggml.scores", T_ARR, (T_F32, [0.0] * N_VOCAB)),
        kv("tokenizer.ggml.token_type", T_ARR, (T_I32, types)),
        kv("tokenizer.ggml.unknown_token_id", T_U32, 0),
        kv("tokenizer.ggml.bos_token_id", T_U32, 1),
        kv("tokenizer.ggml.eos_token_id", T_U32, 2),
        kv("tokenizer.chat_template", T_STR, CHATML),
    ]

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

    rng = Lcg(20261203)
    infos, blobs, offset = b"", [], 0
    for name, ne in tensors:
        n = 1
        for d in ne:
            n *= d
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


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
