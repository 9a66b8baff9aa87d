//! The built-in optimizers on a GPU (feature `cuda`): SGD, SGD with momentum and Adam, one
//! kernel each per float dtype, for a weight and a gradient on a GPU, with the optimizer's
//! state (f64 moments) in that GPU's memory. They compute what the host computes, bit for
//! bit: each element is taken to f64, updated with the host's operations in the host's order
//! (compiled with fused multiply-add off; CUDA's f64 division and square root round
//! correctly, as the host's do), and rounded back to its type as the host rounds it (halves
//! through f32, [`crate::Element::from_f64`]).

use cudarc::driver::PushKernelArg;

use super::reduce;
use crate::{DType, KvError, NDArray, Optimizer, Result};

/// The kernels' source, compiled with the sums' (whose conversions of halves it uses).
pub(super) const SOURCE: &str = r#"
#define TO_D_f32(x) ((double)(x))
#define FROM_D_f32(x) ((float)(x))
#define TO_D_f64(x) (x)
#define FROM_D_f64(x) (x)
#define TO_D_f16(x) ((double)f16_to_f32(x))
#define FROM_D_f16(x) f32_to_f16((float)(x))
#define TO_D_bf16(x) ((double)bf16_to_f32(x))
#define FROM_D_bf16(x) f32_to_bf16((float)(x))

// The gradient rescaled, then clipped to [-clip, clip] where clip > 0 (NaN stays NaN).
__device__ double prep(double g, double rescale, double clip) {
    g = g * rescale;
    if (clip > 0.0) {
        if (g < -clip) g = -clip;
        if (g > clip) g = clip;
    }
    return g;
}

#define OPTIMIZERS(S, T)                                                                   \
extern "C" __global__ void sgd_##S(T* w, const T* g, double* m, u64 n, double lr,         \
                                   double mom, double wd, double rescale, double clip) {   \
    EACH(n) {                                                                               \
        double wf = TO_D_##S(w[i]);                                                         \
        double gf = prep(TO_D_##S(g[i]), rescale, clip);                                    \
        if (mom > 0.0) {                                                                    \
            double mi = mom * m[i] - lr * (gf + wd * wf);                                   \
            m[i] = mi;                                                                      \
            w[i] = FROM_D_##S(wf + mi);                                                     \
        } else {                                                                            \
            w[i] = FROM_D_##S(wf - lr * (gf + wd * wf));                                    \
        }                                                                                   \
    }                                                                                       \
}                                                                                           \
extern "C" __global__ void adam_##S(T* w, const T* g, double* m, double* v, u64 n,        \
                                    double lr_t, double b1, double b2, double eps,          \
                                    double wd, double rescale, double clip) {               \
    EACH(n) {                                                                               \
        double wf = TO_D_##S(w[i]);                                                         \
        double gf = prep(TO_D_##S(g[i]) * rescale + wd * wf, 1.0, clip);                    \
        double mi = b1 * m[i] + (1.0 - b1) * gf;                                            \
        double vi = b2 * v[i] + (1.0 - b2) * gf * gf;                                       \
        m[i] = mi;                                                                          \
        v[i] = vi;                                                                          \
        w[i] = FROM_D_##S(wf - lr_t * mi / (sqrt(vi) + eps));                               \
    }                                                                                       \
}

OPTIMIZERS(f32, float)
OPTIMIZERS(f64, double)
OPTIMIZERS(f16, unsigned short)
OPTIMIZERS(bf16, unsigned short)
"#;

/// The kernels' names, for the sums' program to load.
pub(super) const NAMES: [&str; 8] = [
    "sgd_f32",
    "adam_f32",
    "sgd_f64",
    "adam_f64",
    "sgd_f16",
    "adam_f16",
    "sgd_bf16",
    "adam_bf16",
];
fn suffix(dtype: DType) -> Option<&'static str> {
    match dtype {
        DType::F32 => Some("f32"),
        DType::F64 => Some("f64"),
        DType::F16 => Some("f16"),
        DType::BF16 => Some("bf16"),
        _ => None,
    }
}

/// Whether an update of `weight` by `grad` runs on a GPU: both are GPU arrays of a dtype the
/// kernels take, and the kernels can be had on the weight's device. Otherwise it runs on the
/// host, through the arrays' mirrors.
pub(crate) fn applies(grad: &NDArray, weight: &NDArray) -> bool {
    let (Some(w), Some(_)) = (weight.device_buf(), grad.device_buf()) else {
        return false;
    };
    suffix(weight.dtype()).is_some() && reduce::ready(w.ordinal()).is_ok()
}

/// One step of `opt` on the GPU ([`applies`] said so): `weight` updated in place by `grad`
/// (copied to the weight's GPU first if it is on another), with the moments `m` and `v`
/// (f64, on the weight's GPU, of its size where the optimizer uses them) and, for Adam, the
/// learning rate of step `t`.
pub(crate) fn step(
    opt: &Optimizer,
    lr_t: f64,
    grad: &NDArray,
    weight: &mut NDArray,
    m: &mut NDArray,
    v: &mut NDArray,
) -> Result<()> {
    let n = weight.size();
    let dtype = weight.dtype();
    let sfx = suffix(dtype).ok_or_else(|| KvError::Device(format!("no GPU update for {dtype}")))?;
    let Some(w) = weight.device_buf_mut() else {
        return Err(KvError::Device("the weight is not on a GPU".into()));
    };
    let ordinal = w.ordinal();
    let Some(g) = grad.device_buf() else {
        return Err(KvError::Device("the gradient is not on a GPU".into()));
    };
    let moved;
    let g = if g.ordinal() == ordinal {
        g
    } else {
        moved = g.copy_to(ordinal)?;
        &moved
    };
    if n == 0 {
        return Ok(());
    }
    let cfg = reduce::grid(n);
    let count = n as u64;
    let stream = w.stream().clone();
    let gs = g.device()?;
    let fail = |e: cudarc::driver::DriverError| {
        KvError::Device(format!("gpu({ordinal}): the {} update: {e}", opt.name()))
    };
    match *opt {
        Optimizer::Sgd {
            lr,
            momentum,
            wd,
            rescale_grad,
            clip_gradient,
        } => {
            let f = reduce::function(ordinal, &format!("sgd_{sfx}"))?;
            let ws = w.device_mut()?;
            let mut launch = stream.launch_builder(&f);
            launch.arg(ws).arg(gs);
            // Momentum only where it is positive (MXNet's SGD): plain SGD has no moments,
            // and the kernel, which then reads none, gets the gradient in their place.
            if momentum > 0.0 {
                launch.arg(moment(m, ordinal, n)?);
            } else {
                launch.arg(gs);
            }
            launch.arg(&count).arg(&lr).arg(&momentum).arg(&wd);
            launch.arg(&rescale_grad).arg(&clip_gradient);
            // SAFETY: sgd_T(T* w, const T* g, double* m, u64 n, double lr, mom, wd, rescale,
            // clip): `w` and `g` hold `n` elements of T (the arrays' sizes, checked equal by
            // the caller) on this device, and `m` `n` f64 (its size checked by `moment`) where
            // `mom` > 0, the only case in which the kernel reads or writes it.
            unsafe { launch.launch(cfg) }.map_err(fail)?;
        }
        Optimizer::Adam {
            beta1,
            beta2,
            epsilon,
            wd,
            rescale_grad,
            clip_gradient,
            ..
        } => {
            let f = reduce::function(ordinal, &format!("adam_{sfx}"))?;
            let ms = moment(m, ordinal, n)?;
            let vs = moment(v, ordinal, n)?;
            let ws = w.device_mut()?;
            let mut launch = stream.launch_builder(&f);
            launch.arg(ws).arg(gs).arg(ms).arg(vs).arg(&count);
            launch
                .arg(&lr_t)
                .arg(&beta1)
                .arg(&beta2)
                .arg(&epsilon)
                .arg(&wd);
            launch.arg(&rescale_grad).arg(&clip_gradient);
            // SAFETY: adam_T(T* w, const T* g, double* m, double* v, u64 n, double lr_t, b1,
            // b2, eps, wd, rescale, clip): `w` and `g` hold `n` elements of T, `m` and `v` `n`
            // f64 each (their sizes checked above), all on this device.
            unsafe { launch.launch(cfg) }.map_err(fail)?;
        }
        _ => {
            return Err(KvError::Unsupported(format!(
                "gpu({ordinal}): {} has no GPU update (its update runs on the host)",
                opt.name()
            )))
        }
    }
    Ok(())
}

/// A moment's device memory, which must hold `n` f64 on device `ordinal`.
fn moment(a: &mut NDArray, ordinal: u32, n: usize) -> Result<&mut cudarc::driver::CudaSlice<u8>> {
    match a.device_buf_mut() {
        Some(b) if b.ordinal() == ordinal && n.checked_mul(8) == Some(b.len()) => b.device_mut(),
        _ => Err(KvError::Device(
            "the optimizer's state is not on the weight's GPU".into(),
        )),
    }
}
