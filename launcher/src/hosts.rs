//! Hosts and placement: `-H host[:slots],...`, hostfiles in mpirun's format, and where each
//! process of the job goes.

use std::fmt;

use crate::child::RoleName;

/// A host and how many processes it takes before it is full.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Host {
    /// Name or address, as ssh takes it.
    pub name: String,
    /// Slots (processes) it offers.
    pub slots: usize,
}

/// How processes are spread over hosts, as mpirun's `--map-by`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum MapBy {
    /// Fill each host's slots before the next host (mpirun's default).
    Slot,
    /// One process per host in turn.
    Node,
}

impl fmt::Display for MapBy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            MapBy::Slot => "slot",
            MapBy::Node => "node",
        })
    }
}

/// The most slots a host takes, and the most processes a job has: more is a typo, and
/// would be asked of memory before anything else is checked.
pub const MAX_SLOTS: usize = 1 << 16;

/// Parses `-H`'s list: `a,b:4,c` (one slot unless given).
pub fn parse_host_list(list: &str) -> Result<Vec<Host>, String> {
    let mut hosts = Vec::new();
    for item in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let (name, slots) =
            host_and_slots(item).ok_or_else(|| format!("-H {item}: slots must be a number"))?;
        check_name(name).map_err(|e| format!("-H {item}: {e}"))?;
        let slots = slots.unwrap_or(1);
        if slots == 0 || slots > MAX_SLOTS {
            return Err(format!(
                "-H {item}: a host needs at least one slot, and takes at most {MAX_SLOTS}"
            ));
        }
        add_host(&mut hosts, name, slots);
    }
    if hosts.is_empty() {
        return Err("-H: no hosts given".into());
    }
    Ok(hosts)
}

/// `host`, `host:slots`, `[v6]` or `[v6]:slots` (a bare IPv6 address, of several colons, is a
/// host): the host and its slots if given; `None` where the slots are not a number.
fn host_and_slots(item: &str) -> Option<(&str, Option<usize>)> {
    if let Some(rest) = item.strip_prefix('[') {
        let (name, after) = rest.split_once(']')?;
        return match after {
            "" => Some((name, None)),
            a => Some((name, Some(a.strip_prefix(':')?.parse().ok()?))),
        };
    }
    match item.split_once(':') {
        Some((name, slots)) if !slots.contains(':') => Some((name, Some(slots.parse().ok()?))),
        _ => Some((item, None)),
    }
}

/// Refuses a host name that ssh would read as an option (or as nothing).
fn check_name(name: &str) -> Result<(), String> {
    match name.chars().next() {
        None => Err("a host needs a name".into()),
        Some('-') => Err(format!(
            "{name:?} is not a host name (ssh would read it as an option)"
        )),
        Some(_) => Ok(()),
    }
}

/// The host part of `user@host`, as ssh takes it (the name itself where no user is given).
pub fn without_user(name: &str) -> &str {
    name.rsplit_once('@').map_or(name, |(_, h)| h)
}

/// Adds `slots` on `name`: a host named again gets them added to its own, as Open MPI sums a
/// host's repeated lines.
fn add_host(hosts: &mut Vec<Host>, name: &str, slots: usize) {
    match hosts.iter_mut().find(|h| h.name == name) {
        Some(h) => h.slots = h.slots.saturating_add(slots).min(MAX_SLOTS),
        None => hosts.push(Host {
            name: name.to_string(),
            slots,
        }),
    }
}

/// Parses a hostfile: `host [slots=N] [max_slots=M]` (Open MPI's) or `host:N` (MPICH's) per
/// line, `#` comments; a host named on several lines has their slots.
pub fn parse_hostfile(text: &str) -> Result<Vec<Host>, String> {
    let mut hosts = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let mut words = line.split_whitespace();
        let first = words.next().unwrap_or_default();
        // MPICH's and Intel MPI's form, `host:slots`, as well as Open MPI's `slots=`.
        let (name, given) = host_and_slots(first)
            .ok_or_else(|| format!("hostfile line {}: cannot read {first:?}", n + 1))?;
        check_name(name).map_err(|e| format!("hostfile line {}: {e}", n + 1))?;
        let mut slots = given.unwrap_or(1);
        if slots == 0 || slots > MAX_SLOTS {
            return Err(format!("hostfile line {}: bad slots in {first:?}", n + 1));
        }
        for w in words {
            match w.split_once('=') {
                Some(("slots", v)) => {
                    slots = v
                        .parse()
                        .ok()
                        .filter(|&s: &usize| s > 0 && s <= MAX_SLOTS)
                        .ok_or_else(|| format!("hostfile line {}: bad slots {v:?}", n + 1))?
                }
                Some(("max_slots" | "max-slots", _)) => {}
                _ => return Err(format!("hostfile line {}: cannot read {w:?}", n + 1)),
            }
        }
        add_host(&mut hosts, name, slots);
    }
    if hosts.is_empty() {
        return Err("the hostfile names no hosts".into());
    }
    Ok(hosts)
}

/// Where each of the job's processes (servers first, then workers) runs: indices into `hosts`.
pub fn place(
    hosts: &[Host],
    servers: usize,
    workers: usize,
    map_by: MapBy,
    oversubscribe: bool,
) -> Result<Vec<(RoleName, usize)>, String> {
    if servers.saturating_add(workers) > MAX_SLOTS {
        return Err(format!(
            "{servers} servers and {workers} workers: a job has at most {MAX_SLOTS} processes"
        ));
    }
    let roles: Vec<RoleName> = (0..servers)
        .map(RoleName::Server)
        .chain((0..workers).map(RoleName::Worker))
        .collect();
    let total = hosts.iter().fold(0usize, |t, h| t.saturating_add(h.slots));
    if roles.len() > total && !oversubscribe {
        return Err(format!(
            "{} processes ({servers} servers, {workers} workers) but only {total} slots; \
             add hosts or slots, or pass --oversubscribe",
            roles.len()
        ));
    }
    // The first slots in order, as many as there are processes (more would never be used).
    let want = roles.len().min(total);
    let mut order = Vec::with_capacity(want);
    match map_by {
        MapBy::Slot => {
            for (i, h) in hosts.iter().enumerate() {
                order.extend(std::iter::repeat_n(i, h.slots.min(want - order.len())));
            }
        }
        MapBy::Node => {
            let max = hosts.iter().map(|h| h.slots).max().unwrap_or(0);
            'rounds: for round in 0..max {
                for (i, h) in hosts.iter().enumerate() {
                    if order.len() == want {
                        break 'rounds;
                    }
                    if round < h.slots {
                        order.push(i);
                    }
                }
            }
        }
    }
    Ok(roles
        .into_iter()
        .enumerate()
        .map(|(n, r)| (r, order[n % order.len()]))
        .collect())
}

/// Whether `name` is this machine (then no ssh is needed).
pub fn is_local(name: &str) -> bool {
    if matches!(name, "localhost" | "127.0.0.1" | "::1") || name.starts_with("127.") {
        return true;
    }
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim() == name)
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_ssh_would_take_as_an_option_is_refused_and_a_user_is_not_the_host() {
        let e = parse_host_list("a,-oProxyCommand=x:2").unwrap_err();
        assert!(e.contains("ssh would read it as an option"), "{e}");
        let e = parse_hostfile("a\n-oProxyCommand=x slots=2\n").unwrap_err();
        assert!(e.starts_with("hostfile line 2:"), "{e}");
        assert!(parse_host_list(":2").is_err());
        assert_eq!(without_user("alice@node1"), "node1");
        assert_eq!(without_user("node1"), "node1");
        assert_eq!(
            parse_host_list("alice@node1:2").unwrap()[0].name,
            "alice@node1"
        );
    }

    #[test]
    fn host_lists_and_hostfiles() {
        let h = parse_host_list("a,b:3, c").unwrap();
        assert_eq!(
            h[1],
            Host {
                name: "b".into(),
                slots: 3
            }
        );
        assert_eq!(h[2].slots, 1);
        assert!(parse_host_list("a:0").is_err());
        assert!(parse_host_list("").is_err());
        let f = parse_hostfile(
            "# cluster\nnode1 slots=2\nnode2   slots=4 max_slots=8 # big\n\nnode3\n",
        )
        .unwrap();
        assert_eq!(f.iter().map(|h| h.slots).collect::<Vec<_>>(), vec![2, 4, 1]);
        assert!(parse_hostfile("n1 slots=x").is_err());
        assert!(parse_hostfile("n1 colour=red").is_err());
        assert!(parse_hostfile("# nothing").is_err());
        // MPICH's `host:slots`, and a host on several lines (its slots summed, as Open MPI's).
        let f = parse_hostfile("node1:4\nnode2\nnode1 slots=2\n").unwrap();
        let got: Vec<(&str, usize)> = f.iter().map(|h| (h.name.as_str(), h.slots)).collect();
        assert_eq!(got, [("node1", 6), ("node2", 1)]);
        assert!(parse_hostfile("node1:x").is_err());
        assert!(parse_hostfile("node1:0").is_err());
        // IPv6 addresses, bracketed with or without slots, or bare.
        let v6: Vec<(String, usize)> = parse_host_list("[::1],[fe80::2]:3,::5")
            .unwrap()
            .into_iter()
            .map(|h| (h.name, h.slots))
            .collect();
        assert_eq!(
            v6,
            [("::1".into(), 1), ("fe80::2".into(), 3), ("::5".into(), 1)]
        );
        assert!(parse_host_list("[::1]:x").is_err());
    }

    #[test]
    fn placement_by_slot_and_by_node() {
        let hosts = parse_host_list("a:2,b:2").unwrap();
        let p = place(&hosts, 1, 3, MapBy::Slot, false).unwrap();
        assert_eq!(p.iter().map(|x| x.1).collect::<Vec<_>>(), vec![0, 0, 1, 1]);
        assert_eq!(p[0].0, RoleName::Server(0));
        let p = place(&hosts, 1, 3, MapBy::Node, false).unwrap();
        assert_eq!(p.iter().map(|x| x.1).collect::<Vec<_>>(), vec![0, 1, 0, 1]);
        assert!(place(&hosts, 2, 3, MapBy::Slot, false).is_err());
        let p = place(&hosts, 2, 3, MapBy::Slot, true).unwrap();
        assert_eq!(p.len(), 5);
        assert_eq!(p[4].1, 0, "oversubscription wraps around");
    }

    #[test]
    fn counts_past_any_machine_are_refused_before_memory_is_asked_for() {
        assert!(parse_host_list("a:65537").is_err());
        assert!(parse_host_list("a:18446744073709551615").is_err());
        assert!(parse_hostfile("n1 slots=1000000000000").is_err());
        let many = parse_host_list("a:65536,b:65536,c:65536").unwrap();
        assert!(place(&many, 1, usize::MAX, MapBy::Slot, true).is_err());
        assert!(place(&many, 40_000, 40_000, MapBy::Slot, false).is_err());
        // Only as many slots as there are processes are laid out.
        let p = place(&many, 2, 3, MapBy::Node, false).unwrap();
        assert_eq!(
            p.iter().map(|x| x.1).collect::<Vec<_>>(),
            vec![0, 1, 2, 0, 1]
        );
        let p = place(&many, 2, 3, MapBy::Slot, false).unwrap();
        assert_eq!(p.iter().map(|x| x.1).collect::<Vec<_>>(), vec![0; 5]);
    }

    #[test]
    fn local_names() {
        assert!(is_local("localhost"));
        assert!(is_local("127.0.0.5"));
        assert!(!is_local("10.1.2.3"));
    }
}
