//! MXNet's `multi_precision`: a float16 weight's key keeps a float32 master copy of the weight,
//! the update runs on it (the gradient widened to float32, as MXNet's `grad.astype(float32)`),
//! and the weight is the copy rounded back (MXNet's `update_multi_precision`). kvstore applies
//! it to bfloat16 weights too.

use super::rules::{update_typed, Step};
use super::Optimizer;
use crate::dtype::with_dtype;
use crate::{DType, Element, NDArray, Result};

/// Whether a weight of `dtype` takes a master copy where the optimizer has `multi_precision`.
pub(super) fn applies(dtype: DType) -> bool {
    matches!(dtype, DType::F16 | DType::BF16)
}

fn widen<T: Element>(x: &[T]) -> Vec<f32> {
    // Every float16 and bfloat16 value is a float32 exactly.
    x.iter().map(|v| v.to_f64() as f32).collect()
}

/// The master copy of `weight`: its values as float32, in host memory.
pub(super) fn copy_of(weight: &NDArray) -> Result<NDArray> {
    let values = with_dtype!(weight.dtype(), T => widen(weight.as_slice::<T>()?));
    NDArray::from_vec(&[values.len()], values)
}

/// One step of `opt` on `master` (float32, the weight's size) with `grad` widened, then
/// `weight` set to `master` rounded into its dtype.
pub(super) fn step(
    opt: &Optimizer,
    step: Step,
    grad: &NDArray,
    weight: &mut NDArray,
    master: &mut NDArray,
    moments: [&mut [f64]; 3],
) -> Result<()> {
    let dtype = weight.dtype();
    let g = with_dtype!(dtype, T => widen(grad.as_slice::<T>()?));
    let master = master.as_mut_slice::<f32>()?;
    // (MXNet's mp_sgd_update, mp_sgd_mom_update and mp_nag_mom_update are its rules on the
    // float32 copy, in their order.)
    update_typed::<f32>(opt, step, &g, master, moments);
    with_dtype!(dtype, T => {
        for (w, m) in weight.as_mut_slice::<T>()?.iter_mut().zip(master.iter()) {
            // One rounding: a float32 is a float64 exactly. (Element's conversion, not the
            // `half` crate's inherent `from_f64`, which rounds a bfloat16 from the f64's top
            // 32 bits only.)
            *w = <T as Element>::from_f64(f64::from(*m));
        }
    });
    Ok(())
}

#[cfg(test)]
#[path = "master_tests.rs"]
mod tests;
