//! Device-to-device copies for a runtime whose KV cache is not in a kvrelay layout: strided 2-D
//! copies between its tensors and a device pool, on a stream of the copier's own.
//!
//! llama.cpp's KV cache is a tensor per layer for K and V, one row per cell (V transposed: one
//! row per element, across cells), and a position's cell is wherever the cache put it. Moving a
//! run of positions between that cache and a pool block is a few strided copies per layer
//! (`cuMemcpy2DAsync`, which the copy engines run at full speed for rows of a few hundred bytes
//! and more), so the copier offers exactly that: [`DeviceCopier::copy_2d`] enqueues one, checked,
//! and [`DeviceCopier::finish`] waits for everything enqueued since the last finish.
//!
//! Every copy is checked before it is enqueued: both ends must be device memory of the copier's
//! device (`cuPointerGetAttribute`), and the whole strided extent must lie inside one allocation
//! the driver knows (`cuMemGetAddressRange`). An allocation found once is remembered until the
//! next `finish` (at most 16 of them), so a batch of copies between a few tensors
//! and one pool costs two driver lookups per allocation, not per copy.

use std::sync::Arc;

use cudarc::driver::sys;

use super::{check, CudaDevice, CudaStream};
use crate::copy::CopyError;

/// Allocations remembered between two `finish` calls.
const KNOWN_RANGES: usize = 16;

/// Strided device-to-device copies on one device, enqueued on the copier's own stream (see the
/// module docs). Not for concurrent use: one copier per thread that copies.
#[derive(Debug)]
pub struct DeviceCopier {
    dev: Arc<CudaDevice>,
    stream: CudaStream,
    known: Vec<(u64, u64)>,
    enqueued: u64,
    bytes: u64,
}

impl DeviceCopier {
    /// A copier on `dev` (one stream, created here).
    pub fn new(dev: &Arc<CudaDevice>) -> Result<DeviceCopier, CopyError> {
        Ok(DeviceCopier {
            dev: dev.clone(),
            stream: CudaStream::new(dev)?,
            known: Vec::with_capacity(KNOWN_RANGES),
            enqueued: 0,
            bytes: 0,
        })
    }

    /// The device.
    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.dev
    }

    /// Copies enqueued and bytes they move since the last [`DeviceCopier::finish`].
    pub fn pending(&self) -> (u64, u64) {
        (self.enqueued, self.bytes)
    }

    /// Enqueue a copy of `height` rows of `width` bytes from `src` (rows `src_pitch` apart) to
    /// `dst` (rows `dst_pitch` apart). Nothing is enqueued for `width` or `height` 0. Refused
    /// before anything is enqueued: a pitch below `width` (for more than one row), an extent that
    /// overflows, an end that is not device memory of this device, or an extent past the
    /// allocation that holds its first byte (`CopyError::OutOfBounds`). Host cost: one driver
    /// call, plus two lookups for an allocation not seen since the last finish.
    ///
    /// Whatever the checks, the copier cannot know whether the runtime still uses the bytes:
    /// it must not read or write them until `finish` returns.
    pub fn copy_2d(
        &mut self,
        dst: u64,
        dst_pitch: usize,
        src: u64,
        src_pitch: usize,
        width: usize,
        height: usize,
    ) -> Result<(), CopyError> {
        if width == 0 || height == 0 {
            return Ok(());
        }
        let extent = |pitch: usize| -> Result<u64, CopyError> {
            if height > 1 && pitch < width {
                return Err(CopyError::OutOfBounds);
            }
            pitch
                .checked_mul(height - 1)
                .and_then(|b| b.checked_add(width))
                .map(|b| b as u64)
                .ok_or(CopyError::OutOfBounds)
        };
        let (dst_len, src_len) = (extent(dst_pitch)?, extent(src_pitch)?);
        self.check_inside(dst, dst_len)?;
        self.check_inside(src, src_len)?;
        // SAFETY: both extents were checked to lie inside live device allocations of this
        // device's context.
        unsafe { self.copy_2d_trusted(dst, dst_pitch, src, src_pitch, width, height) }
    }

    /// [`DeviceCopier::copy_2d`] without the allocation lookups: for copies whose ends this
    /// library knows (a pool whose memory its agent was given, possibly spanning several
    /// allocations side by side, which the checked path refuses).
    ///
    /// # Safety
    /// Both strided extents (`pitch * (height - 1) + width` bytes from `dst` and from `src`) are
    /// device memory readable (`src`) and writable (`dst`) in this device's context, and stay
    /// so until [`DeviceCopier::finish`] returns; `width` is at most both pitches when `height`
    /// is more than 1.
    pub(crate) unsafe fn copy_2d_trusted(
        &mut self,
        dst: u64,
        dst_pitch: usize,
        src: u64,
        src_pitch: usize,
        width: usize,
        height: usize,
    ) -> Result<(), CopyError> {
        if width == 0 || height == 0 {
            return Ok(());
        }
        let _ctx = self.dev.bind()?;
        // SAFETY: the caller's contract (both extents live device memory of this context); the
        // stream is the copier's own.
        unsafe {
            if height == 1 {
                check(sys::cuMemcpyDtoDAsync_v2(dst, src, width, self.stream.raw()), "cuMemcpyDtoDAsync")?;
            } else {
                let p = sys::CUDA_MEMCPY2D {
                    srcXInBytes: 0,
                    srcY: 0,
                    srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
                    srcHost: std::ptr::null(),
                    srcDevice: src,
                    srcArray: std::ptr::null_mut(),
                    srcPitch: src_pitch,
                    dstXInBytes: 0,
                    dstY: 0,
                    dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
                    dstHost: std::ptr::null_mut(),
                    dstDevice: dst,
                    dstArray: std::ptr::null_mut(),
                    dstPitch: dst_pitch,
                    WidthInBytes: width,
                    Height: height,
                };
                check(sys::cuMemcpy2DAsync_v2(&p, self.stream.raw()), "cuMemcpy2DAsync")?;
            }
        }
        self.enqueued += 1;
        self.bytes += (width as u64) * (height as u64);
        Ok(())
    }

    /// Enqueue setting `len` bytes from `ptr` to zero, on the copier's stream (ordered with its
    /// copies), without the allocation lookups (as [`DeviceCopier::copy_2d_trusted`]).
    ///
    /// # Safety
    /// The `len` bytes from `ptr` are device memory writable in this device's context, and stay
    /// so until [`DeviceCopier::finish`] returns.
    pub(crate) unsafe fn zero_trusted(&mut self, ptr: u64, len: usize) -> Result<(), CopyError> {
        if len == 0 {
            return Ok(());
        }
        let _ctx = self.dev.bind()?;
        // SAFETY: the caller's contract (live device memory of this context); the stream is the
        // copier's own.
        check(unsafe { sys::cuMemsetD8Async(ptr, 0, len, self.stream.raw()) }, "cuMemsetD8Async")?;
        self.enqueued += 1;
        Ok(())
    }

    /// Wait for every copy enqueued since the last finish; forget the allocations seen. Returns
    /// the bytes they moved. An error of any of them is this call's error.
    pub fn finish(&mut self) -> Result<u64, CopyError> {
        self.known.clear();
        let bytes = std::mem::take(&mut self.bytes);
        self.enqueued = 0;
        self.stream.synchronize()?;
        Ok(bytes)
    }

    /// `[ptr, ptr + len)` lies inside one allocation of this device.
    fn check_inside(&mut self, ptr: u64, len: u64) -> Result<(), CopyError> {
        let end = ptr.checked_add(len).ok_or(CopyError::OutOfBounds)?;
        if let Some(&(base, size)) = self.known.iter().find(|&&(b, s)| ptr >= b && ptr - b < s) {
            return if end <= base + size { Ok(()) } else { Err(CopyError::OutOfBounds) };
        }
        if ptr == 0 {
            return Err(CopyError::OutOfBounds);
        }
        let _ctx = self.dev.bind()?;
        let mut kind: u32 = 0;
        let mut ordinal: i32 = -1;
        // SAFETY: plain queries into locals of the attribute's size; the pointer is only looked up.
        unsafe {
            check(
                sys::cuPointerGetAttribute(
                    (&mut kind as *mut u32).cast(),
                    sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                    ptr,
                ),
                "cuPointerGetAttribute(MEMORY_TYPE)",
            )
            .map_err(|_| CopyError::OutOfBounds)?;
            check(
                sys::cuPointerGetAttribute(
                    (&mut ordinal as *mut i32).cast(),
                    sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                    ptr,
                ),
                "cuPointerGetAttribute(DEVICE_ORDINAL)",
            )
            .map_err(|_| CopyError::OutOfBounds)?;
        }
        if kind != sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 || ordinal != self.dev.ordinal() {
            return Err(CopyError::OutOfBounds);
        }
        let (base, size) = self.dev.address_range(ptr).map_err(|_| CopyError::OutOfBounds)?;
        if end > base + size {
            return Err(CopyError::OutOfBounds);
        }
        if self.known.len() == KNOWN_RANGES {
            self.known.remove(0);
        }
        self.known.push((base, size));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::copy::DeviceBuffer;

    #[test]
    fn strided_copies_move_exactly_their_rows_and_refuse_past_the_allocation() {
        let Some(dev) = crate::copy::test_device() else { return };
        // a "transposed V" tensor of 8 rows of 64 cells (2 bytes each), and a pool
        let (rows, cells, el) = (8usize, 64usize, 2usize);
        let tensor = DeviceBuffer::alloc(&dev, rows * cells * el).unwrap();
        let pattern: Vec<u8> = (0..rows * cells * el).map(|i| (i * 7 + 3) as u8).collect();
        tensor.write(0, &pattern).unwrap();
        let pool = DeviceBuffer::alloc(&dev, 4096).unwrap();
        pool.write(0, &[0xEE; 4096]).unwrap();
        let mut c = DeviceCopier::new(&dev).unwrap();
        // cells 5..21 of every row into the pool, rows packed (16 cells * 2 bytes)
        c.copy_2d(pool.ptr() + 64, 16 * el, tensor.ptr() + (5 * el) as u64, cells * el, 16 * el, rows).unwrap();
        assert_eq!(c.pending(), (1, (16 * el * rows) as u64));
        assert_eq!(c.finish().unwrap(), (16 * el * rows) as u64);
        let mut got = vec![0u8; 4096];
        pool.read(0, &mut got).unwrap();
        assert!(got[..64].iter().all(|&b| b == 0xEE), "bytes before the destination untouched");
        for r in 0..rows {
            let want = &pattern[r * cells * el + 5 * el..r * cells * el + 21 * el];
            assert_eq!(&got[64 + r * 16 * el..64 + (r + 1) * 16 * el], want, "row {r}");
        }
        assert!(got[64 + rows * 16 * el..].iter().all(|&b| b == 0xEE), "bytes after the destination untouched");

        // past the end of either allocation, a pitch below the width, a host address, null
        let e = c.copy_2d(pool.ptr() + 4000, 128, tensor.ptr(), 128, 128, 1);
        assert!(matches!(e, Err(CopyError::OutOfBounds)), "{e:?}");
        let e = c.copy_2d(pool.ptr(), 128, tensor.ptr(), cells * el, cells * el, rows + 1);
        assert!(matches!(e, Err(CopyError::OutOfBounds)), "{e:?}");
        let e = c.copy_2d(pool.ptr(), 8, tensor.ptr(), 128, 16, 2);
        assert!(matches!(e, Err(CopyError::OutOfBounds)), "{e:?}");
        let host = vec![0u8; 256];
        let e = c.copy_2d(host.as_ptr() as u64, 128, tensor.ptr(), 128, 128, 1);
        assert!(matches!(e, Err(CopyError::OutOfBounds)), "{e:?}");
        let e = c.copy_2d(0, 128, tensor.ptr(), 128, 128, 1);
        assert!(matches!(e, Err(CopyError::OutOfBounds)), "{e:?}");
        assert_eq!(c.pending(), (0, 0), "nothing refused was enqueued");
        assert_eq!(c.finish().unwrap(), 0);
        pool.read(0, &mut got).unwrap();
        assert!(got[..64].iter().all(|&b| b == 0xEE) && got[64 + rows * 16 * el..].iter().all(|&b| b == 0xEE));
    }
}
