#!/usr/bin/env python3
"""Fixtures that change the KV a llama-server computes for a given base GGUF (standard library only).

    python3 integrations/llama.cpp/tests/identity_fixtures.py --model MODEL.gguf --out DIR

  write_control_vector(model_path, out_path, strength_seed=1)
      a control-vector GGUF for --control-vector FILE / --control-vector-scaled FILE:SCALE:
      F32 tensors direction.<il> of n_embd for layers 1..n_layer-1 (values from a seeded LCG,
      |v| <= 0.1). Added to every layer's output, so every layer's K and V after the first change.
  write_lora(model_path, out_path, rank=4)
      a LoRA adapter GGUF for --lora FILE / --lora-scaled FILE:SCALE (general.type "adapter",
      adapter.type "lora", the model's architecture, adapter.lora.alpha = rank): F32 pairs
      <name>.lora_a (ne n_in x rank) and <name>.lora_b (ne rank x n_out) for every layer's
      attn_q.weight and attn_k.weight, so the queries and the stored K change.
  write_twin_model(model_path, out_dir) -> path
      a copy of the model with the same file name and byte size whose first layer's attn_k.weight
      is nudged by one quantization step per weight (the LSB of each 4-/8-bit quant; the block
      scales are left alone; F32/F16 weights get one mantissa bit flipped): it loads and answers,
      with other K from layer 0 on and so other answers.

The GGUF reader below (read_gguf) parses the header, every metadata type (arrays included) and the
tensor infos, honouring general.alignment (default 32). The writer reuses tiny_gguf's encoders.
"""
import argparse
import os
import shutil
import struct
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny_gguf import T_F32, T_STR, T_U32, Lcg, kv, s  # noqa: E402

GGML_F32, GGML_F16 = 0, 1
# GGUF metadata value types -> struct format (8 string, 9 array are handled apart)
SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
# block-quantized ggml types (32 weights a block): type -> (block bytes, offset of the quants, xor mask)
# the mask flips the lowest bit of every quant: one quantization step, the scales untouched
QUANT = {2: (18, 2, 0x11), 3: (20, 4, 0x11), 6: (22, 6, 0x11), 7: (24, 8, 0x11), 8: (34, 2, 0x01)}


class Gguf:
    """A parsed GGUF header: kv (key -> value), tensors (name -> (ne, ggml type, absolute offset))."""

    def __init__(self, kv, tensors, data_start):
        self.kv, self.tensors, self.data_start = kv, tensors, data_start

    @property
    def arch(self):
        return self.kv["general.architecture"]

    @property
    def n_embd(self):
        return self.kv[self.arch + ".embedding_length"]

    @property
    def n_layer(self):
        return self.kv[self.arch + ".block_count"]


def read_gguf(path):
    with open(path, "rb") as f:
        def unpack(fmt):
            return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]

        def string():
            return f.read(unpack("<Q")).decode("utf-8", "replace")

        def value(typ):
            if typ == 8:
                return string()
            if typ == 9:
                etyp, n = unpack("<I"), unpack("<Q")
                return [value(etyp) for _ in range(n)]
            return unpack(SCALAR[typ])

        if f.read(4) != b"GGUF":
            raise ValueError("%s: not a GGUF file" % path)
        version = unpack("<I")
        if version < 2:
            raise ValueError("%s: GGUF version %d unsupported" % (path, version))
        n_tensors, n_kv = unpack("<Q"), unpack("<Q")
        meta = {}
        for _ in range(n_kv):
            key = string()
            meta[key] = value(unpack("<I"))
        infos = []
        for _ in range(n_tensors):
            name = string()
            ne = tuple(unpack("<Q") for _ in range(unpack("<I")))
            infos.append((name, ne, unpack("<I"), unpack("<Q")))
        align = meta.get("general.alignment", 32)
        data_start = f.tell() + (-f.tell()) % align
    tensors = {name: (ne, typ, data_start + off) for name, ne, typ, off in infos}
    return Gguf(meta, tensors, data_start)


def write_gguf(path, meta, tensors, align=32):
    """meta: encoded kv entries (tiny_gguf.kv); tensors: [(name, ne, list of floats)] stored as F32."""
    infos, blobs, offset = b"", [], 0
    for name, ne, vals in tensors:
        data = struct.pack("<%df" % len(vals), *vals)
        infos += s(name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<Q", d) for d in ne)
        infos += struct.pack("<IQ", GGML_F32, offset)
        blobs.append(data + b"\0" * ((-len(data)) % align))
        offset += len(blobs[-1])
    meta = [kv("general.alignment", T_U32, align)] + meta
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(meta)) + b"".join(meta) + infos
    with open(path, "wb") as f:
        f.write(head + b"\0" * ((-len(head)) % align))
        for b in blobs:
            f.write(b)


def write_control_vector(model_path, out_path, strength_seed=1):
    g = read_gguf(model_path)
    rng = Lcg(0x5EED0000 + strength_seed)
    meta = [kv("general.architecture", T_STR, "controlvector"),
            kv("controlvector.model_hint", T_STR, g.arch),
            kv("controlvector.layer_count", T_U32, g.n_layer - 1)]
    tensors = [("direction.%d" % il, (g.n_embd,), rng.floats(g.n_embd, 0.1)) for il in range(1, g.n_layer)]
    write_gguf(out_path, meta, tensors)
    return out_path


def write_lora(model_path, out_path, rank=4):
    g = read_gguf(model_path)
    rng = Lcg(0x10AA0000 + rank)
    meta = [kv("general.architecture", T_STR, g.arch), kv("general.type", T_STR, "adapter"),
            kv("general.name", T_STR, "kvrelay-identity-lora"), kv("adapter.type", T_STR, "lora"),
            kv("adapter.lora.alpha", T_F32, float(rank))]
    tensors = []
    for il in range(g.n_layer):
        for part in ("attn_q", "attn_k"):
            name = "blk.%d.%s.weight" % (il, part)
            n_in, n_out = g.tensors[name][0][:2]
            tensors.append((name + ".lora_a", (n_in, rank), rng.floats(n_in * rank, 0.2)))
            tensors.append((name + ".lora_b", (rank, n_out), rng.floats(rank * n_out, 0.2)))
    write_gguf(out_path, meta, tensors)
    return out_path


def write_twin_model(model_path, out_dir, tensor="blk.0.attn_k.weight"):
    g = read_gguf(model_path)
    ne, typ, off = g.tensors[tensor]
    n = 1
    for d in ne:
        n *= d
    os.makedirs(out_dir, exist_ok=True)
    out = os.path.join(out_dir, os.path.basename(model_path))
    shutil.copyfile(model_path, out)
    with open(out, "r+b") as f:
        if typ in QUANT:
            size, qs, mask = QUANT[typ]
            f.seek(off)
            data = bytearray(f.read(n // 32 * size))
            for b in range(0, len(data), size):
                for i in range(b + qs, b + size):
                    data[i] ^= mask
        elif typ in (GGML_F32, GGML_F16):
            width, fmt, bit = (4, "<I", 1 << 20) if typ == GGML_F32 else (2, "<H", 1 << 7)
            f.seek(off)
            data = bytearray(f.read(n * width))
            for i in range(0, len(data), width):
                struct.pack_into(fmt, data, i, struct.unpack_from(fmt, data, i)[0] ^ bit)
        else:
            raise NotImplementedError("%s has ggml type %d; the twin knows F32, F16, Q4_0/1, Q5_0/1, Q8_0"
                                      % (tensor, typ))
        f.seek(off)
        f.write(data)
    assert os.path.getsize(out) == os.path.getsize(model_path)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    print(write_control_vector(a.model, os.path.join(a.out, "control_vector.gguf")))
    print(write_lora(a.model, os.path.join(a.out, "lora.gguf")))
    print(write_twin_model(a.model, os.path.join(a.out, "twin")))


if __name__ == "__main__":
    main()
