//! The built-in optimizers on a GPU (feature `cuda`): every rule of
//! [`crate::optimizer`]'s host (`rules.rs`), a kernel per float dtype and rule, for a weight and a
//! gradient on a GPU, with the optimizer's state (f64 moments, and a float32 master copy under
//! `multi_precision`) in that GPU's memory. They compute what the host computes, bit for bit:
//! each element is taken to f64, updated with the host's operations in the host's order
//! (compiled with fused multiply-add off; CUDA's f64 division and square root round
//! correctly, as the host's do; powers of the step count are taken on the host and passed
//! in), and rounded back to its type as the host rounds it (halves through f32,
//! [`crate::Element::from_f64`]).

use cudarc::driver::{CudaSlice, PushKernelArg};

use super::reduce;
use crate::optimizer::Step;
use crate::{DType, KvError, NDArray, Optimizer, Result};

/// The kernels' source, compiled with the sums' (whose conversions of halves it uses): a
/// kernel per dtype and rule (`kind`), which reads its parameters from `p`, in the order
/// [`params`] writes them.
pub(super) const SOURCE: &str = r#"
#define TO_D_f32(x) ((double)(x))
#define FROM_D_f32(x) ((float)(x))
#define TO_D_f64(x) (x)
#define FROM_D_f64(x) (x)
#define TO_D_f16(x) ((double)f16_to_f32(x))
#define FROM_D_f16(x) f32_to_f16((float)(x))
#define TO_D_bf16(x) ((double)bf16_to_f32(x))
#define FROM_D_bf16(x) f32_to_bf16((float)(x))
#define TY_f32 0
#define TY_f64 1
#define TY_f16 2
#define TY_bf16 3

struct Params { double p[12]; };

// `x` rounded into the type the update writes (0 f32, 1 f64, 2 f16, 3 bf16), as a double.
__device__ double round_into(double x, unsigned ty) {
    switch (ty) {
    case 0: return (double)(float)x;
    case 1: return x;
    case 2: return (double)f16_to_f32(f32_to_f16((float)x));
    default: return (double)bf16_to_f32(f32_to_bf16((float)x));
    }
}

// `x` clamped to [-c, c] where c > 0 (NaN stays NaN), as Rust's clamp.
__device__ double clip_to(double x, double c) {
    if (c > 0.0) {
        if (x < -c) x = -c;
        if (x > c) x = c;
    }
    return x;
}

// The gradient rescaled, then clipped.
__device__ double prep(double g, double rescale, double clip) {
    return clip_to(g * rescale, clip);
}

// 1, -1, or 0 (for 0 and NaN).
__device__ double sgn(double x) {
    return (double)(x > 0.0) - (double)(x < 0.0);
}

// One element's step: the new weight, unrounded, from the weight `wf` and the gradient `g`,
// with the element's moments `m`, `v` and `d` updated. The kinds and their parameters are
// those of `params` in src/gpu/optim.rs; each line is the host rule's, in its order.
__device__ __forceinline__ double rule(unsigned kind, const double* p, double wf, double g, double* m,
                       double* v, double* d, unsigned ty) {
    switch (kind) {
    case 0: { // SGD (and NAG) without momentum: lr wd rescale clip
        g = prep(g, p[2], p[3]);
        return wf - p[0] * (g + p[1] * wf);
    }
    case 1: { // SGD with momentum: lr wd rescale clip momentum
        g = prep(g, p[2], p[3]);
        double mi = p[4] * *m - p[0] * (g + p[1] * wf);
        *m = mi;
        return wf + mi;
    }
    case 2: { // NAG with momentum: lr wd rescale clip momentum
        g = prep(g, p[2], p[3]);
        double mi = *m * p[4];
        double nw = wf - mi + (p[4] + 1.0) * (mi - p[0] * (g + p[1] * wf));
        *m = mi - p[0] * (g + p[1] * round_into(nw, ty));
        return nw;
    }
    case 3: { // Adam: lr_t wd rescale clip beta1 beta2 epsilon
        g = clip_to(g * p[2] + p[1] * wf, p[3]);
        double mi = p[4] * *m + (1.0 - p[4]) * g;
        double vi = p[5] * *v + (1.0 - p[5]) * g * g;
        *m = mi;
        *v = vi;
        return wf - p[0] * mi / (sqrt(vi) + p[6]);
    }
    case 4: { // AdaGrad: lr wd rescale clip epsilon
        g = prep(g, p[2], p[3]);
        double h = *m + g * g;
        *m = h;
        double div = g / sqrt(h + p[4]);
        return wf + (div + wf * p[1]) * -p[0];
    }
    case 5: { // RMSProp: lr wd rescale clip gamma1 epsilon clip_weights
        g = clip_to(g * p[2] + p[1] * wf, p[3]);
        double n = (1.0 - p[4]) * (g * g) + p[4] * *m;
        *m = n;
        return clip_to(wf - p[0] * (g / sqrt(n + p[5])), p[6]);
    }
    case 6: { // centered RMSProp: lr wd rescale clip gamma1 epsilon clip_weights gamma2
        g = clip_to(g * p[2] + p[1] * wf, p[3]);
        double n = (1.0 - p[4]) * g * g + p[4] * *m;
        double ga = (1.0 - p[4]) * g + p[4] * *v;
        double delta = p[7] * *d - p[0] * g / sqrt(n - ga * ga + p[5]);
        *m = n;
        *v = ga;
        *d = delta;
        return clip_to(wf + delta, p[6]);
    }
    case 7: { // Nadam: lr wd rescale clip beta1 beta2 epsilon momentum_t momentum_t_1
              // m_schedule m_schedule_next (1 - beta2^t)
        g = clip_to(g * p[2] + p[1] * wf, p[3]);
        double mi = *m * p[4] + (1.0 - p[4]) * g;
        double vi = *v * p[5] + (1.0 - p[5]) * g * g;
        *m = mi;
        *v = vi;
        double g_prime = g / (1.0 - p[9]);
        double m_prime = mi / (1.0 - p[10]);
        double v_prime = vi / p[11];
        double m_bar = (1.0 - p[7]) * g_prime + p[8] * m_prime;
        return wf - p[0] * m_bar / (sqrt(v_prime) + p[6]);
    }
    case 8: { // FTML: lr wd rescale clip beta1 beta2 epsilon (1 - beta1^t) (1 - beta2^t)
        g = clip_to(g * p[2] + p[1] * wf, p[3]);
        double vi = p[5] * *v + (1.0 - p[5]) * (g * g);
        *v = vi;
        double d_t = p[7] / p[0] * (sqrt(vi / p[8]) + p[6]);
        double z = p[4] * *d + (1.0 - p[4]) * g - (d_t - p[4] * *m) * wf;
        *d = z;
        *m = d_t;
        return -z / d_t;
    }
    case 9: { // AdaDelta: lr wd rescale clip rho epsilon
        g = prep(g, p[2], p[3]);
        double acc_g = *m * p[4] + (1.0 - p[4]) * g * g;
        *m = acc_g;
        double delta = sqrt(*v + p[5]) / sqrt(acc_g + p[5]) * g;
        *v = *v * p[4] + (1.0 - p[4]) * delta * delta;
        return wf - (delta + p[1] * wf);
    }
    case 10: { // Adamax: lr_t wd rescale clip beta1 beta2
        g = clip_to(g * p[2] + p[1] * wf, p[3]);
        double mi = *m * p[4] + (1.0 - p[4]) * g;
        double u = fmax(p[5] * *v, fabs(g));
        *m = mi;
        *v = u;
        return wf - p[0] * mi / u;
    }
    case 11: { // signSGD (no rescale, no clip): lr wd
        return (1.0 - p[0] * p[1]) * wf - p[0] * sgn(g);
    }
    case 12: { // Signum: lr wd rescale clip momentum (at least 0) wd_lh
        double step = p[3] > 0.0 ? (1.0 - p[4]) * clip_to(p[2] * g, p[3])
                                 : (1.0 - p[4]) * p[2] * g;
        double s = p[4] * *m - (1.0 - p[4]) * p[1] * wf - step;
        *m = s;
        return (1.0 - p[0] * p[5]) * wf + p[0] * sgn(s);
    }
    default: { // FTRL: lr wd rescale clip lamda1 beta
        g = prep(g, p[2], p[3]);
        double n = *v;
        double z = *m + (g - (sqrt(n + g * g) - sqrt(n)) * wf / p[0]);
        n = n + g * g;
        *m = z;
        *v = n;
        double kept = fabs(z) > p[4] ? 1.0 : 0.0;
        return (sgn(z) * p[4] - z) / ((p[5] + sqrt(n)) / p[0] + p[1]) * kept;
    }
    }
}

// `w` updated by `g` by rule K (with `mp`, the float32 master copy `master` is updated by
// `g` widened, and `w` is the copy rounded), the moments `m`, `v` and `d` where the rule uses
// them. One kernel per rule, so that each has only its own rule's code and registers.
#define OPTIMIZER(S, T, K)                                                                 \
extern "C" __global__ void update_##S##_##K(unsigned mp, T* w, const T* g, float* master,  \
                                            double* m, double* v, double* d, u64 n,         \
                                            Params p) {                                     \
    EACH(n) {                                                                               \
        double gf = TO_D_##S(g[i]);                                                         \
        if (mp) {                                                                           \
            gf = (double)(float)gf;                                                         \
            float nw = (float)rule(K, p.p, (double)master[i], gf, m + i, v + i, d + i,      \
                                   TY_f32);                                                 \
            master[i] = nw;                                                                 \
            w[i] = FROM_D_##S((double)nw);                                                  \
        } else {                                                                            \
            w[i] = FROM_D_##S(rule(K, p.p, TO_D_##S(w[i]), gf, m + i, v + i, d + i,         \
                                   TY_##S));                                                \
        }                                                                                   \
    }                                                                                       \
}

#define RULES(S, T)                                                                        \
    OPTIMIZER(S, T, 0) OPTIMIZER(S, T, 1) OPTIMIZER(S, T, 2) OPTIMIZER(S, T, 3)            \
    OPTIMIZER(S, T, 4) OPTIMIZER(S, T, 5) OPTIMIZER(S, T, 6) OPTIMIZER(S, T, 7)            \
    OPTIMIZER(S, T, 8) OPTIMIZER(S, T, 9) OPTIMIZER(S, T, 10) OPTIMIZER(S, T, 11)          \
    OPTIMIZER(S, T, 12) OPTIMIZER(S, T, 13)

RULES(f32, float)
RULES(f64, double)
RULES(f16, unsigned short)
RULES(bf16, unsigned short)
"#;

/// The dtypes the kernels take, in the order of their kernels.
const DTYPES: [(DType, &str); 4] = [
    (DType::F32, "f32"),
    (DType::F64, "f64"),
    (DType::F16, "f16"),
    (DType::BF16, "bf16"),
];

/// How many of the moments `m`, `v` and `d`, in that order, each kind's rule reads.
const USES: [usize; 14] = [0, 1, 1, 2, 1, 1, 3, 2, 3, 2, 2, 0, 1, 2];

/// The kernels' names (`update_<dtype>_<rule>`), dtype by dtype, for the sums' program to
/// load: [`kernel_index`]'s order.
pub(super) fn names() -> impl Iterator<Item = String> {
    DTYPES
        .into_iter()
        .flat_map(|(_, s)| (0..USES.len()).map(move |k| format!("update_{s}_{k}")))
}

/// The index of the kernel of `dtype` and rule `kind` among [`names`], if the kernels take
/// `dtype`.
fn kernel_index(dtype: DType, kind: u32) -> Option<usize> {
    let d = DTYPES.iter().position(|&(t, _)| t == dtype)?;
    Some(d * USES.len() + kind as usize)
}

/// The kernel's `kind` of `opt`'s rule and its parameters, in the order the kernel reads
/// them (the four every rule has, then the rule's own); `stateful` says whether the key has a
/// momentum state (Signum: signum_update with, signsgd_update without; NAG: nag_mom_update
/// with, sgd_update without).
fn params(opt: &Optimizer, step: Step, stateful: bool) -> (u32, [f64; 12]) {
    let Step { t, lr_t, nadam } = step;
    let mut p = [0.0; 12];
    {
        let mut o = opt.clone();
        let c = o.common();
        p[..4].copy_from_slice(&[*c.lr, *c.wd, *c.rescale_grad, *c.clip_gradient]);
    }
    let mut own = |xs: &[f64]| p[4..4 + xs.len()].copy_from_slice(xs);
    let kind = match *opt {
        // NAG as the host runs it: by whether the key has its momentum state (made at its
        // first update where the momentum was not 0), not by the momentum's sign now.
        Optimizer::Sgd { momentum, .. } if momentum <= 0.0 => 0,
        Optimizer::Nag { .. } if !stateful => 0,
        Optimizer::Sgd { momentum, .. } => {
            own(&[momentum]);
            1
        }
        Optimizer::Nag { momentum, .. } => {
            // As the host's: 0 where the momentum is not positive (MXNet's NAG passes it
            // only then).
            own(&[if momentum > 0.0 { momentum } else { 0.0 }]);
            2
        }
        Optimizer::Adam {
            beta1,
            beta2,
            epsilon,
            ..
        } => {
            own(&[beta1, beta2, epsilon]);
            3
        }
        Optimizer::AdaGrad { epsilon, .. } => {
            own(&[epsilon]);
            4
        }
        Optimizer::RmsProp {
            gamma1,
            epsilon,
            clip_weights,
            ..
        } => {
            own(&[gamma1, epsilon, clip_weights]);
            5
        }
        Optimizer::RmsPropCentered {
            gamma1,
            gamma2,
            epsilon,
            clip_weights,
            ..
        } => {
            own(&[gamma1, epsilon, clip_weights, gamma2]);
            6
        }
        Optimizer::Nadam {
            beta1,
            beta2,
            epsilon,
            ..
        } => {
            // The host rule's own expression for the second moment's correction.
            let c2 = 1.0 - beta2.powf(t as f64);
            let [mom_t, mom_t_1, sched, sched_next] = nadam;
            own(&[beta1, beta2, epsilon, mom_t, mom_t_1, sched, sched_next, c2]);
            7
        }
        Optimizer::Ftml {
            beta1,
            beta2,
            epsilon,
            ..
        } => {
            let t = t as f64;
            own(&[
                beta1,
                beta2,
                epsilon,
                1.0 - beta1.powf(t),
                1.0 - beta2.powf(t),
            ]);
            8
        }
        Optimizer::AdaDelta { rho, epsilon, .. } => {
            own(&[rho, epsilon]);
            9
        }
        Optimizer::Adamax { beta1, beta2, .. } => {
            own(&[beta1, beta2]);
            10
        }
        Optimizer::Signum {
            momentum, wd_lh, ..
        } => {
            // MXNet's Signum passes a momentum of 0 or less on as none (the kernel's 0).
            own(&[momentum.max(0.0), wd_lh]);
            if stateful {
                12
            } else {
                11
            }
        }
        Optimizer::Ftrl { lamda1, beta, .. } => {
            own(&[lamda1, beta]);
            13
        }
    };
    // Adam's and Adamax's rules take the step's bias-corrected rate in the learning rate's
    // place.
    if matches!(kind, 3 | 10) {
        p[0] = lr_t;
    }
    (kind, p)
}

/// Whether an update of `weight` by `grad` runs on a GPU: both are GPU arrays of a dtype the
/// kernels take, and the kernels can be had on the weight's device. Otherwise it runs on the
/// host, through the arrays' mirrors.
pub(crate) fn applies(grad: &NDArray, weight: &NDArray) -> bool {
    let (Some(w), Some(_)) = (weight.device_buf(), grad.device_buf()) else {
        return false;
    };
    kernel_index(weight.dtype(), 0).is_some() && reduce::ready(w.ordinal()).is_ok()
}

/// One step of `opt` on the GPU ([`applies`] said so): `weight` updated in place by `grad`
/// (copied to the weight's GPU first if it is on another), with the moments (f64, on the
/// weight's GPU, each of the weight's size where the optimizer uses it, empty otherwise) and,
/// where given, the float32 master copy of a half weight (on the weight's GPU, its size).
pub(crate) fn step(
    opt: &Optimizer,
    step: Step,
    grad: &NDArray,
    weight: &mut NDArray,
    moments: [&mut NDArray; 3],
    master: Option<&mut NDArray>,
) -> Result<()> {
    let n = weight.size();
    let dtype = weight.dtype();
    let Some(w) = weight.device_buf_mut(true)? else {
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
    let (kind, p) = params(opt, step, moments[0].size() == n);
    let index = kernel_index(dtype, kind)
        .ok_or_else(|| KvError::Device(format!("no GPU update for {dtype}")))?;
    let f = reduce::update_function(ordinal, index)?;
    let stream = w.stream().clone();
    let gs = g.device()?;
    // The moments the rule reads (`USES` of them, in order), each of the weight's size on its
    // GPU; the others are not passed.
    let mut states: [Option<&mut CudaSlice<u8>>; 3] = [None, None, None];
    for (i, (s, a)) in states.iter_mut().zip(moments).enumerate() {
        if i < USES[kind as usize] {
            *s = Some(state_of(a, ordinal, n, 8)?);
        }
    }
    let [m, v, d] = states;
    let master = match master {
        Some(a) => Some(state_of(a, ordinal, n, 4)?),
        None => None,
    };
    let mp = u32::from(master.is_some());
    let ws = w.device_mut()?;
    let count = n as u64;
    let mut launch = stream.launch_builder(&f);
    launch.arg(&mp).arg(ws).arg(gs);
    // A state the rule does not use is absent: the kernel, which then reads none (it only
    // forms `m + i` and the like, never dereferenced), gets the gradient in its place.
    for s in [master, m, v, d] {
        match s {
            Some(s) => launch.arg(s),
            None => launch.arg(gs),
        };
    }
    launch.arg(&count).arg(&p);
    // SAFETY: update_T_K(unsigned mp, T* w, const T* g, float* master, double* m, double* v,
    // double* d, u64 n, Params p), Params being 12 doubles, K being `kind`: `w` and
    // `g` hold `n` elements of T (the arrays' sizes, checked equal by the caller) on this
    // device; `master` holds `n` f32 where `mp` is 1, and each moment `n` f64 where `kind`'s
    // rule reads it (`USES`; the sizes checked by `state_of`), the only cases in which the
    // kernel touches them.
    unsafe { launch.launch(reduce::grid(n)) }
        .map_err(|e| KvError::Device(format!("gpu({ordinal}): the {} update: {e}", opt.name())))?;
    Ok(())
}

/// A state's device memory, which must hold `n` elements of `size` bytes on device `ordinal`.
fn state_of(a: &mut NDArray, ordinal: u32, n: usize, size: usize) -> Result<&mut CudaSlice<u8>> {
    match a.device_buf_mut(true)? {
        Some(b) if b.ordinal() == ordinal && n.checked_mul(size) == Some(b.len()) => b.device_mut(),
        _ => Err(KvError::Device(
            "the optimizer's state is not on the weight's GPU".into(),
        )),
    }
}
