//! The store's logs: `tracing` events, written to stderr by a subscriber this process installs
//! once (unless the program installed its own first, which then receives them), filtered by
//! `KVSTORE_LOG`, else `RUST_LOG` (read by [`crate::Config`]), else `info` for kvstore's own
//! modules and warnings for every other crate.
//!
//! Info: each process's role, rank and transports, once, at start. Debug: connections, rounds
//! and calls. A disabled event costs a cached check at its call site; the `no-logs` feature
//! compiles every event out.

use tracing_subscriber::EnvFilter;

/// The filter when neither variable is set.
pub const DEFAULT_FILTER: &str = "warn,kvstore=info,kvstore_transport=info,kvrun=info";

/// Installs the stderr subscriber with `filter` (an `EnvFilter` directive such as `debug` or
/// `kvstore::server=debug`; `None`: [`DEFAULT_FILTER`]), once per process. A filter that does
/// not parse is reported and the default used. Nothing happens if a subscriber is installed.
pub fn init_logging(filter: Option<&str>) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let (f, bad) = match filter.map(EnvFilter::try_new) {
            Some(Ok(f)) => (f, None),
            Some(Err(e)) => (EnvFilter::new(DEFAULT_FILTER), Some(e)),
            None => (EnvFilter::new(DEFAULT_FILTER), None),
        };
        let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
        let installed = tracing_subscriber::fmt()
            .with_env_filter(f)
            .with_writer(std::io::stderr)
            .with_ansi(ansi)
            .try_init()
            .is_ok();
        if let (true, Some(e)) = (installed, bad) {
            tracing::warn!("KVSTORE_LOG/RUST_LOG does not parse ({e}); logging at the default");
        }
    });
}
