//! The updater a server runs on each round's sum (or each async push).

use crate::local::check_updater_kept_shape;
use crate::optimizer::OptimizerUpdater;
use crate::registry::SharedUpdater;
use crate::{Key, KvError, NDArray};

/// What a server merges pushes with.
pub(super) enum Updater {
    Assign,
    Optimizer(Box<OptimizerUpdater>),
    Named(String, SharedUpdater),
}

/// Merges `input` into `stored` with the updater (ASSIGN only in sync mode). An updater that
/// replaced `stored` with another shape or dtype took the value with it: `lost` says why.
pub(super) fn apply(
    up: &mut Updater,
    sync: bool,
    key: u64,
    input: &NDArray,
    stored: &mut NDArray,
    lost: &mut Option<String>,
) -> crate::Result<()> {
    let k = Key::Int(key as i64);
    match up {
        Updater::Assign if sync => stored.copy_from(input),
        Updater::Assign => Err(KvError::Unsupported(
            "dist_async needs an updater on the servers: call set_optimizer or \
             set_server_updater (in Python, set_optimizer or _set_updater) before pushing"
                .into(),
        )),
        Updater::Optimizer(o) => o.update(&k, input, stored),
        Updater::Named(name, f) => {
            let (shape, dtype) = (stored.shape().to_vec(), stored.dtype());
            let applied = f(&k, input, stored).map_err(|e| KvError::Updater {
                key: k.clone(),
                // An updater that fails with an updater error says the key already: its
                // reason is kept, not wrapped again.
                reason: match e {
                    KvError::Updater { reason, .. } => format!("{}: {reason}", shown(name)),
                    other => format!("{}: {other}", shown(name)),
                },
            });
            // Checked whether it failed or not: one that replaced the value and then failed
            // has lost it all the same.
            check_updater_kept_shape(&k, stored, &shape, dtype).inspect_err(|e| {
                if let KvError::Updater { reason, .. } = e {
                    *lost = Some(reason.clone());
                }
            })?;
            applied
        }
    }
}

/// How an updater's name is said in errors: one shipped by value (`scheme:<bytes>`, a
/// Python updater's pickle in hex, say) by its scheme, not its bytes.
fn shown(name: &str) -> std::borrow::Cow<'_, str> {
    match name.split_once(':') {
        Some((scheme, _)) => format!("the {scheme} updater shipped by value").into(),
        None => name.into(),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn an_updater_shipped_by_value_is_named_by_its_scheme() {
        assert_eq!(
            super::shown("python:8005950a"),
            "the python updater shipped by value"
        );
        assert_eq!(super::shown("double_add"), "double_add");
    }
}
