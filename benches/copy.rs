//! KV copy benchmark on a GPU (`cargo bench --bench copy`); prints a skip line and exits 0
//! where there is no CUDA driver or device.
//!
//! 2 GiB per figure, random block ids, a TensorRT-LLM-style pool `[blocks, 16 layers, 2, chunk]`
//! (32 segments), chunk = one block of one layer and one of K/V: 4, 16, 64, 256 KiB. In the same
//! run: one contiguous pinned memcpy of 2 GiB (the ceiling), the engine's per-chunk
//! `cuMemcpyAsync` and `cuMemcpyBatchAsync` methods, and the kernel at 8 and 16 CTAs; then
//! gather and scatter at once on two streams against two contiguous copies at once; the
//! host-side cost of one call for 1,000 blocks; and gather while a compute kernel keeps the
//! other SMs busy. Each GPU figure is the best of 3 timed repetitions (CUDA events).

use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::sys;
use kvrelay::copy::*;

const GIB: usize = 1 << 30;
const LAYERS: u32 = 16;

fn gbps(bytes: usize, ms: f32) -> f64 {
    bytes as f64 / (ms as f64 * 1e6)
}

/// Best-of-3 milliseconds of `f` enqueued on `s`.
fn time_ms(d: &Arc<CudaDevice>, s: &CudaStream, mut f: impl FnMut()) -> f32 {
    let (a, b) = (CudaEvent::new(d).unwrap(), CudaEvent::new(d).unwrap());
    f(); // warm-up
    s.synchronize().unwrap();
    let mut best = f32::MAX;
    for _ in 0..3 {
        a.record(s).unwrap();
        f();
        b.record(s).unwrap();
        b.synchronize().unwrap();
        best = best.min(b.elapsed_ms(&a).unwrap());
    }
    best
}

struct Rng(u64);
impl Rng {
    fn perm(&mut self, n: u32) -> Vec<u32> {
        let mut v: Vec<u32> = (0..n).collect();
        for i in (1..v.len()).rev() {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            v.swap(i, (self.0 % (i as u64 + 1)) as usize);
        }
        v
    }
}

const BUSY: &str = r#"
extern "C" __global__ void busy(float* out, int iters) {
  float a = threadIdx.x * 1e-3f, b = 1.0001f, c = 0.9999f;
  for (int i = 0; i < iters; ++i) { a = fmaf(a, b, c); b = fmaf(b, c, a) * 1e-9f + 1.0f; }
  if (a == 12345.0f) out[0] = a;
}
"#;

fn main() {
    let d = match CudaDevice::open(0) {
        Ok(d) => d,
        Err(e) => {
            println!("SKIP copy benchmark: {e}");
            return;
        }
    };
    // The bench plays the runtime: its thread keeps the device's context current (kvrelay then
    // switches nothing), and its own driver calls below rely on that.
    let _ctx = d.bind().unwrap();
    let s1 = CudaStream::new(&d).unwrap();
    let s2 = CudaStream::new(&d).unwrap();
    let total = 2 * GIB;
    let pool = DeviceBuffer::alloc(&d, 2 * total).unwrap(); // 4 GiB: ids drawn from twice the moved blocks
    let staging = PinnedBuffer::alloc(&d, total).unwrap();
    let staging2 = PinnedBuffer::alloc(&d, total).unwrap();
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);

    // the ceiling, measured in this run
    let d2h = time_ms(&d, &s1, || {
        // SAFETY: a 2 GiB copy between live allocations of at least that size.
        unsafe { sys::cuMemcpyDtoHAsync_v2(staging.as_slice().as_ptr() as *mut _, pool.ptr(), total, s1.raw()) };
    });
    let h2d = time_ms(&d, &s1, || {
        // SAFETY: as above.
        unsafe { sys::cuMemcpyHtoDAsync_v2(pool.ptr(), staging.as_slice().as_ptr() as *const _, total, s1.raw()) };
    });
    let (c_d2h, c_h2d) = (gbps(total, d2h), gbps(total, h2d));
    println!("contiguous pinned memcpy, 2 GiB: D2H {c_d2h:.1} GB/s, H2D {c_h2d:.1} GB/s\n");

    println!("| chunk | method | gather GB/s | % of contiguous D2H | scatter GB/s | % of contiguous H2D |");
    println!("|---|---|---|---|---|---|");
    let methods: [(&str, CopyMethod, u32, IdTransport); 7] = [
        ("cudaMemcpyAsync per chunk", CopyMethod::PerChunk, 16, IdTransport::Ring),
        ("cudaMemcpyBatchAsync", CopyMethod::Batch, 16, IdTransport::Ring),
        ("kvrelay kernel, 8 CTAs", CopyMethod::Kernel, 8, IdTransport::Ring),
        ("kvrelay kernel, 16 CTAs", CopyMethod::Kernel, 16, IdTransport::Ring),
        ("kvrelay kernel, 16 CTAs, ids in params", CopyMethod::Kernel, 16, IdTransport::Params),
        ("kvrelay staged, 16 CTAs", CopyMethod::Staged, 16, IdTransport::Auto),
        ("kvrelay staged, 64 CTAs", CopyMethod::Staged, 64, IdTransport::Auto),
    ];
    for chunk_kib in [4u64, 16, 64, 256] {
        let chunk = chunk_kib * 1024;
        let moved = (total as u64 / (2 * u64::from(LAYERS) * chunk)) as u32;
        let layout = KvLayout::all_layers_per_block(pool.ptr(), LAYERS, 2 * moved, chunk).unwrap();
        let ids: Vec<u32> = rng.perm(2 * moved).into_iter().take(moved as usize).collect();
        for (name, method, ctas, transport) in methods {
            let opts = EngineOptions {
                method,
                ctas,
                max_blocks_per_call: moved as usize,
                ids: transport,
                ..Default::default()
            };
            // SAFETY: the layout lies inside `pool`, alive for the whole benchmark.
            let mut e = match unsafe { CudaEngine::new(&d, layout.clone(), opts) } {
                Ok(e) => e,
                Err(err) => {
                    println!("| {chunk_kib} KiB | {name} | {err} | | | |");
                    continue;
                }
            };
            let g = time_ms(&d, &s1, || e.gather(&ids, &staging, &s1, None).unwrap());
            let sc = time_ms(&d, &s1, || e.scatter(&staging, &ids, &s1, None).unwrap());
            let (gg, ss) = (gbps(total, g), gbps(total, sc));
            println!(
                "| {chunk_kib} KiB | {name} | {gg:.1} | {:.0}% | {ss:.1} | {:.0}% |",
                100.0 * gg / c_d2h,
                100.0 * ss / c_h2d
            );
        }
    }

    // gather and scatter at once on two streams, against two contiguous copies at once
    let chunk = 16 * 1024u64;
    let moved = (total as u64 / (2 * u64::from(LAYERS) * chunk)) as u32;
    let layout = KvLayout::all_layers_per_block(pool.ptr(), LAYERS, 2 * moved, chunk).unwrap();
    let perm = rng.perm(2 * moved);
    let (ids_a, ids_b) = (perm[..moved as usize].to_vec(), perm[moved as usize..].to_vec());
    let both = |f: &mut dyn FnMut()| {
        f();
        s1.synchronize().unwrap();
        s2.synchronize().unwrap();
        let mut best = f64::MAX;
        for _ in 0..3 {
            let t = Instant::now();
            f();
            s1.synchronize().unwrap();
            s2.synchronize().unwrap();
            best = best.min(t.elapsed().as_secs_f64());
        }
        2.0 * total as f64 / best / 1e9
    };
    let contiguous = both(&mut || {
        // SAFETY: 2 GiB copies between live allocations of at least that size, disjoint halves
        // of the pool.
        unsafe {
            sys::cuMemcpyDtoHAsync_v2(staging.as_slice().as_ptr() as *mut _, pool.ptr(), total, s1.raw());
            sys::cuMemcpyHtoDAsync_v2(
                pool.ptr() + total as u64,
                staging2.as_slice().as_ptr() as *const _,
                total,
                s2.raw(),
            );
        }
    });
    println!("\nboth directions at once, 16 KiB chunks: two contiguous copies {contiguous:.1} GB/s total");
    for (method, ctas, threads) in [
        (CopyMethod::Kernel, 16, 512),
        (CopyMethod::Kernel, 8, 512),
        (CopyMethod::Staged, 16, 512),
        (CopyMethod::Staged, 64, 512),
    ] {
        let opts = EngineOptions { method, ctas, threads, ..Default::default() };
        // SAFETY: as above.
        let (mut ea, mut eb) = unsafe {
            (CudaEngine::new(&d, layout.clone(), opts).unwrap(), CudaEngine::new(&d, layout.clone(), opts).unwrap())
        };
        let kernels = both(&mut || {
            ea.gather(&ids_a, &staging, &s1, None).unwrap();
            eb.scatter(&staging2, &ids_b, &s2, None).unwrap();
        });
        let g_only = both(&mut || ea.gather(&ids_a, &staging, &s1, None).unwrap()) / 2.0;
        println!(
            "  {method:?} {ctas} CTAs x {threads} threads each: {kernels:.1} GB/s total ({:.0}% of the two copies); gather alone in this setup {g_only:.1} GB/s",
            100.0 * kernels / contiguous
        );
    }

    // host-side cost of one call for 1,000 blocks (enqueue only)
    let small = KvLayout::all_layers_per_block(pool.ptr(), 1, 4096, 4096).unwrap();
    for transport in [IdTransport::Auto, IdTransport::Ring, IdTransport::Params] {
        // SAFETY: as above.
        let mut e = unsafe {
            CudaEngine::new(&d, small.clone(), EngineOptions { ids: transport, ..Default::default() }).unwrap()
        };
        for n in [960usize, 1000] {
            let ids: Vec<u32> = rng.perm(4096).into_iter().take(n).collect();
            // one call at a time on an idle stream: the enqueue cost alone
            let mut t: Vec<f64> = (0..50)
                .map(|_| {
                    s1.synchronize().unwrap();
                    let t0 = Instant::now();
                    e.gather(&ids, &staging, &s1, None).unwrap();
                    t0.elapsed().as_secs_f64() * 1e6
                })
                .collect();
            s1.synchronize().unwrap();
            t.sort_by(|a, b| a.partial_cmp(b).unwrap());
            println!(
                "host-side cost of one gather call for {n} blocks (kernel, ids {transport:?}): median {:.2} us, best {:.2} us",
                t[t.len() / 2],
                t[0]
            );
        }
    }

    // gather while a compute kernel keeps the other SMs busy
    let ptx = cudarc::nvrtc::compile_ptx(BUSY).unwrap();
    let src = std::ffi::CString::new(ptx.to_src()).unwrap();
    let (mut module, mut func) = (std::ptr::null_mut(), std::ptr::null_mut());
    let out = DeviceBuffer::alloc(&d, 64).unwrap();
    let mut sms = 0;
    // SAFETY: loads a module into the current context; valid out-pointers.
    unsafe {
        sys::cuModuleLoadData(&mut module, src.as_ptr().cast());
        sys::cuModuleGetFunction(&mut func, module, c"busy".as_ptr());
        sys::cuDeviceGetAttribute(&mut sms, sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, 0);
    }
    let busy_ctas = (sms as u32).saturating_sub(16).max(1);
    let launch_busy = |iters: i32| {
        let mut p = out.ptr();
        let mut it = iters;
        let mut args = [(&mut p as *mut u64).cast::<std::ffi::c_void>(), (&mut it as *mut i32).cast()];
        // SAFETY: `busy(float*, int)` with a live 64-byte buffer; params outlive the call.
        unsafe {
            sys::cuLaunchKernel(func, busy_ctas, 1, 1, 1024, 1, 1, 0, s2.raw(), args.as_mut_ptr(), std::ptr::null_mut())
        };
    };
    let chunk = 16 * 1024u64;
    let moved = (total as u64 / (2 * u64::from(LAYERS) * chunk)) as u32;
    let layout = KvLayout::all_layers_per_block(pool.ptr(), LAYERS, 2 * moved, chunk).unwrap();
    let ids: Vec<u32> = rng.perm(2 * moved).into_iter().take(moved as usize).collect();
    let iters = 2_000_000;
    let busy_alone = time_ms(&d, &s2, || launch_busy(iters));
    for method in [CopyMethod::Kernel, CopyMethod::Staged] {
        // SAFETY: as above.
        let mut e =
            unsafe { CudaEngine::new(&d, layout.clone(), EngineOptions { method, ..Default::default() }).unwrap() };
        let gather_alone = time_ms(&d, &s1, || e.gather(&ids, &staging, &s1, None).unwrap());
        let (a1, b1, a2, b2) = (
            CudaEvent::new(&d).unwrap(),
            CudaEvent::new(&d).unwrap(),
            CudaEvent::new(&d).unwrap(),
            CudaEvent::new(&d).unwrap(),
        );
        let mut g_best = f32::MAX;
        let mut k_best = f32::MAX;
        for _ in 0..3 {
            a2.record(&s2).unwrap();
            launch_busy(iters);
            b2.record(&s2).unwrap();
            a1.record(&s1).unwrap();
            e.gather(&ids, &staging, &s1, None).unwrap();
            b1.record(&s1).unwrap();
            b1.synchronize().unwrap();
            b2.synchronize().unwrap();
            g_best = g_best.min(b1.elapsed_ms(&a1).unwrap());
            k_best = k_best.min(b2.elapsed_ms(&a2).unwrap());
        }
        println!(
            "{method:?} gather (16 CTAs, 16 KiB chunks) alone {:.1} GB/s; beside a compute kernel on {busy_ctas} CTAs {:.1} GB/s; compute kernel alone {busy_alone:.1} ms, beside the gather {k_best:.1} ms ({:+.1}%)",
            gbps(total, gather_alone),
            gbps(total, g_best),
            100.0 * (k_best - busy_alone) / busy_alone
        );
    }
    // SAFETY: unloads the module loaded above.
    unsafe { sys::cuModuleUnload(module) };
}
