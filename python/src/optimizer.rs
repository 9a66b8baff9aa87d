//! The optimizer, with its learning-rate scheduler, that a `kvstore.optimizer` object
//! describes (its `_kvstore_spec()`), as the store runs it.

use kvstore::{LrScheduler, Optimizer};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// The optimizer a `kvstore.optimizer` object describes (`_kvstore_spec()`).
pub(crate) fn of(obj: &Bound<'_, PyAny>) -> PyResult<kvstore::Multiplied> {
    if !obj.hasattr("_kvstore_spec")? {
        return Err(PyTypeError::new_err(
            "set_optimizer takes a kvstore.optimizer object (SGD, NAG, Adam, AdaGrad, RMSProp, \
             AdaDelta, Adamax, Signum, Ftrl, FTML, Nadam)",
        ));
    }
    let spec = obj.call_method0("_kvstore_spec")?;
    let (name, p, mults): (String, Bound<'_, PyDict>, Bound<'_, PyDict>) = spec.extract()?;
    let get = |k: &str, default: f64| -> PyResult<f64> {
        match p.get_item(k)? {
            Some(v) if !v.is_none() => v.extract(),
            _ => Ok(default),
        }
    };
    let opt = match name.as_str() {
        "sgd" => Optimizer::sgd(get("learning_rate", 0.01)?).momentum(get("momentum", 0.0)?),
        "nag" => Optimizer::nag(get("learning_rate", 0.01)?).momentum(get("momentum", 0.0)?),
        "adam" => Optimizer::adam(get("learning_rate", 0.001)?)
            .beta1(get("beta1", 0.9)?)
            .beta2(get("beta2", 0.999)?)
            .epsilon(get("epsilon", 1e-8)?),
        "adagrad" => Optimizer::adagrad(get("learning_rate", 0.01)?).epsilon(get("eps", 1e-7)?),
        "rmsprop" => Optimizer::rmsprop(get("learning_rate", 0.001)?)
            .gamma1(get("gamma1", 0.9)?)
            .epsilon(get("epsilon", 1e-8)?)
            .clip_weights(get("clip_weights", 0.0)?)
            .centered(match p.get_item("centered")? {
                Some(c) => c.extract()?,
                None => false,
            })
            .gamma2(get("gamma2", 0.9)?),
        "adadelta" => Optimizer::adadelta()
            .lr(get("learning_rate", 0.01)?)
            .rho(get("rho", 0.9)?)
            .epsilon(get("epsilon", 1e-5)?),
        "adamax" => Optimizer::adamax(get("learning_rate", 0.002)?)
            .beta1(get("beta1", 0.9)?)
            .beta2(get("beta2", 0.999)?),
        "signum" => Optimizer::signum(get("learning_rate", 0.01)?)
            .momentum(get("momentum", 0.9)?)
            .wd_lh(get("wd_lh", 0.0)?),
        "nadam" => Optimizer::nadam(get("learning_rate", 0.001)?)
            .beta1(get("beta1", 0.9)?)
            .beta2(get("beta2", 0.999)?)
            .epsilon(get("epsilon", 1e-8)?)
            .schedule_decay(get("schedule_decay", 0.004)?),
        "ftml" => Optimizer::ftml(get("learning_rate", 0.01)?)
            .beta1(get("beta1", 0.6)?)
            .beta2(get("beta2", 0.999)?)
            .epsilon(get("epsilon", 1e-8)?),
        "ftrl" => Optimizer::ftrl(get("learning_rate", 0.1)?)
            .lamda1(get("lamda1", 0.01)?)
            .beta(get("beta", 1.0)?),
        other => {
            return Err(PyValueError::new_err(format!(
                "optimizer {other:?} does not run in the store; it runs sgd, nag, adam, \
                 adagrad, rmsprop, adadelta, adamax, signum, ftrl, ftml and nadam"
            )))
        }
    };
    let mut opt = kvstore::Multiplied::from(
        opt.wd(get("wd", 0.0)?)
            .rescale_grad(get("rescale_grad", 1.0)?)
            .clip_gradient(get("clip_gradient", 0.0)?),
    );
    if let Some(b) = p.get_item("begin_num_update")? {
        opt = opt.begin_num_update(b.extract()?);
    }
    if let Some(b) = p.get_item("multi_precision")? {
        opt = opt.multi_precision(b.extract()?);
    }
    if let Some(s) = p.get_item("lr_scheduler")? {
        opt = opt.lr_scheduler(scheduler(&s.cast_into::<PyDict>()?)?);
    }
    for (k, m) in mults.iter() {
        let (lr, wd): (f64, f64) = m.extract()?;
        let k = crate::args::key(&k)?;
        opt = opt.lr_mult(k.clone(), lr).wd_mult(k, wd);
    }
    Ok(opt)
}

/// `spec`'s scheduler, resumed where the object stands.
fn scheduler(spec: &Bound<'_, PyDict>) -> PyResult<LrScheduler> {
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
