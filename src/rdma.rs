//! RDMA verbs for the store (feature `rdma`): the device a process opens from its `Config`, the
//! address a server listens on, and a worker's connection to one server. [`crate::net::Net`]
//! drives the backend as it drives the others; this is the only other module that names it.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use kvstore_transport::{PeerId, RdmaBackend, RdmaConfig};

use crate::config::Config;

/// The backend's settings from the job's variables (`KVSTORE_RDMA_*`).
fn settings(cfg: &Config) -> RdmaConfig {
    let d = RdmaConfig::default();
    let s = &cfg.rdma;
    RdmaConfig {
        device: s.device.clone(),
        port: s.port.unwrap_or(d.port),
        gid_index: s.gid_index,
        service_level: s.service_level,
        traffic_class: s.traffic_class,
        // Under emulation (soft-RoCE in a VM) a handshake can take seconds.
        handshake_timeout: cfg.timeout.min(Duration::from_secs(30)),
        ..d
    }
}

/// Opens the RDMA device the job's variables name (or the first with an active port), or says
/// why there is none: no device, no driver, the port down, the locked-memory limit.
pub(crate) fn open(cfg: &Config) -> Result<RdmaBackend, String> {
    RdmaBackend::new(settings(cfg)).map_err(|e| e.to_string())
}

/// A server's RDMA listener: on `ip` (the address it advertises) where the device answers
/// there, else on the device's first address, so that the queue pairs take the device's path.
/// Returns the address workers connect to.
pub(crate) fn listen(b: &mut RdmaBackend, ip: IpAddr) -> Result<SocketAddr, String> {
    let addrs = b.addresses();
    let at = if addrs.contains(&ip) || addrs.is_empty() {
        ip
    } else {
        addrs[0]
    };
    b.listen(SocketAddr::new(at, 0))
        .map_err(|e| format!("cannot listen for RDMA on {at}: {e}"))
}

/// Connects to a server's RDMA listener; an error says why this pair cannot use RDMA.
pub(crate) fn connect(
    b: &mut RdmaBackend,
    server: SocketAddr,
    timeout: Duration,
) -> Result<PeerId, String> {
    b.connect(server, timeout)
        .map_err(|e| format!("no RDMA path to {server} from {}: {e}", b.device()))
}
