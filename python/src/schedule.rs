//! The learning-rate scheduler a `kvstore.lr_scheduler` object describes (its `_spec()`), as
//! the store runs it.

use kvstore::LrScheduler;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// `spec`'s scheduler, resumed where the object stands.
pub(crate) fn of(spec: &Bound<'_, PyDict>) -> PyResult<LrScheduler> {
    let get = |k: &str| -> PyResult<Bound<'_, PyAny>> {
        spec.get_item(k)?
            .ok_or_else(|| PyValueError::new_err(format!("lr_scheduler: no {k}")))
    };
    let f = |k: &str| -> PyResult<f64> { get(k)?.extract() };
    let n = |k: &str| -> PyResult<u64> { get(k)?.extract() };
    let kind: String = get("kind")?.extract()?;
    let s = match kind.as_str() {
        "factor" => LrScheduler::factor(n("step")?, f("factor")?)
            .stop_factor_lr(f("stop_factor_lr")?)
            .base_lr(f("warmup_final_lr")?),
        "multi_factor" => {
            LrScheduler::multi_factor(get("steps")?.extract::<Vec<u64>>()?, f("factor")?)
                .base_lr(f("warmup_final_lr")?)
        }
        "poly" => LrScheduler::poly(n("max_update")?, f("base_lr_orig")?, f("pwr")?)
            .final_lr(f("final_lr")?),
        "cosine" => {
            LrScheduler::cosine(n("max_update")?, f("base_lr_orig")?).final_lr(f("final_lr")?)
        }
        other => {
            return Err(PyValueError::new_err(format!(
                "lr_scheduler: unknown kind {other:?}"
            )))
        }
    };
    let s = s.warmup(n("warmup_steps")?, f("warmup_begin_lr")?);
    let s = match get("warmup_constant")?.extract::<bool>()? {
        true => s.constant_warmup(),
        false => s,
    };
    let passed = match spec.get_item("passed")? {
        Some(p) => p.extract()?,
        None => 0,
    };
    let count = match spec.get_item("count")? {
        Some(c) => c.extract()?,
        None => 0,
    };
    Ok(s.resumed(f("base_lr")?, count, passed))
}
