//! The few CUDA driver calls the preflight makes, through cudarc's dynamically loaded bindings
//! (so nrun starts, and says why, on machines without libcuda). Errors carry CUDA's own text.

use std::ffi::{CStr, c_char};

use cudarc::driver::sys::{self, CUresult};

#[derive(Debug)]
pub struct CudaError(pub String);

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
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the driver library.
    unsafe { sys::is_culib_present() }
}

/// The driver's CUDA version as (major, minor), e.g. (13, 0).
pub fn driver_version() -> Result<(i32, i32), CudaError> {
    let mut v = 0;
    // SAFETY: writes one int.
    check(
        unsafe { sys::cuDriverGetVersion(&mut v) },
        "cuDriverGetVersion",
    )?;
    Ok((v / 1000, (v % 1000) / 10))
}

/// One GPU with a current context and a stream of its own.
pub struct Gpu {
    pub ordinal: i32,
    pub name: String,
    pub pci_bus_id: String,
    pub stream: sys::CUstream,
}

impl Gpu {
    /// Initialises CUDA and makes device `ordinal`'s primary context current on this thread.
    pub fn open(ordinal: i32) -> Result<Gpu, CudaError> {
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
                ordinal,
                name: CStr::from_ptr(name.as_ptr()).to_string_lossy().into_owned(),
                pci_bus_id: CStr::from_ptr(bus.as_ptr()).to_string_lossy().into_owned(),
                stream,
            })
        }
    }

    pub fn alloc(&self, bytes: usize) -> Result<DeviceBuf, CudaError> {
        let mut p = 0;
        // SAFETY: writes the device pointer.
        check(
            unsafe { sys::cuMemAlloc_v2(&mut p, bytes.max(4)) },
            "cuMemAlloc",
        )?;
        Ok(DeviceBuf { ptr: p })
    }

    /// Page-locked host memory, for fast copies back to check results.
    pub fn alloc_host(&self, floats: usize) -> Result<HostBuf, CudaError> {
        let mut p = std::ptr::null_mut();
        let bytes = floats.max(1) * 4;
        // SAFETY: writes the host pointer.
        check(
            unsafe { sys::cuMemAllocHost_v2(&mut p, bytes) },
            "cuMemAllocHost",
        )?;
        Ok(HostBuf {
            ptr: p as *mut f32,
            len: floats,
        })
    }

    pub fn upload(&self, dst: &DeviceBuf, src: &[f32]) -> Result<(), CudaError> {
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
    pub fn download_at(
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
    pub fn copy_within_async(
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

    pub fn copy_async(
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

    pub fn synchronize(&self) -> Result<(), CudaError> {
        // SAFETY: our own stream.
        check(
            unsafe { sys::cuStreamSynchronize(self.stream) },
            "cuStreamSynchronize",
        )
    }

    pub fn event(&self) -> Result<Event, CudaError> {
        let mut e = std::ptr::null_mut();
        // SAFETY: writes the event handle; flags 0 = default (timing enabled).
        check(unsafe { sys::cuEventCreate(&mut e, 0) }, "cuEventCreate")?;
        Ok(Event(e))
    }

    pub fn record(&self, e: &Event) -> Result<(), CudaError> {
        // SAFETY: event and stream are ours.
        check(
            unsafe { sys::cuEventRecord(e.0, self.stream) },
            "cuEventRecord",
        )
    }

    /// Milliseconds between two recorded events, waiting for the second.
    pub fn elapsed_ms(&self, start: &Event, end: &Event) -> Result<f32, CudaError> {
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

pub struct DeviceBuf {
    pub ptr: sys::CUdeviceptr,
}

impl Drop for DeviceBuf {
    fn drop(&mut self) {
        // SAFETY: allocated by cuMemAlloc and not used after this.
        unsafe { sys::cuMemFree_v2(self.ptr) };
    }
}

pub struct HostBuf {
    ptr: *mut f32,
    len: usize,
}

impl HostBuf {
    /// The first `n` floats as their bit patterns (compared exactly, and as fast as memcmp).
    pub fn as_bits(&self, n: usize) -> &[u32] {
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
