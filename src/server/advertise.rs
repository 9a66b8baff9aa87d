//! The address a server tells workers to reach it at: `DMLC_NODE_HOST`, else the address of
//! `DMLC_INTERFACE`, else the one it reaches the scheduler from (as ps-lite chooses).

use std::net::IpAddr;

use crate::config::Config;
use crate::{KvError, Result};

/// The address to advertise; `toward_scheduler` is this host's end of its connection to the
/// scheduler. A loopback address where workers on other hosts would need to reach it is
/// refused, saying what to set.
pub(super) fn address(cfg: &Config, toward_scheduler: IpAddr) -> Result<IpAddr> {
    let (ip, from) = match (&cfg.node_host, &cfg.interface) {
        (Some(h), _) => match h.parse::<IpAddr>() {
            Ok(ip) => (ip, format!("DMLC_NODE_HOST={h:?} is")),
            Err(_) => {
                let ip = host_name(h)?;
                // A name is taken for its address on the network: one that resolves to
                // loopback here is refused unless the whole job is on loopback.
                if ip.is_loopback() && !cfg.root_is_this_host_alone() {
                    return Err(unreachable(&format!("DMLC_NODE_HOST={h:?} is"), ip));
                }
                return Ok(ip);
            }
        },
        (None, Some(i)) => (interface(i)?, format!("DMLC_INTERFACE={i:?} has")),
        (None, None) => {
            // This host's end of its connection to the scheduler: over loopback where it
            // names rank 0's host (its own) by a loopback address.
            let ip = toward_scheduler;
            if ip.is_loopback() && cfg.spans_hosts == Some(true) {
                return Err(KvError::Config(format!(
                    "this server would give workers on other hosts the address {ip}: the \
                     scheduler's host {} is a loopback address here. Set DMLC_NODE_HOST to \
                     this host's address on the job's network, or KVSTORE_ROOT_URI to rank \
                     0's",
                    cfg.root.ip()
                )));
            }
            return Ok(ip);
        }
    };
    // An address or interface named outright is taken, unless the job is known to span hosts
    // and it is a loopback one.
    if ip.is_loopback() && cfg.spans_hosts == Some(true) {
        return Err(unreachable(&from, ip));
    }
    Ok(ip)
}

fn unreachable(from: &str, ip: IpAddr) -> KvError {
    KvError::Config(format!(
        "{from} {ip} here, a loopback address that workers on other hosts cannot reach: name \
         this host's address or interface on the job's network"
    ))
}

/// A host name in `DMLC_NODE_HOST`, as ps-lite takes one: its first address other hosts can
/// reach (a host's own name may resolve to 127.0.1.1 first).
fn host_name(h: &str) -> Result<IpAddr> {
    let ips: Vec<IpAddr> = std::net::ToSocketAddrs::to_socket_addrs(&(h, 0))
        .map(|a| a.map(|a| a.ip()).collect())
        .unwrap_or_default();
    match ips.iter().find(|ip| !ip.is_loopback()).or(ips.first()) {
        Some(ip) => Ok(*ip),
        None => Err(KvError::Config(format!(
            "DMLC_NODE_HOST={h:?} is not an address or host"
        ))),
    }
}

/// `DMLC_INTERFACE`: the interface's IPv4 address, as ps-lite's (the first), else its first
/// IPv6 one that is not link-local (which would need the interface named in every peer's
/// address).
fn interface(name: &str) -> Result<IpAddr> {
    let all = if_addrs::get_if_addrs().map_err(|e| {
        KvError::Config(format!(
            "DMLC_INTERFACE={name:?}: the host's interfaces could not be listed: {e}"
        ))
    })?;
    let ips: Vec<IpAddr> = all
        .iter()
        .filter(|i| i.name == name)
        .map(|i| i.ip())
        .collect();
    let v6_routable = |ip: &&IpAddr| match ip {
        IpAddr::V6(v6) => !v6.is_unicast_link_local(),
        IpAddr::V4(_) => false,
    };
    if let Some(ip) = ips
        .iter()
        .find(|ip| ip.is_ipv4())
        .or(ips.iter().find(v6_routable))
    {
        return Ok(*ip);
    }
    let mut names: Vec<&str> = all.iter().map(|i| i.name.as_str()).collect();
    names.sort_unstable();
    names.dedup();
    Err(KvError::Config(if ips.is_empty() {
        format!(
            "DMLC_INTERFACE={name:?}: no such interface with an address here (this host's: {})",
            names.join(", ")
        )
    } else {
        format!("DMLC_INTERFACE={name:?} has only link-local addresses here")
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A server's configuration with the scheduler at `root` and these variables besides.
    fn cfg(root: &str, vars: &[(&str, &str)]) -> Config {
        let base = [
            ("DMLC_ROLE", "server"),
            ("DMLC_PS_ROOT_URI", root),
            ("DMLC_PS_ROOT_PORT", "9000"),
            ("DMLC_NUM_SERVER", "1"),
            ("DMLC_NUM_WORKER", "1"),
            ("KVSTORE_SECRET", "a-test-secret-of-24-bytes"),
        ];
        let all: Vec<(&str, &str)> = base.iter().chain(vars).copied().collect();
        Config::from_lookup(&|k| {
            all.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        })
        .unwrap()
    }

    #[test]
    fn the_address_is_the_node_hosts_else_the_interfaces_else_the_one_toward_the_scheduler() {
        let toward: IpAddr = "10.1.2.3".parse().unwrap();
        let v4 = IpAddr::from([127, 0, 0, 1]);
        let at = |root, vars: &[(&str, &str)]| address(&cfg(root, vars), toward);
        assert_eq!(at("10.1.2.1", &[]).unwrap(), toward);
        assert_eq!(at("::1", &[("DMLC_INTERFACE", "lo")]).unwrap(), v4);
        let named = [("DMLC_NODE_HOST", "10.9.9.9"), ("DMLC_INTERFACE", "lo")];
        assert_eq!(at("10.1.2.1", &named).unwrap(), IpAddr::from([10, 9, 9, 9]));
        // An interface or address named outright is taken, even a loopback one with the
        // scheduler elsewhere (every process may be on this host)...
        assert_eq!(at("10.1.2.1", &[("DMLC_INTERFACE", "lo")]).unwrap(), v4);
        // ...but not where the launcher says the job spans hosts.
        let mut c = cfg("10.1.2.1", &[("DMLC_INTERFACE", "lo")]);
        c.spans_hosts = Some(true);
        let e = address(&c, toward).unwrap_err().to_string();
        assert!(
            e.contains("DMLC_INTERFACE=\"lo\" has 127.0.0.1 here, a loopback"),
            "{e}"
        );
        // A host name that resolves to loopback here is refused unless the job is.
        let e = at("10.1.2.1", &[("DMLC_NODE_HOST", "localhost")]).unwrap_err();
        assert!(e.to_string().contains("a loopback address"), "{e}");
        assert!(at("127.0.0.1", &[("DMLC_NODE_HOST", "localhost")])
            .unwrap()
            .is_loopback());
        let e = at("10.1.2.1", &[("DMLC_INTERFACE", "nosuch0")]).unwrap_err();
        assert!(e.to_string().contains("no such interface"), "{e}");
    }

    #[test]
    fn an_interface_is_its_ipv4_address_and_an_unknown_one_is_named() {
        assert_eq!(interface("lo").unwrap(), IpAddr::from([127, 0, 0, 1]));
        let e = interface("nosuch0").unwrap_err().to_string();
        assert!(
            e.contains("DMLC_INTERFACE=\"nosuch0\": no such interface"),
            "{e}"
        );
        assert!(e.contains("lo"), "the host's interfaces are listed: {e}");
    }
}
