//! Sums on a GPU (feature `cuda`): `dst += src` kernels for f32, f64, f16 and bf16, compiled
//! with NVRTC once per process and loaded once per device, with fused multiply-add off so
//! that a sum on the GPU is the sum on the host, bit for bit (the same order: the first value,
//! then each next one added, rounded to the element type after each addition, as
//! [`crate::ops::sum_into`] does).

use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{CudaFunction, LaunchConfig, PushKernelArg};

use super::device::{gpu, per_device, DeviceBuf};
use crate::{DType, KvError, Result};

/// One thread per element of a grid-stride loop; halves are added in f32 and rounded to
/// nearest even, as the `half` crate's conversions do (NaN stays a quiet NaN).
const SOURCE: &str = r#"
typedef unsigned long long u64;
#define EACH(n) for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < (n); \
                     i += (u64)gridDim.x * blockDim.x)

extern "C" __global__ void add_f32(float* d, const float* s, u64 n) {
    EACH(n) d[i] = d[i] + s[i];
}

extern "C" __global__ void add_f64(double* d, const double* s, u64 n) {
    EACH(n) d[i] = d[i] + s[i];
}

__device__ float f16_to_f32(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ unsigned short f32_to_f16(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

extern "C" __global__ void add_f16(unsigned short* d, const unsigned short* s, u64 n) {
    EACH(n) d[i] = f32_to_f16(f16_to_f32(d[i]) + f16_to_f32(s[i]));
}

__device__ float bf16_to_f32(unsigned short h) {
    return __uint_as_float(((unsigned int)h) << 16);
}

__device__ unsigned short f32_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (unsigned short)((u >> 16) | 0x40u);
    }
    return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

extern "C" __global__ void add_bf16(unsigned short* d, const unsigned short* s, u64 n) {
    EACH(n) d[i] = f32_to_bf16(bf16_to_f32(d[i]) + bf16_to_f32(s[i]));
}
"#;

/// The dtypes summed on a GPU; others are summed on the host (through the arrays' mirrors).
pub(crate) fn on_gpu(dtype: DType) -> bool {
    kernel_name(dtype).is_some()
}

fn kernel_name(dtype: DType) -> Option<&'static str> {
    match dtype {
        DType::F32 => Some("add_f32"),
        DType::F64 => Some("add_f64"),
        DType::F16 => Some("add_f16"),
        DType::BF16 => Some("add_bf16"),
        _ => None,
    }
}

/// The compiled program, once per process.
fn ptx() -> Result<&'static cudarc::nvrtc::Ptx> {
    static PTX: OnceLock<std::result::Result<cudarc::nvrtc::Ptx, String>> = OnceLock::new();
    PTX.get_or_init(|| {
        // SAFETY: only looks for the library by name (dlopen); nothing is called.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            return Err(
                "NVRTC (libnvrtc), which compiles the sum kernels, is not installed".into(),
            );
        }
        let opts = cudarc::nvrtc::CompileOptions {
            fmad: Some(false),
            // NVRTC's default architecture (the PTX is compiled for each device by its
            // driver); the f16 conversions are in every architecture's PTX.
            name: Some("kvstore_sums.cu".into()),
            ..Default::default()
        };
        cudarc::nvrtc::compile_ptx_with_opts(SOURCE, opts).map_err(|e| e.to_string())
    })
    .as_ref()
    .map_err(|e| KvError::Device(format!("the GPU sum kernels: {e}")))
}

/// One device's kernels, by dtype.
struct Kernels {
    add: Vec<(DType, CudaFunction)>,
}

/// Whether the kernels are ready on device `ordinal` (compiled and loaded now if not yet).
pub(crate) fn ready(ordinal: u32) -> Result<()> {
    kernels(ordinal).map(drop)
}

fn kernels(ordinal: u32) -> Result<Arc<Kernels>> {
    static LOADED: Mutex<Vec<Option<Arc<Kernels>>>> = Mutex::new(Vec::new());
    per_device(&LOADED, ordinal, || {
        let g = gpu(ordinal)?;
        let fail = |e: cudarc::driver::DriverError| {
            KvError::Device(format!("gpu({ordinal}): loading the sum kernels: {e}"))
        };
        let module = g.ctx.load_module(ptx()?.clone()).map_err(fail)?;
        let mut add = Vec::new();
        for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
            if let Some(name) = kernel_name(dtype) {
                add.push((dtype, module.load_function(name).map_err(fail)?));
            }
        }
        Ok(Arc::new(Kernels { add }))
    })
}

/// `dst += src` on `dst`'s device, for `n` elements of `dtype` (one of [`on_gpu`]'s); `src`
/// is on the same device.
pub(crate) fn add(dst: &mut DeviceBuf, src: &DeviceBuf, dtype: DType, n: usize) -> Result<()> {
    let ordinal = dst.ordinal();
    let k = kernels(ordinal)?;
    let f = k
        .add
        .iter()
        .find(|(d, _)| *d == dtype)
        .map(|(_, f)| f)
        .ok_or_else(|| KvError::Device(format!("no GPU sum for {dtype}")))?;
    if n == 0 {
        return Ok(());
    }
    let stream = dst.stream().clone();
    let s = src.device()?;
    let d = dst.device_mut()?;
    // Enough blocks to fill the device; the loop strides over the rest.
    let blocks = n.div_ceil(256).min(65_535) as u32;
    let cfg = LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let count = n as u64;
    let mut launch = stream.launch_builder(f);
    launch.arg(d).arg(s).arg(&count);
    // SAFETY: the kernel takes (T* d, const T* s, u64 n): `d` and `s` are buffers of at least
    // `n` elements of `dtype` (the caller's sizes, checked against the array shapes), on
    // this device, and `count` is that `n`.
    unsafe { launch.launch(cfg) }
        .map(|_| ())
        .map_err(|e| KvError::Device(format!("gpu({ordinal}): the sum kernel: {e}")))
}
