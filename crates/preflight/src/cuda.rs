//! The few CUDA driver calls the preflight makes, through cudarc's dynamically loaded bindings
//! (so nrun starts, and says why, on machines without libcuda). Errors carry CUDA's own text.

use std::ffi::{CStr, c_char};

use cudarc::driver::sys::{self, CUresult};

#[derive(Debug)]
pub(crate) struct CudaError(pub String);

impl std::fmt::Display for CudaError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

fn check(r: CUresult, what: &str) -> Result<(), CudaError> {
    if r == CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let mut p: *const c_char = std::ptr::null();
    // SAFETY: cuGetErrorString writes a pointer to a static string.
    unsafe { sys::cuGetErrorString(r, &mut p) };
    let text = if p.is_null() {
        format!("{r:?}")
    } else {
        // SAFETY: static NUL-terminated string from the driver.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    };
    Err(CudaError(format!("{what} failed: {text} ({r:?})")))
}

/// Whether libcuda can be loaded at all (false on machines without the NVIDIA driver).
pub(crate) fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the driver library.
    unsafe { sys::is_culib_present() }
}

/// The driver's CUDA version as (major, minor), e.g. (13, 0).
pub(crate) fn driver_version() -> Result<(i32, i32), CudaError> {
    let mut v = 0;
    check(
        // SAFETY: writes one int.
        unsafe { sys::cuDriverGetVersion(&mut v) },
        "cuDriverGetVersion",
    )?;
    Ok((v / 1000, (v % 1000) / 10))
}

/// One GPU with a current context and a stream of its own.
pub(crate) struct Gpu {
    pub name: String,
    pub pci_bus_id: String,
    pub stream: sys::CUstream,
}

impl Gpu {
    /// Initialises CUDA and makes device `ordinal`'s primary context current on this thread.
    pub(crate) fn open(ordinal: i32) -> Result<Gpu, CudaError> {
        // SAFETY: plain driver API calls with out-pointers we own.
        unsafe {
            check(sys::cuInit(0), "cuInit")?;
            let mut count = 0;
            check(sys::cuDeviceGetCount(&mut count), "cuDeviceGetCount")?;
            if ordinal >= count {
                return Err(CudaError(format!(
                    "GPU {ordinal} does not exist: CUDA sees {count} GPU(s) (check \
                     CUDA_VISIBLE_DEVICES and --nproc)"
                )));
            }
            let mut dev = 0;
            check(sys::cuDeviceGet(&mut dev, ordinal), "cuDeviceGet")?;
            let mut name = [0 as c_char; 128];
            check(
                sys::cuDeviceGetName(name.as_mut_ptr(), 128, dev),
                "cuDeviceGetName",
            )?;
            let mut bus = [0 as c_char; 32];
            let _ = sys::cuDeviceGetPCIBusId(bus.as_mut_ptr(), 32, dev);
            let mut ctx = std::ptr::null_mut();
            check(
                sys::cuDevicePrimaryCtxRetain(&mut ctx, dev),
                "cuDevicePrimaryCtxRetain",
            )?;
            check(sys::cuCtxSetCurrent(ctx), "cuCtxSetCurrent")?;
            let mut stream = std::ptr::null_mut();
            // CU_STREAM_NON_BLOCKING: no implicit sync with the legacy default stream.
            check(sys::cuStreamCreate(&mut stream, 1), "cuStreamCreate")?;
            Ok(Gpu {
                name: CStr::from_ptr(name.as_ptr()).to_string_lossy().into_owned(),
                pci_bus_id: CStr::from_ptr(bus.as_ptr()).to_string_lossy().into_owned(),
                stream,
            })
        }
    }

    pub(crate) fn alloc(&self, bytes: usize) -> Result<DeviceBuf, CudaError> {
        let mut p = 0;
        check(
            // SAFETY: writes the device pointer.
            unsafe { sys::cuMemAlloc_v2(&mut p, bytes.max(4)) },
            "cuMemAlloc",
        )?;
        Ok(DeviceBuf { ptr: p })
    }

    /// Page-locked host memory, for fast copies back to check results.
    pub(crate) fn alloc_host(&self, floats: usize) -> Result<HostBuf, CudaError> {
        let mut p = std::ptr::null_mut();
        let bytes = floats.max(1) * 4;
        check(
            // SAFETY: writes the host pointer.
            unsafe { sys::cuMemAllocHost_v2(&mut p, bytes) },
            "cuMemAllocHost",
        )?;
        Ok(HostBuf {
            ptr: p as *mut f32,
            len: floats,
        })
    }

    pub(crate) fn upload(&self, dst: &DeviceBuf, src: &[f32]) -> Result<(), CudaError> {
        // SAFETY: dst holds at least src.len() floats (caller's allocation).
        check(
            unsafe {
                sys::cuMemcpyHtoD_v2(dst.ptr, src.as_ptr().cast(), std::mem::size_of_val(src))
            },
            "cuMemcpyHtoD",
        )
    }

    /// Copies `floats` floats from `src` at float offset `off` into the start of `dst`, after
    /// the work queued on our stream.
    pub(crate) fn download_at(
        &self,
        dst: &mut HostBuf,
        src: &DeviceBuf,
        off: usize,
        floats: usize,
    ) -> Result<(), CudaError> {
        if floats > dst.len {
            return Err(CudaError(format!(
                "staging buffer of {} floats is too small for {floats}",
                dst.len
            )));
        }
        // SAFETY: src holds off+floats floats (caller), dst holds at least `floats`.
        unsafe {
            check(
                sys::cuMemcpyDtoHAsync_v2(
                    dst.ptr.cast(),
                    src.ptr + (off * 4) as u64,
                    floats * 4,
                    self.stream,
                ),
                "cuMemcpyDtoHAsync",
            )?;
        }
        self.synchronize()
    }

    /// Copies `n` floats within one buffer, from float offset `from` to `to`, on our stream.
    pub(crate) fn copy_within_async(
        &self,
        buf: &DeviceBuf,
        from: usize,
        to: usize,
        n: usize,
    ) -> Result<(), CudaError> {
        // SAFETY: the caller keeps both ranges inside the buffer and apart.
        check(
            unsafe {
                sys::cuMemcpyDtoDAsync_v2(
                    buf.ptr + (to * 4) as u64,
                    buf.ptr + (from * 4) as u64,
                    n * 4,
                    self.stream,
                )
            },
            "cuMemcpyDtoDAsync",
        )
    }

    pub(crate) fn copy_async(
        &self,
        dst: &DeviceBuf,
        src: &DeviceBuf,
        bytes: usize,
    ) -> Result<(), CudaError> {
        // SAFETY: both buffers hold at least `bytes` bytes.
        check(
            unsafe { sys::cuMemcpyDtoDAsync_v2(dst.ptr, src.ptr, bytes, self.stream) },
            "cuMemcpyDtoDAsync",
        )
    }

    pub(crate) fn synchronize(&self) -> Result<(), CudaError> {
        // SAFETY: our own stream.
        check(
            unsafe { sys::cuStreamSynchronize(self.stream) },
            "cuStreamSynchronize",
        )
    }

    pub(crate) fn event(&self) -> Result<Event, CudaError> {
        let mut e = std::ptr::null_mut();
        // SAFETY: writes the event handle; flags 0 = default (timing enabled).
        check(unsafe { sys::cuEventCreate(&mut e, 0) }, "cuEventCreate")?;
        Ok(Event(e))
    }

    pub(crate) fn record(&self, e: &Event) -> Result<(), CudaError> {
        // SAFETY: event and stream are ours.
        check(
            unsafe { sys::cuEventRecord(e.0, self.stream) },
            "cuEventRecord",
        )
    }

    /// Milliseconds between two recorded events, waiting for the second.
    pub(crate) fn elapsed_ms(&self, start: &Event, end: &Event) -> Result<f32, CudaError> {
        let mut ms = 0f32;
        // SAFETY: both events were recorded on our stream.
        unsafe {
            check(sys::cuEventSynchronize(end.0), "cuEventSynchronize")?;
            check(
                sys::cuEventElapsedTime(&mut ms, start.0, end.0),
                "cuEventElapsedTime",
            )?;
        }
        Ok(ms)
    }
}

pub(crate) struct DeviceBuf {
    pub ptr: sys::CUdeviceptr,
}

impl Drop for DeviceBuf {
    fn drop(&mut self) {
        // SAFETY: allocated by cuMemAlloc and not used after this.
        unsafe { sys::cuMemFree_v2(self.ptr) };
    }
}

pub(crate) struct HostBuf {
    ptr: *mut f32,
    len: usize,
}

impl HostBuf {
    /// The first `n` floats as their bit patterns (compared exactly, and as fast as memcmp).
    pub(crate) fn as_bits(&self, n: usize) -> &[u32] {
        // SAFETY: ptr holds len floats, allocated by cuMemAllocHost; u32 and f32 share layout.
        unsafe { std::slice::from_raw_parts(self.ptr.cast::<u32>(), n.min(self.len)) }
    }
}

impl Drop for HostBuf {
    fn drop(&mut self) {
        // SAFETY: allocated by cuMemAllocHost.
        unsafe { sys::cuMemFreeHost(self.ptr.cast()) };
    }
}

pub struct Event(sys::CUevent);

/// Counts elements that differ from a periodic expected pattern, on the GPU, so checking a
/// result costs a pass over device memory instead of a copy to the host and a CPU scan.
///
/// The kernel is a few lines of hand-written PTX (no CUDA toolkit needed: the driver JIT-compiles
/// it for the device at load). Callers self-test it before trusting it (see the worker).
pub(crate) struct Checker {
    func: sys::CUfunction,
    expected: DeviceBuf,
    counter: DeviceBuf,
    period: u64,
    result: HostBuf,
}

const CHECK_PTX: &str = r#"
.version 6.0
.target sm_50
.address_size 64

.visible .entry nrun_count_wrong(
    .param .u64 p_data, .param .u64 p_n, .param .u64 p_exp, .param .u64 p_period, .param .u64 p_counter)
{
    .reg .pred %p<4>;
    .reg .b32 %r<8>;
    .reg .b64 %rd<20>;
    ld.param.u64 %rd1, [p_data];
    ld.param.u64 %rd2, [p_n];
    ld.param.u64 %rd3, [p_exp];
    ld.param.u64 %rd16, [p_period];
    ld.param.u64 %rd4, [p_counter];
    cvta.to.global.u64 %rd1, %rd1;
    cvta.to.global.u64 %rd3, %rd3;
    cvta.to.global.u64 %rd4, %rd4;
    mov.u32 %r1, %ctaid.x;
    mov.u32 %r2, %ntid.x;
    mov.u32 %r3, %tid.x;
    mov.u32 %r4, %nctaid.x;
    mul.wide.u32 %rd5, %r1, %r2;
    cvt.u64.u32 %rd6, %r3;
    add.u64 %rd7, %rd5, %rd6;
    mul.wide.u32 %rd8, %r4, %r2;
    mov.u64 %rd9, 0;
LOOP:
    setp.ge.u64 %p1, %rd7, %rd2;
    @%p1 bra DONE;
    shl.b64 %rd10, %rd7, 2;
    add.u64 %rd11, %rd1, %rd10;
    ld.global.u32 %r5, [%rd11];
    rem.u64 %rd12, %rd7, %rd16;
    shl.b64 %rd13, %rd12, 2;
    add.u64 %rd14, %rd3, %rd13;
    ld.global.u32 %r6, [%rd14];
    setp.ne.u32 %p2, %r5, %r6;
    @%p2 add.u64 %rd9, %rd9, 1;
    add.u64 %rd7, %rd7, %rd8;
    bra LOOP;
DONE:
    setp.eq.u64 %p3, %rd9, 0;
    @%p3 bra END;
    atom.global.add.u64 %rd15, [%rd4], %rd9;
END:
    ret;
}
"#;

impl Checker {
    /// Loads the kernel and uploads one period of expected values (as f32 bit patterns).
    pub(crate) fn new(gpu: &Gpu, expected: &[f32]) -> Result<Checker, CudaError> {
        let ptx = std::ffi::CString::new(CHECK_PTX).map_err(|e| CudaError(e.to_string()))?;
        let mut module = std::ptr::null_mut();
        let mut func = std::ptr::null_mut();
        // SAFETY: a NUL-terminated PTX image; out-pointers we own.
        unsafe {
            check(
                sys::cuModuleLoadData(&mut module, ptx.as_ptr().cast()),
                "cuModuleLoadData (check kernel)",
            )?;
            check(
                sys::cuModuleGetFunction(&mut func, module, c"nrun_count_wrong".as_ptr()),
                "cuModuleGetFunction",
            )?;
        }
        let exp = gpu.alloc(expected.len() * 4)?;
        gpu.upload(&exp, expected)?;
        Ok(Checker {
            func,
            expected: exp,
            counter: gpu.alloc(8)?,
            period: expected.len() as u64,
            result: gpu.alloc_host(2)?,
        })
    }

    /// Wrong elements among the first `count` floats of `data`, after the work queued on the
    /// GPU's stream.
    pub(crate) fn count_wrong(
        &mut self,
        gpu: &Gpu,
        data: &DeviceBuf,
        count: usize,
    ) -> Result<u64, CudaError> {
        let mut p_data = data.ptr;
        let mut p_n = count as u64;
        let mut p_exp = self.expected.ptr;
        let mut p_period = self.period;
        let mut p_counter = self.counter.ptr;
        let mut params: [*mut std::ffi::c_void; 5] = [
            (&mut p_data as *mut u64).cast(),
            (&mut p_n as *mut u64).cast(),
            (&mut p_exp as *mut u64).cast(),
            (&mut p_period as *mut u64).cast(),
            (&mut p_counter as *mut u64).cast(),
        ];
        let threads = 256u32;
        let blocks = count.div_ceil(threads as usize).clamp(1, 2048) as u32;
        // SAFETY: the parameters match the kernel's signature and outlive the launch call
        // (the driver copies them); buffers are ours.
        unsafe {
            check(
                sys::cuMemsetD32Async(self.counter.ptr, 0, 2, gpu.stream),
                "cuMemsetD32Async",
            )?;
            check(
                sys::cuLaunchKernel(
                    self.func,
                    blocks,
                    1,
                    1,
                    threads,
                    1,
                    1,
                    0,
                    gpu.stream,
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                ),
                "cuLaunchKernel (check kernel)",
            )?;
            check(
                sys::cuMemcpyDtoHAsync_v2(self.result.ptr.cast(), self.counter.ptr, 8, gpu.stream),
                "cuMemcpyDtoHAsync",
            )?;
        }
        gpu.synchronize()?;
        let bits = self.result.as_bits(2);
        Ok(bits[0] as u64 | ((bits[1] as u64) << 32))
    }
}
