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

/// The updater registered under `name`.
pub fn lookup(name: &str) -> Result<SharedUpdater> {
    let t = table().lock().unwrap_or_else(|p| p.into_inner());
    t.get(name).cloned().ok_or_else(|| {
        let mut known: Vec<&String> = t.keys().collect();
        known.sort();
        KvError::Unsupported(format!(
            "no updater registered as {name:?} (registered: {known:?})"
        ))
    })
}
