"""KV layouts and the CPU copy engine: KvLayout, CpuEngine."""

from __future__ import annotations

import ctypes
import threading
from typing import Any, Optional, Sequence

from . import _lib as L
from ._lib import lib
from ._common import U32, _Handle, _buffer, _check, _int, _u32s  # noqa: F401

# --- KV layouts and the copy engine ---------------------------------------------------------


class KvLayout(_Handle):
    """Where every block of a KV pool lives: segments (one per layer and K/V, or one for the
    whole block), block ``b`` of a segment at ``base + b * block_stride``. Build it from raw
    addresses, from a writable buffer (``bytearray``, ``mmap``: kept alive by the layout) or
    from tensor-like objects (``data_ptr()``, ``stride()``, ``element_size()``, ``shape``:
    ``torch.Tensor`` among them)."""

    _free = staticmethod(lib.kvrelay_kv_layout_free)

    def __init__(self, num_blocks: int, segments: Sequence[tuple[int, int, int]], extents: Sequence[tuple[int, int]], keep: Any = None):
        super().__init__(0)
        _int("num_blocks", num_blocks, 1, U32)
        segments, extents = list(segments), list(extents)
        if not segments:
            raise ValueError("a layout needs at least one segment")

        def table(name: str, rows: list[Any], ctype: Any) -> Any:
            width = len(ctype._fields_)
            out = []
            for i, r in enumerate(rows):
                if not (isinstance(r, (tuple, list)) and len(r) == width):
                    raise TypeError(f"{name}[{i}] must be a tuple of {width} ints")
                out.append(ctype(*(_int(f"{name}[{i}].{f}", x) for (f, _), x in zip(ctype._fields_, r))))
            return (ctype * len(out))(*out)

        segs = table("segments", segments, L.KvSegment)
        exts = table("extents", extents, L.KvExtent)
        out = ctypes.c_void_p()
        _check("kvrelay_kv_layout_new", lib.kvrelay_kv_layout_new(num_blocks, segs, len(segments), exts, len(extents), ctypes.byref(out)))
        self._ptr = out.value
        self._keep = keep
        self.num_blocks = num_blocks
        self.block_bytes = int(lib.kvrelay_kv_layout_stage_block_bytes(self._ptr))

    @classmethod
    def contiguous(cls, base: int, num_blocks: int, block_bytes: int, keep: Any = None) -> "KvLayout":
        """``num_blocks`` blocks of ``block_bytes`` one after another from address ``base``."""
        return cls(num_blocks, [(base, block_bytes, block_bytes)], [(base, num_blocks * block_bytes)], keep)

    @classmethod
    def from_buffer(cls, buf: Any, num_blocks: int, block_bytes: int) -> "KvLayout":
        """A contiguous pool over a writable buffer of ``num_blocks * block_bytes`` bytes."""
        _int("block_bytes", block_bytes, 1)
        _int("num_blocks", num_blocks, 1, U32)
        try:
            mv = memoryview(buf).cast("B")
        except TypeError:
            raise TypeError(f"buf must be a writable buffer, not {type(buf).__name__}") from None
        if mv.readonly:
            raise ValueError("the pool's buffer must be writable")
        if len(mv) < num_blocks * block_bytes:
            raise ValueError(f"the buffer holds {len(mv)} bytes, {num_blocks} blocks need {num_blocks * block_bytes}")
        arr = (ctypes.c_char * len(mv)).from_buffer(mv)
        return cls.contiguous(ctypes.addressof(arr), num_blocks, block_bytes, keep=(arr, buf))

    @classmethod
    def from_tensors(cls, tensors: Sequence[Any], num_blocks: Optional[int] = None) -> "KvLayout":
        """One segment per tensor (e.g. each layer's K then V), block ``b`` being ``t[b]``: the
        first dimension indexes blocks, the rest of a block must be contiguous. Each tensor's
        extent is its storage from ``t[0]`` to the end of ``t[n-1]``."""
        segs, exts = [], []
        n = num_blocks
        for t in tensors:
            for m in ("data_ptr", "stride", "element_size"):
                if not callable(getattr(t, m, None)):
                    raise TypeError(f"a tensor must have {m}() (torch.Tensor-like)")
            shape = tuple(t.shape)
            if not shape:
                raise ValueError("a tensor needs a block dimension")
            el = t.element_size()
            inner = 1
            for d in shape[1:]:
                inner *= d
            strides = t.stride() if callable(t.stride) else t.stride
            expect = 1
            for d, s in zip(reversed(shape[1:]), reversed(tuple(strides)[1:])):
                if d > 1 and s != expect:
                    raise ValueError("each block of a tensor must be contiguous (t[b] of a contiguous tensor)")
                expect *= d
            blocks = shape[0] if n is None else n
            if blocks > shape[0]:
                raise ValueError(f"num_blocks {blocks} exceeds a tensor's {shape[0]} blocks")
            n = blocks
            stride = tuple(strides)[0] * el
            per = inner * el
            segs.append((t.data_ptr(), stride, per))
            exts.append((t.data_ptr(), (blocks - 1) * stride + per))
        if n is None:
            raise ValueError("no tensors")
        return cls(n, segs, exts, keep=list(tensors))


class CpuEngine(_Handle):
    """The CPU copy engine over a host-memory layout: gather blocks into a staging buffer, or
    scatter one back (block-major, ``block_bytes`` per block)."""

    _free = staticmethod(lib.kvrelay_cpu_engine_free)

    def __init__(self, layout: KvLayout):
        super().__init__(0)
        if not isinstance(layout, KvLayout):
            raise TypeError("layout must be a KvLayout")
        out = ctypes.c_void_p()
        with layout._use() as lp:
            _check("kvrelay_cpu_engine_new", lib.kvrelay_cpu_engine_new(lp, ctypes.byref(out)))
        self._ptr = out.value
        self._layout = layout
        self._lock = threading.Lock()

    def gather(self, ids: Sequence[int], out: Any) -> None:
        """Copy blocks ``ids`` into ``out`` (writable, ``len(ids) * block_bytes``)."""
        arr, n = _buffer("out", out)
        if memoryview(out).readonly:
            raise ValueError("out must be writable")
        i = _u32s("ids", ids)
        with self._lock, self._use() as p:
            _check("kvrelay_cpu_gather", lib.kvrelay_cpu_gather(p, i, len(i), arr, n))

    def scatter(self, data: Any, ids: Sequence[int]) -> None:
        """Copy ``data`` (``len(ids) * block_bytes``) into blocks ``ids``."""
        arr, n = _buffer("data", data)
        i = _u32s("ids", ids)
        with self._lock, self._use() as p:
            _check("kvrelay_cpu_scatter", lib.kvrelay_cpu_scatter(p, arr, n, i, len(i)))
