//! What crosses processes: CUDA IPC exports of allocations, and the virtual memory API's
//! allocations as POSIX descriptors, imported and mapped at another process.

use cudarc::driver::sys;

use super::{check, CudaDevice};
use crate::copy::CopyError;

/// A device allocation exported for CUDA IPC: the handle another process of this host opens,
/// and the allocation it names (its base and size in this process).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IpcExport {
    /// The driver's opaque handle (`CUipcMemHandle`).
    pub handle: [u8; 64],
    /// The allocation's base address here.
    pub base: u64,
    /// Its size in bytes.
    pub size: u64,
}

impl CudaDevice {
    /// Export the allocation that holds device address `ptr` for CUDA IPC. Works for memory
    /// from `cuMemAlloc`/`cudaMalloc` (what PyTorch's and most runtimes' caching allocators
    /// hand out); memory from the virtual memory API (`cuMemCreate`) or a stream-ordered pool
    /// (`cudaMallocAsync`) cannot be exported this way and gives an error. Cost: three or four
    /// driver calls; call once per allocation.
    pub fn ipc_export(&self, ptr: u64) -> Result<IpcExport, CopyError> {
        let (base, size) = self.address_range(ptr)?;
        let _ctx = self.bind()?;
        // SAFETY: a plain query into a local; `base` is only looked up, never dereferenced.
        unsafe {
            let mut h = std::mem::MaybeUninit::<sys::CUipcMemHandle>::zeroed();
            check(sys::cuIpcGetMemHandle(h.as_mut_ptr(), base), "cuIpcGetMemHandle")?;
            let h = h.assume_init();
            let mut handle = [0u8; 64];
            for (o, &c) in handle.iter_mut().zip(h.reserved.iter()) {
                *o = c as u8;
            }
            Ok(IpcExport { handle, base, size })
        }
    }

    /// The allocation (or mapping) that holds device address `ptr` in this context: its base
    /// and size (`cuMemGetAddressRange`), an error for an address the driver does not know.
    /// Cost: one driver call; `ptr` is only looked up, never dereferenced.
    pub fn address_range(&self, ptr: u64) -> Result<(u64, u64), CopyError> {
        let _ctx = self.bind()?;
        let (mut base, mut size) = (0u64, 0usize);
        // SAFETY: a plain query into locals.
        check(unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) }, "cuMemGetAddressRange")?;
        Ok((base, size as u64))
    }

    /// Map an allocation another process of this host exported ([`CudaDevice::ipc_export`])
    /// into this device's context; its base address here. Until [`CudaDevice::ipc_close`],
    /// the exporting process's memory is readable and writable through it.
    ///
    /// # Safety
    /// `handle` came from `ipc_export` in another live process (the driver checks the rest and
    /// answers an error for a handle it does not know).
    pub unsafe fn ipc_open(&self, handle: &[u8; 64]) -> Result<u64, CopyError> {
        let _ctx = self.bind()?;
        let mut h = sys::CUipcMemHandle { reserved: [0; 64] };
        for (o, &c) in h.reserved.iter_mut().zip(handle.iter()) {
            *o = c as std::ffi::c_char;
        }
        let mut ptr = 0u64;
        check(
            // SAFETY: out-pointer to a local; the handle is plain bytes the driver validates.
            unsafe {
                sys::cuIpcOpenMemHandle_v2(&mut ptr, h, sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32)
            },
            "cuIpcOpenMemHandle",
        )?;
        Ok(ptr)
    }

    /// Unmap what [`CudaDevice::ipc_open`] mapped.
    ///
    /// # Safety
    /// `ptr` came from `ipc_open` on this device and no copy uses it any more.
    pub unsafe fn ipc_close(&self, ptr: u64) -> Result<(), CopyError> {
        let _ctx = self.bind()?;
        // SAFETY: forwarded contract.
        check(unsafe { sys::cuIpcCloseMemHandle(ptr) }, "cuIpcCloseMemHandle")
    }
}

/// One physical allocation of the virtual memory API (`cuMemCreate`) as an agent exports it:
/// where it is mapped in the exporting process, its size, and a POSIX file descriptor for it
/// (`cuMemExportToShareableHandle`) that another process imports.
#[derive(Debug)]
pub struct VmmChunk {
    /// Where it is mapped here.
    pub base: u64,
    /// Its size in bytes (a multiple of the allocation granularity).
    pub size: u64,
    /// The shareable handle.
    pub fd: std::os::fd::OwnedFd,
}

/// An allocation imported with [`CudaDevice::vmm_import`]; released when dropped (memory
/// mapped from it stays until unmapped).
#[derive(Debug)]
pub struct VmmHandle {
    pub(super) h: sys::CUmemGenericAllocationHandle,
}

impl Drop for VmmHandle {
    fn drop(&mut self) {
        // SAFETY: the import's reference, released once; mappings hold their own.
        let _ = unsafe { sys::cuMemRelease(self.h) };
    }
}

/// Device `ordinal` as a location of the virtual memory API.
pub(super) fn device_location(ordinal: i32) -> sys::CUmemLocation {
    sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: ordinal }
}

pub(super) const POSIX_FD: sys::CUmemAllocationHandleType =
    sys::CUmemAllocationHandleType_enum::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;

impl CudaDevice {
    /// Export the physical allocations of the virtual memory API mapped over `[ptr, end)`, in
    /// address order, each as a POSIX file descriptor: the first is the one `ptr` lies in,
    /// each next one starts where the last ended (`cuMemGetAddressRange` gives each mapped
    /// allocation's bounds). Fails for memory not of that API (`cuMemAlloc`: use
    /// [`CudaDevice::ipc_export`]; a stream-ordered pool: neither), for an allocation created
    /// without the POSIX file-descriptor handle type ([`CopyError::Unsupported`]), and where
    /// the range has an unmapped gap. Cost: four driver calls per allocation; call once.
    pub fn vmm_export(&self, ptr: u64, end: u64) -> Result<Vec<VmmChunk>, CopyError> {
        let _ctx = self.bind()?;
        let mut out = Vec::new();
        let mut at = ptr;
        while at < end {
            let (mut base, mut size) = (0u64, 0usize);
            let mut h: sys::CUmemGenericAllocationHandle = 0;
            // SAFETY: queries into locals; `at` is only looked up, never dereferenced.
            unsafe {
                check(sys::cuMemGetAddressRange_v2(&mut base, &mut size, at), "cuMemGetAddressRange")?;
                check(
                    sys::cuMemRetainAllocationHandle(&mut h, at as *mut std::ffi::c_void),
                    "cuMemRetainAllocationHandle",
                )?;
            }
            let exported = (|| {
                let mut prop = std::mem::MaybeUninit::<sys::CUmemAllocationProp>::zeroed();
                // SAFETY: `h` is a live handle (retained above); `prop` is written by the driver.
                let prop = unsafe {
                    check(
                        sys::cuMemGetAllocationPropertiesFromHandle(prop.as_mut_ptr(), h),
                        "cuMemGetAllocationPropertiesFromHandle",
                    )?;
                    prop.assume_init()
                };
                if prop.requestedHandleTypes.0 & POSIX_FD.0 == 0 {
                    return Err(CopyError::Unsupported(
                        "memory of the virtual memory API created without CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR cannot be exported",
                    ));
                }
                let mut fd: std::ffi::c_int = -1;
                let out = (&mut fd as *mut std::ffi::c_int).cast();
                // SAFETY: `h` is live and allows POSIX handles; the driver writes an int.
                let r = unsafe { sys::cuMemExportToShareableHandle(out, h, POSIX_FD, 0) };
                check(r, "cuMemExportToShareableHandle")?;
                // SAFETY: a new descriptor the driver just opened for us, owned from here.
                Ok(unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) })
            })();
            // SAFETY: the reference `cuMemRetainAllocationHandle` took (the mapping keeps its own).
            let _ = unsafe { sys::cuMemRelease(h) };
            let fd = exported?;
            let size = size as u64;
            if size == 0 || base > at || base.checked_add(size).is_none_or(|e| e <= at) {
                return Err(CopyError::Unsupported("an allocation's bounds do not hold its own address"));
            }
            out.push(VmmChunk { base, size, fd });
            at = base + size;
        }
        Ok(out)
    }

    /// Import one allocation another process exported with [`CudaDevice::vmm_export`] (the
    /// descriptor can be closed once this returns: the handle holds the memory).
    ///
    /// # Safety
    /// `fd` came from `vmm_export` in a live process of this host (the driver refuses other
    /// files).
    pub unsafe fn vmm_import(&self, fd: std::os::fd::BorrowedFd<'_>) -> Result<VmmHandle, CopyError> {
        let _ctx = self.bind()?;
        let mut h: sys::CUmemGenericAllocationHandle = 0;
        let raw = std::os::fd::AsRawFd::as_raw_fd(&fd);
        let os_handle = raw as usize as *mut std::ffi::c_void;
        // SAFETY: the driver reads the descriptor's number (passed as the pointer's value, as
        // the API asks) and writes a handle into a local.
        let r = unsafe { sys::cuMemImportFromShareableHandle(&mut h, os_handle, POSIX_FD) };
        check(r, "cuMemImportFromShareableHandle")?;
        Ok(VmmHandle { h })
    }

    /// Map allocations side by side into a new address range of this device's context,
    /// `sizes[i]` bytes of `handles[i]` at the sum of the sizes before it; the range's base.
    /// Readable here, and writable only with `writable` (another process's memory is mapped
    /// read-only: a destination only reads it), until [`CudaDevice::vmm_unmap`] (the mappings
    /// hold the memory; the handles may be dropped). On an error nothing stays mapped or
    /// reserved.
    ///
    /// # Safety
    /// `sizes[i]` is the size of `handles[i]`'s allocation (as its exporter reported it).
    pub unsafe fn vmm_map(&self, handles: &[VmmHandle], sizes: &[u64], writable: bool) -> Result<u64, CopyError> {
        assert_eq!(handles.len(), sizes.len(), "CudaDevice::vmm_map: one size per handle");
        let total: u64 = sizes.iter().try_fold(0u64, |a, &s| a.checked_add(s)).ok_or(CopyError::InvalidOptions)?;
        if total == 0 {
            return Err(CopyError::InvalidOptions);
        }
        let _ctx = self.bind()?;
        let mut va = 0u64;
        // SAFETY: reserves address space only; written into a local.
        check(unsafe { sys::cuMemAddressReserve(&mut va, total as usize, 0, 0, 0) }, "cuMemAddressReserve")?;
        let mut mapped = 0u64;
        let r = (|| {
            for (h, &size) in handles.iter().zip(sizes) {
                // SAFETY: maps an imported allocation of `size` bytes (the caller's contract)
                // into the range reserved above, inside it (the sizes add up to it).
                check(unsafe { sys::cuMemMap(va + mapped, size as usize, 0, h.h, 0) }, "cuMemMap")?;
                mapped += size;
            }
            let desc = sys::CUmemAccessDesc {
                location: device_location(self.ordinal),
                flags: if writable {
                    sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE
                } else {
                    sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READ
                },
            };
            // SAFETY: the whole range is mapped (above); one descriptor.
            check(unsafe { sys::cuMemSetAccess(va, total as usize, &desc, 1) }, "cuMemSetAccess")
        })();
        if let Err(e) = r {
            // SAFETY: unmaps what this call mapped and frees what it reserved.
            unsafe {
                if mapped > 0 {
                    let _ = sys::cuMemUnmap(va, mapped as usize);
                }
                let _ = sys::cuMemAddressFree(va, total as usize);
            }
            return Err(e);
        }
        Ok(va)
    }

    /// Unmap and free what [`CudaDevice::vmm_map`] mapped (`size`: the sum of its sizes).
    ///
    /// # Safety
    /// `va` and `size` are one `vmm_map`'s base and total on this device, and no copy uses
    /// the range any more.
    pub unsafe fn vmm_unmap(&self, va: u64, size: u64) -> Result<(), CopyError> {
        let _ctx = self.bind()?;
        // SAFETY: forwarded contract. The reservation is freed whatever the unmap answered
        // (a failed unmap must not leak the address range too).
        unsafe {
            let unmapped = check(sys::cuMemUnmap(va, size as usize), "cuMemUnmap");
            let freed = check(sys::cuMemAddressFree(va, size as usize), "cuMemAddressFree");
            unmapped.and(freed)
        }
    }
}
