//! Named updaters, registered by the user's program so that its server-role processes can run
//! them (a closure cannot travel over the wire; its name can).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use crate::{Key, KvError, NDArray, Result};

/// A registered updater: `(key, input, stored)`, merging `input` into `stored` in place.
pub type SharedUpdater = Arc<dyn Fn(&Key, &NDArray, &mut NDArray) -> Result<()> + Send + Sync>;

fn table() -> &'static Mutex<HashMap<String, SharedUpdater>> {
    static TABLE: OnceLock<Mutex<HashMap<String, SharedUpdater>>> = OnceLock::new();
    TABLE.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Registers an updater under `name`. Call it in every process of the job (before `create`),
/// then select it from a worker with [`crate::KVStore::set_server_updater`]. On a sliced big
/// tensor each server's call sees its own 1-D slice.
///
/// ```
/// kvstore::register_updater("double_add", |_key, input, stored| stored.axpy(2.0, input));
/// let mut kv = kvstore::create("local").unwrap();
/// kv.set_server_updater("double_add").unwrap();
/// ```
pub fn register_updater<F>(name: &str, f: F)
where
    F: Fn(&Key, &NDArray, &mut NDArray) -> Result<()> + Send + Sync + 'static,
{
    let mut t = table().lock().unwrap_or_else(|p| p.into_inner());
    t.insert(name.to_string(), Arc::new(f));
}

/// Makes an updater from the bytes a worker shipped.
pub type UpdaterFactory = Arc<dyn Fn(&[u8]) -> Result<SharedUpdater> + Send + Sync>;

fn factories() -> &'static Mutex<HashMap<String, UpdaterFactory>> {
    static TABLE: OnceLock<Mutex<HashMap<String, UpdaterFactory>>> = OnceLock::new();
    TABLE.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Registers a maker of updaters shipped by value: [`crate::KVStore::set_server_updater`] with
/// the name `"{scheme}:{hex}"` makes the updater from the bytes that `hex` spells (two hex
/// digits a byte), on the worker first (so that bad bytes fail there) and then on every
/// server. Register it in every process before `create`, as [`register_updater`]. The Python
/// package ships its updaters (pickled functions) this way.
pub fn register_updater_factory<F>(scheme: &str, f: F)
where
    F: Fn(&[u8]) -> Result<SharedUpdater> + Send + Sync + 'static,
{
    let mut t = factories().lock().unwrap_or_else(|p| p.into_inner());
    t.insert(scheme.to_string(), Arc::new(f));
}

/// The updater registered under `name`, or made by the factory its scheme names.
pub fn lookup(name: &str) -> Result<SharedUpdater> {
    if let Some((scheme, hex)) = name.split_once(':') {
        let f = factories()
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(scheme)
            .cloned();
        if let Some(f) = f {
            let bytes = unhex(hex).ok_or_else(|| {
                KvError::Unsupported(format!(
                    "an updater of scheme {scheme:?} with bad hex digits"
                ))
            })?;
            return f(&bytes);
        }
    }
    let t = table().lock().unwrap_or_else(|p| p.into_inner());
    t.get(name).cloned().ok_or_else(|| {
        let mut known: Vec<&String> = t.keys().collect();
        known.sort();
        KvError::Unsupported(format!(
            "no updater registered as {name:?} (registered: {known:?})"
        ))
    })
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if s.len() % 2 != 0 {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn factories_make_updaters_from_hex_bytes() {
        register_updater_factory("scale-test", |b: &[u8]| {
            let k = f64::from(
                *b.first()
                    .ok_or_else(|| KvError::Unsupported("empty".into()))?,
            );
            Ok(
                Arc::new(move |_: &Key, i: &NDArray, s: &mut NDArray| s.axpy(k, i))
                    as SharedUpdater,
            )
        });
        let u = lookup("scale-test:03").unwrap();
        let mut s = NDArray::zeros(&[2]);
        u(&Key::Int(0), &NDArray::ones(&[2]), &mut s).unwrap();
        assert_eq!(s.to_vec::<f32>().unwrap(), [3.0, 3.0]);
        assert!(lookup("scale-test:0").is_err());
        assert!(lookup("scale-test:zz").is_err());
        assert!(lookup("scale-test:").is_err());
        assert!(lookup("no-such-scheme:00").is_err());
    }
}
