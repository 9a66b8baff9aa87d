//! Sums on a GPU (feature `cuda`): `dst = s0 + s1 + ...` kernels for f32, f64, f16 and bf16,
//! each source read once and the result written once (so a sum moves the bytes it must and no
//! more), compiled
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

// The sum of up to 8 sources in one pass, each read once and the result written once:
// `d = s0 + s1 + ... + s(k-1)` (or `d = d + s0 + ...` with `acc`), left to right, rounded to
// the element type after each addition, as the host sums (halves are added in f32). Each
// thread takes 16 bytes of every array at a time where all of them are 16-byte aligned (as
// whole allocations are), then the elements past the last whole 16 bytes one by one.
#define SUMS(NAME, T, A, LOAD, STORE)                                                      \
extern "C" __global__ void NAME(T* d, unsigned acc, unsigned k, u64 n, const T* s0,     \
                                const T* s1, const T* s2, const T* s3, const T* s4,        \
                                const T* s5, const T* s6, const T* s7) {                   \
    const T* s[8] = {s0, s1, s2, s3, s4, s5, s6, s7};                                       \
    const unsigned L = 16 / sizeof(T);                                                      \
    u64 first = blockIdx.x * (u64)blockDim.x + threadIdx.x;                                 \
    u64 stride = (u64)gridDim.x * blockDim.x;                                               \
    u64 bits = (u64)d;                                                                      \
    _Pragma("unroll")                                                                       \
    for (unsigned j = 0; j < 8; j++) if (j < k) bits |= (u64)s[j];                          \
    u64 nv = (bits % 16 == 0) ? n / L : 0;                                                  \
    for (u64 v = first; v < nv; v += stride) {                                              \
        A x[16 / sizeof(T)];                                                                \
        uint4 in = acc ? ((const uint4*)d)[v] : ((const uint4*)s0)[v];                      \
        const T* iv = (const T*)&in;                                                        \
        _Pragma("unroll")                                                                   \
        for (unsigned l = 0; l < L; l++) x[l] = LOAD(iv[l]);                                \
        _Pragma("unroll")                                                                   \
        for (unsigned j = 0; j < 8; j++) {                                                  \
            if (j < k && (j > 0 || acc)) {                                                  \
                uint4 b = ((const uint4*)s[j])[v];                                          \
                const T* bv = (const T*)&b;                                                 \
                _Pragma("unroll")                                                           \
                for (unsigned l = 0; l < L; l++) x[l] = LOAD(STORE(x[l] + LOAD(bv[l])));    \
            }                                                                               \
        }                                                                                   \
        uint4 out;                                                                          \
        T* ov = (T*)&out;                                                                   \
        _Pragma("unroll")                                                                   \
        for (unsigned l = 0; l < L; l++) ov[l] = STORE(x[l]);                               \
        ((uint4*)d)[v] = out;                                                               \
    }                                                                                       \
    for (u64 i = nv * L + first; i < n; i += stride) {                                      \
        A x = acc ? LOAD(d[i]) : LOAD(s0[i]);                                               \
        _Pragma("unroll")                                                                   \
        for (unsigned j = 0; j < 8; j++) {                                                  \
            if (j < k && (j > 0 || acc)) x = LOAD(STORE(x + LOAD(s[j][i])));                \
        }                                                                                   \
        d[i] = STORE(x);                                                                    \
    }                                                                                       \
}

#define SAME(x) (x)

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

SUMS(sum_f32, float, float, SAME, SAME)
SUMS(sum_f64, double, double, SAME, SAME)
SUMS(sum_f16, unsigned short, float, f16_to_f32, f32_to_f16)
SUMS(sum_bf16, unsigned short, float, bf16_to_f32, f32_to_bf16)
"#;

/// The dtypes summed on a GPU; others are summed on the host (through the arrays' mirrors).
pub(crate) fn on_gpu(dtype: DType) -> bool {
    kernel_name(dtype).is_some()
}

fn kernel_name(dtype: DType) -> Option<&'static str> {
    match dtype {
        DType::F32 => Some("sum_f32"),
        DType::F64 => Some("sum_f64"),
        DType::F16 => Some("sum_f16"),
        DType::BF16 => Some("sum_bf16"),
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
        let source = format!("{SOURCE}{}", super::optim::SOURCE);
        cudarc::nvrtc::compile_ptx_with_opts(source, opts).map_err(|e| e.to_string())
    })
    .as_ref()
    .map_err(|e| KvError::Device(format!("the GPU sum kernels: {e}")))
}

/// One device's kernels: the sums by name, the optimizers' by index
/// (`super::optim::names`'s order).
struct Kernels {
    by_name: Vec<(&'static str, CudaFunction)>,
    updates: Vec<CudaFunction>,
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
            KvError::Device(format!("gpu({ordinal}): loading the kernels: {e}"))
        };
        let module = g.ctx.load_module(ptx()?.clone()).map_err(fail)?;
        let sums = [DType::F32, DType::F64, DType::F16, DType::BF16].map(kernel_name);
        let mut by_name = Vec::new();
        for name in sums.into_iter().flatten() {
            by_name.push((name, module.load_function(name).map_err(fail)?));
        }
        let mut updates = Vec::new();
        for name in super::optim::names() {
            updates.push(module.load_function(&name).map_err(fail)?);
        }
        Ok(Arc::new(Kernels { by_name, updates }))
    })
}

/// The optimizers' kernel `index` (in `super::optim::names`'s order) on device `ordinal`.
pub(crate) fn update_function(ordinal: u32, index: usize) -> Result<CudaFunction> {
    kernels(ordinal)?
        .updates
        .get(index)
        .cloned()
        .ok_or_else(|| KvError::Device(format!("no GPU update kernel {index}")))
}

/// The kernel `name` on device `ordinal`.
pub(crate) fn function(ordinal: u32, name: &str) -> Result<CudaFunction> {
    kernels(ordinal)?
        .by_name
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, f)| f.clone())
        .ok_or_else(|| KvError::Device(format!("no GPU kernel {name}")))
}

/// A launch of `threads` threads in blocks of 256, up to enough blocks to fill the device
/// (the kernels' loops stride over the rest).
pub(crate) fn grid(threads: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (threads.div_ceil(256).clamp(1, 65_535) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The sources one kernel launch sums.
pub(crate) const FUSED: usize = 8;

/// `dst = srcs[0] + srcs[1] + ...` (`dst = dst + srcs[0] + ...` with `acc`) on `dst`'s
/// device, for `n` elements of `dtype` (one of [`on_gpu`]'s), left to right; the sources (1
/// to [`FUSED`]) are on the same device.
pub(crate) fn sum(
    dst: &mut DeviceBuf,
    acc: bool,
    srcs: &[&DeviceBuf],
    dtype: DType,
    n: usize,
) -> Result<()> {
    let ordinal = dst.ordinal();
    let name =
        kernel_name(dtype).ok_or_else(|| KvError::Device(format!("no GPU sum for {dtype}")))?;
    let f = function(ordinal, name)?;
    if n == 0 || srcs.is_empty() {
        return Ok(());
    }
    // The kernel takes the lengths on trust.
    let bytes = n.checked_mul(dtype.size());
    if std::iter::once(&*dst)
        .chain(srcs.iter().copied())
        .any(|b| bytes.is_none_or(|nb| b.len() < nb))
    {
        return Err(KvError::Incompatible(format!(
            "a GPU sum of {n} {dtype} values over buffers of fewer bytes"
        )));
    }
    if srcs.len() > FUSED {
        return Err(KvError::Device(format!(
            "a GPU sum takes at most {FUSED} values a launch"
        )));
    }
    let stream = dst.stream().clone();
    let mut views = Vec::with_capacity(FUSED);
    for s in srcs {
        views.push(s.device()?);
    }
    while views.len() < FUSED {
        views.push(views[0]);
    }
    let d = dst.device_mut()?;
    // A thread per 16 bytes.
    let cfg = grid(n.div_ceil(16 / dtype.size()));
    let (count, used, acc) = (n as u64, srcs.len() as u32, u32::from(acc));
    let mut launch = stream.launch_builder(&f);
    launch.arg(d).arg(&acc).arg(&used).arg(&count);
    for v in &views {
        launch.arg(*v);
    }
    // SAFETY: the kernel takes (T* d, unsigned acc, unsigned k, u64 n, const T* s0..s7) and
    // reads `d` (with `acc`) and the first `k` sources: `d` and every source are buffers of
    // at least `n` elements of `dtype` (checked above) on this device, `used` is how many
    // are real (the rest repeat the first, unread) and `count` is `n`.
    unsafe { launch.launch(cfg) }
        .map(|_| ())
        .map_err(|e| KvError::Device(format!("gpu({ordinal}): the sum kernel: {e}")))
}
