//! Connection setup for the verbs backend: which device, port and GID, the limits read from
//! the device, the locked-memory check, and the exchange of queue-pair addresses over the TCP
//! connection that then stays open as the pair's liveness link.

use std::io::{Read, Write};
use std::net::{IpAddr, TcpStream};
use std::time::{Duration, Instant};

use super::verbs::{Context, LINK_LAYER_IB};
use crate::TransportError;

/// How a verbs backend chooses its device and paths (the store fills it from its `Config`).
#[derive(Clone, Debug)]
pub struct RdmaConfig {
    /// The device (`rxe0`, `mlx5_0`); the first one if unset.
    pub device: Option<String>,
    /// The port of the device.
    pub port: u8,
    /// A fixed GID index; unset: the RoCE v2 GID of the address the TCP link uses.
    pub gid_index: Option<u32>,
    /// Service level.
    pub service_level: u8,
    /// Traffic class (RoCE: the DSCP and ECN bits).
    pub traffic_class: u8,
    /// Local ACK timeout exponent: 4.096 us × 2^timeout before a retry.
    pub timeout: u8,
    /// Retries of a lost packet before the QP fails (finite: 7 at most).
    pub retry_count: u8,
    /// Retries of a receiver-not-ready NAK (finite: 7 would retry forever, a hang).
    pub rnr_retry: u8,
    /// Receive buffers per peer (each of [`RdmaConfig::buffer`] bytes), the credits a peer
    /// is given.
    pub receives: usize,
    /// Send buffers shared by all peers.
    pub sends: usize,
    /// The size of a buffer: a message body and small data go in one; larger data is read by
    /// the receiver from the sender's memory.
    pub buffer: usize,
    /// Work requests in flight per peer.
    pub send_depth: usize,
    /// The most peers (the completion queue is sized for them).
    pub max_peers: usize,
    /// How long the queue-pair exchange of a new connection may take.
    pub handshake_timeout: Duration,
    /// A put that fills its grant is one RDMA WRITE_WITH_IMM (split at the largest message,
    /// the last piece carrying the immediate), whatever its size: on rxe an 8-byte put took
    /// 18.5 us this way against 20.5 as an eager SEND. `false`: as any other put.
    pub write_imm: bool,
    /// The largest data a message may bring (read from the sender's memory): a larger claim
    /// closes the link before anything is allocated for it.
    pub max_message: u64,
    /// Other puts of at most this many bytes go as one SEND carrying the data, which the
    /// receiver copies into the grant; larger ones are RDMA WRITEs and a notice (0: always
    /// writes).
    pub eager_put: usize,
}

impl Default for RdmaConfig {
    fn default() -> Self {
        RdmaConfig {
            device: None,
            port: 1,
            gid_index: None,
            service_level: 0,
            traffic_class: 0,
            timeout: 14,
            retry_count: 6,
            rnr_retry: 6,
            receives: 32,
            sends: 64,
            buffer: 64 * 1024 + HEAD,
            send_depth: 256,
            max_peers: 64,
            handshake_timeout: Duration::from_secs(5),
            write_imm: true,
            max_message: 8 << 30,
            eager_put: 8192,
        }
    }
}

/// The header every SEND of this backend begins with.
pub(crate) const HEAD: usize = 48;

/// What locked memory `bytes` more would need, and how to allow it: the answer to ENOMEM from
/// `ibv_reg_mr`.
pub(crate) fn memlock_advice(bytes: usize) -> String {
    let (soft, _) = memlock();
    let limit = match soft {
        None => "unlimited".to_string(),
        Some(l) => format!("{} KiB", l / 1024),
    };
    format!(
        "cannot register {bytes} bytes for RDMA: the locked-memory limit (RLIMIT_MEMLOCK) is \
         {limit}. Raise it: `ulimit -l unlimited` in the shell that starts the job, \
         `* - memlock unlimited` in /etc/security/limits.conf, or LimitMEMLOCK=infinity for a \
         systemd service (root's CAP_IPC_LOCK ignores the limit)"
    )
}

/// The soft and hard locked-memory limits (`None`: unlimited).
pub(crate) fn memlock() -> (Option<u64>, Option<u64>) {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: a valid out-pointer.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut r) } != 0 {
        return (None, None);
    }
    let f = |v: libc::rlim_t| (v != libc::RLIM_INFINITY).then_some(v);
    (f(r.rlim_cur), f(r.rlim_max))
}

/// Refuses up front a registration of `bytes` that the locked-memory limit cannot hold (for a
/// process without CAP_IPC_LOCK), with the fix.
pub(crate) fn check_memlock(bytes: usize) -> Result<(), TransportError> {
    if let (Some(soft), _) = memlock() {
        if bytes as u64 > soft && !has_ipc_lock() {
            return Err(TransportError::Rdma(memlock_advice(bytes)));
        }
    }
    Ok(())
}

/// Whether this process may lock memory beyond its limit (CAP_IPC_LOCK, bit 14).
fn has_ipc_lock() -> bool {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        .is_some_and(|caps| caps & (1 << 14) != 0)
}

/// A random 24-bit packet sequence number.
pub(crate) fn random_psn() -> u32 {
    let mut b = [0u8; 4];
    if std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .is_err()
    {
        let t = Instant::now().elapsed().as_nanos() as u64 ^ std::process::id() as u64;
        b = (t as u32).to_le_bytes();
    }
    u32::from_le_bytes(b) & 0x00ff_ffff
}

/// The GID of `port` to use for a link whose TCP connection has the local address `local`:
/// `fixed` if set; else the RoCE v2 entry that maps `local` (IPv4-mapped for IPv4), from the
/// GID table in sysfs. On InfiniBand, GID 0 (paths use LIDs; untested without hardware).
pub(crate) fn choose_gid(
    ctx: &Context,
    port: u8,
    link_layer: u8,
    fixed: Option<u32>,
    local: IpAddr,
) -> Result<(u32, [u8; 16]), TransportError> {
    if let Some(i) = fixed {
        return Ok((i, ctx.query_gid(port, i)?));
    }
    if link_layer == LINK_LAYER_IB {
        return Ok((0, ctx.query_gid(port, 0)?));
    }
    let want = match local {
        IpAddr::V4(a) => a.to_ipv6_mapped().octets(),
        IpAddr::V6(a) => a.octets(),
    };
    let dir = format!("/sys/class/infiniband/{}/ports/{port}", ctx.name);
    let mut seen = Vec::new();
    for i in 0..256u32 {
        let Ok(gid) = ctx.query_gid(port, i) else {
            break;
        };
        if gid == [0; 16] {
            continue;
        }
        let kind =
            std::fs::read_to_string(format!("{dir}/gid_attrs/types/{i}")).unwrap_or_default();
        let v2 = kind.trim().eq_ignore_ascii_case("RoCE v2");
        if v2 && gid == want {
            return Ok((i, gid));
        }
        seen.push(format!(
            "{i}: {} {}",
            std::net::Ipv6Addr::from(gid),
            kind.trim()
        ));
    }
    Err(TransportError::Rdma(format!(
        "no RoCE v2 GID on {} port {port} for the address {local} (the GID table: {}); \
         choose one with KVSTORE_RDMA_GID_INDEX",
        ctx.name,
        if seen.is_empty() {
            "empty".into()
        } else {
            seen.join(", ")
        }
    )))
}

/// The IP addresses of the RoCE v2 GIDs of `port`: where this device can be reached.
pub(crate) fn addresses(ctx: &Context, port: u8) -> Vec<IpAddr> {
    let dir = format!("/sys/class/infiniband/{}/ports/{port}", ctx.name);
    let mut out = Vec::new();
    for i in 0..256u32 {
        let Ok(gid) = ctx.query_gid(port, i) else {
            break;
        };
        let kind =
            std::fs::read_to_string(format!("{dir}/gid_attrs/types/{i}")).unwrap_or_default();
        if gid == [0; 16] || !kind.trim().eq_ignore_ascii_case("RoCE v2") {
            continue;
        }
        let a = std::net::Ipv6Addr::from(gid);
        // Link-local IPv6 needs a scope to be reached: not an address to give out.
        if a.segments()[0] & 0xffc0 == 0xfe80 {
            continue;
        }
        out.push(a.to_ipv4_mapped().map_or(IpAddr::V6(a), IpAddr::V4));
    }
    // IPv4 first.
    out.sort_by_key(|a| a.is_ipv6());
    out
}

/// A queue pair's address, as the two ends exchange it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Hello {
    pub(crate) qpn: u32,
    pub(crate) psn: u32,
    pub(crate) lid: u16,
    pub(crate) mtu: u32,
    pub(crate) gid: [u8; 16],
    /// The receive buffers (credits) the sender may use, and their size.
    pub(crate) receives: u32,
    pub(crate) buffer: u32,
    /// Where the peer writes the count of buffers it posted again, and its key.
    pub(crate) credit_addr: u64,
    pub(crate) credit_key: u32,
}

const MAGIC: &[u8; 8] = b"KVRDMA02";
pub(crate) const HELLO_LEN: usize = 8 + 4 * 6 + 16 + 16;

impl Hello {
    pub(crate) fn encode(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[..8].copy_from_slice(MAGIC);
        let words = [
            self.qpn,
            self.psn,
            self.lid as u32,
            self.mtu,
            self.receives,
            self.buffer,
        ];
        for (i, w) in words.iter().enumerate() {
            b[8 + 4 * i..12 + 4 * i].copy_from_slice(&w.to_le_bytes());
        }
        b[32..48].copy_from_slice(&self.gid);
        b[48..56].copy_from_slice(&self.credit_addr.to_le_bytes());
        b[56..60].copy_from_slice(&self.credit_key.to_le_bytes());
        b
    }

    pub(crate) fn decode(b: &[u8; HELLO_LEN]) -> Result<Hello, TransportError> {
        if &b[..8] != MAGIC {
            return Err(TransportError::Refused(
                "not a kvstore RDMA peer of this version".into(),
            ));
        }
        let w =
            |i: usize| u32::from_le_bytes(b[8 + 4 * i..12 + 4 * i].try_into().unwrap_or_default());
        let h = Hello {
            qpn: w(0) & 0x00ff_ffff,
            psn: w(1) & 0x00ff_ffff,
            lid: w(2) as u16,
            mtu: w(3),
            receives: w(4),
            buffer: w(5),
            gid: b[32..48].try_into().unwrap_or_default(),
            credit_addr: u64::from_le_bytes(b[48..56].try_into().unwrap_or_default()),
            credit_key: w(12),
        };
        if !(1..=5).contains(&h.mtu) || !(1..=4096).contains(&h.receives) || h.buffer < HEAD as u32
        {
            return Err(TransportError::Refused(format!(
                "a malformed RDMA hello {h:?}"
            )));
        }
        Ok(h)
    }
}

/// Writes our hello and reads the peer's on a blocking stream, within `timeout`.
pub(crate) fn exchange(
    s: &mut TcpStream,
    ours: &Hello,
    timeout: Duration,
) -> Result<Hello, TransportError> {
    // One deadline for the whole exchange, not a timeout per read: a peer that trickles its
    // bytes is given up on at the deadline.
    let deadline = std::time::Instant::now() + timeout;
    s.set_write_timeout(Some(timeout))?;
    s.write_all(&ours.encode())?;
    let mut b = [0u8; HELLO_LEN];
    let mut got = 0;
    while got < HELLO_LEN {
        let Some(left) = deadline.checked_duration_since(std::time::Instant::now()) else {
            return Err(TransportError::Timeout(format!(
                "the RDMA peer's address, after {timeout:?} ({got} of {HELLO_LEN} bytes)"
            )));
        };
        s.set_read_timeout(Some(left.max(Duration::from_millis(1))))?;
        match s.read(&mut b[got..]) {
            Ok(0) => return Err(TransportError::Closed),
            Ok(n) => got += n,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock
                        | std::io::ErrorKind::TimedOut
                        | std::io::ErrorKind::Interrupted
                ) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Hello::decode(&b)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A peer that sends its address a byte every 100 ms is given up on at the exchange's
    /// deadline; before, each read had the whole timeout of its own (64 of them).
    #[test]
    fn a_peer_that_trickles_its_address_times_out_at_the_deadline() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let a = l.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            for _ in 0..HELLO_LEN {
                if s.write_all(&[0]).is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        let mut s = TcpStream::connect(a).unwrap();
        let t0 = Instant::now();
        let e = exchange(&mut s, &sample(), Duration::from_millis(500)).unwrap_err();
        assert!(matches!(e, TransportError::Timeout(_)), "{e}");
        assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
        drop(s);
        t.join().unwrap();
    }

    fn sample() -> Hello {
        Hello {
            qpn: 0x12,
            psn: 0xabcdef,
            lid: 3,
            mtu: 3,
            gid: [7; 16],
            receives: 32,
            buffer: 65584,
            credit_addr: 0x7f00_1234_5678,
            credit_key: 99,
        }
    }

    #[test]
    fn a_hello_round_trips_and_garbage_is_refused() {
        let h = sample();
        assert_eq!(Hello::decode(&h.encode()).unwrap(), h);
        let mut b = h.encode();
        b[0] = b'X';
        assert!(Hello::decode(&b).is_err());
        let mut b = h.encode();
        b[20..24].copy_from_slice(&9u32.to_le_bytes()); // mtu 9
        assert!(Hello::decode(&b).is_err());
    }

    #[test]
    fn psns_are_24_bits() {
        for _ in 0..100 {
            assert!(random_psn() < 1 << 24);
        }
    }

    #[test]
    fn the_memlock_advice_names_the_fix() {
        let a = memlock_advice(1 << 30);
        assert!(a.contains("ulimit -l"), "{a}");
        assert!(a.contains("limits.conf"), "{a}");
    }
}
