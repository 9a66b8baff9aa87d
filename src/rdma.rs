//! RDMA verbs for the store: the device a process opens from its `Config`, the address a
//! server listens on, and a worker's connections. With the `rdma` feature this is the only
//! module besides [`crate::net`] that names the backend; without it, no peer is reached over
//! RDMA (`KVSTORE_TRANSPORT=rdma` is refused when the configuration is read).

#[cfg(feature = "rdma")]
pub(crate) use verbs::*;
#[cfg(not(feature = "rdma"))]
pub(crate) use without::*;

#[cfg(feature = "rdma")]
mod verbs {
    use std::net::{IpAddr, SocketAddr};
    use std::time::Duration;

    use kvstore_transport::{PeerId, RdmaBackend, RdmaConfig};

    use crate::config::{Config, TransportChoice};
    use crate::net::{Addr, Medium, Net};
    use crate::{KvError, Result};

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
            write_imm: s.write_imm.unwrap_or(d.write_imm),
            max_message: cfg.max_message,
            // Under emulation (soft-RoCE in a VM) a handshake can take seconds.
            handshake_timeout: cfg.timeout.min(Duration::from_secs(30)),
            ..d
        }
    }

    /// Opens the RDMA device the job's variables name (or the first one listed, whose port must
    /// be active), or says why there is none: no device, no driver, the port down, the
    /// locked-memory limit.
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

    /// A worker's RDMA device while it connects, where the `rdma` feature is built.
    pub(crate) struct Connector(
        Option<std::result::Result<kvstore_transport::RdmaBackend, String>>,
    );

    impl Connector {
        /// Opens the device if some server may be reached over RDMA (a server on another host
        /// that listens for RDMA, or every server when RDMA is forced).
        pub(crate) fn open(
            cfg: &Config,
            roster: &crate::roles::Roster,
            local: &[bool],
        ) -> Connector {
            let forced = cfg.transport == TransportChoice::Rdma;
            let wanted = forced
                || (cfg.transport == TransportChoice::Auto
                    && (0..local.len()).any(|i| !local[i] && roster.server_rdma[i].is_some()));
            // A server's link reaches nothing of this worker's until it proved the secret.
            Connector(wanted.then(|| {
                open(cfg).map(|mut b| {
                    b.set_connected_untrusted();
                    b
                })
            }))
        }

        /// Connects to server `i` over RDMA within `timeout`: `Ok(None)` where RDMA is not
        /// wanted, an error with the reason where it was and cannot be had.
        pub(crate) fn connect(
            &mut self,
            roster: &crate::roles::Roster,
            i: usize,
            timeout: Duration,
        ) -> std::result::Result<Option<kvstore_transport::PeerId>, String> {
            let Some(dev) = &mut self.0 else {
                return Ok(None);
            };
            let b = dev
                .as_mut()
                .map_err(|e| format!("this worker has no RDMA device ({e})"))?;
            let Some(at) = roster.server_rdma[i] else {
                return Err("the server has no active RDMA device (its log says why)".into());
            };
            connect(b, at, timeout).map(Some)
        }

        /// Gives the device to `net` if some link uses it; returns its name.
        pub(crate) fn finish(self, net: &mut Net, links: &[Addr]) -> Option<String> {
            let b = self.0?.ok()?;
            if !links.iter().any(|a| a.medium == Medium::Rdma) {
                return None;
            }
            let name = b.device().to_string();
            net.rdma = Some(Box::new(b));
            Some(name)
        }
    }

    /// Opens the RDMA device and listens on it for workers on other hosts (or for all workers,
    /// when `KVSTORE_TRANSPORT=rdma`); returns the address the workers are told. A host without a
    /// device says so, once, and its workers use TCP; when RDMA is forced that is an error.
    /// A worker's link may bring `accepted_max` bytes of data in a message, and has no access
    /// to this process's memory, until it is trusted.
    pub(crate) fn listen_for_workers(
        cfg: &Config,
        net: &mut Net,
        ip: std::net::IpAddr,
        accepted_max: u64,
    ) -> Result<Option<SocketAddr>> {
        if !matches!(cfg.transport, TransportChoice::Auto | TransportChoice::Rdma) {
            return Ok(None);
        }
        let opened = open(cfg).and_then(|mut b| {
            b.set_accepted_max_payload(accepted_max);
            let at = listen(&mut b, ip)?;
            Ok((b, at))
        });
        match opened {
            Ok((b, at)) => {
                tracing::info!("RDMA on {} at {at}", b.device());
                net.rdma = Some(Box::new(b));
                Ok(Some(at))
            }
            Err(why) if cfg.transport == TransportChoice::Rdma => Err(KvError::Config(format!(
                "KVSTORE_TRANSPORT=rdma, but this server has no RDMA: {why}"
            ))),
            Err(why) => {
                tracing::info!("no RDMA ({why}); workers on other hosts use TCP");
                Ok(None)
            }
        }
    }
}

#[cfg(not(feature = "rdma"))]
mod without {
    use std::net::SocketAddr;

    use crate::config::Config;
    use crate::net::{Addr, Net};
    use crate::Result;

    /// A build without RDMA: no server is reached over it (`KVSTORE_TRANSPORT=rdma` is refused
    /// when the configuration is read).
    pub(crate) struct Connector;

    impl Connector {
        pub(crate) fn open(_: &Config, _: &crate::roles::Roster, _: &[bool]) -> Connector {
            Connector
        }

        pub(crate) fn connect(
            &mut self,
            _: &crate::roles::Roster,
            _: usize,
            _: std::time::Duration,
        ) -> std::result::Result<Option<kvstore_transport::PeerId>, String> {
            Ok(None)
        }

        pub(crate) fn finish(self, _: &mut Net, _: &[Addr]) -> Option<String> {
            None
        }
    }

    /// A build without RDMA listens for none.
    pub(crate) fn listen_for_workers(
        _: &Config,
        _: &mut Net,
        _: std::net::IpAddr,
        _: u64,
    ) -> Result<Option<SocketAddr>> {
        Ok(None)
    }
}
