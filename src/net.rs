//! The transports of one process of a job, as the worker's and the server's loops use them:
//! TCP always, shared memory with the processes on this host, RDMA verbs with those on other
//! hosts where both ends have a device (feature `rdma`, opened in `crate::rdma`). This module
//! and that one are the only ones of the store that name a backend type; the loops above drive
//! [`Backend`]s through them, and the state machines below them see neither.
//!
//! A message of the store is a body (the 112 bytes of [`crate::protocol::Msg`], then a grant or
//! short text) with, for tensor data, a range of registered memory. A pull's answer is a put of
//! the stored value into the range the request granted, followed by the reply message.

use std::os::fd::{AsFd, BorrowedFd};
use std::time::{Duration, Instant};

use kvstore_transport::{
    Backend, Completion, PeerId, Region, ShmBackend, ShmConfig, TcpBackend, TransportError,
};

use crate::{KvError, NDArray, Result};

/// Which backend of a [`Net`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Medium {
    Tcp,
    Shm,
    Rdma,
}

impl Medium {
    /// The transport's name, as `KVStore::transports` gives it.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Medium::Tcp => "tcp",
            Medium::Shm => "shm",
            Medium::Rdma => "rdma",
        }
    }
}

/// A peer: the backend that reaches it, and its number there.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Addr {
    pub(crate) medium: Medium,
    pub(crate) peer: PeerId,
}

/// The bits of [`Addr::id`] that say shared memory and RDMA.
const SHM_BIT: usize = 1 << 32;
const RDMA_BIT: usize = 1 << 33;

impl Addr {
    /// A number for the state machines, unique across the backends.
    pub(crate) fn id(self) -> usize {
        let m = match self.medium {
            Medium::Tcp => 0,
            Medium::Shm => SHM_BIT,
            Medium::Rdma => RDMA_BIT,
        };
        m | self.peer.0 as usize
    }

    /// The peer that [`Addr::id`] numbered.
    pub(crate) fn from_id(id: usize) -> Addr {
        let medium = if id & SHM_BIT != 0 {
            Medium::Shm
        } else if id & RDMA_BIT != 0 {
            Medium::Rdma
        } else {
            Medium::Tcp
        };
        Addr {
            medium,
            peer: PeerId(id as u32),
        }
    }
}

/// How long a wait keeps polling its peers after the last thing it saw, before it sleeps: a
/// reply usually comes sooner than a sleep and a wake-up take.
const SPIN: Duration = Duration::from_micros(200);

/// The backends of one process.
pub(crate) struct Net {
    pub(crate) tcp: TcpBackend,
    pub(crate) shm: Option<ShmBackend>,
    /// RDMA verbs, where the `rdma` feature is built and a device is active (`crate::rdma`).
    pub(crate) rdma: Option<Box<dyn Backend>>,
    /// When the last completion came, for the spin before sleeping.
    last_active: Instant,
    /// A completion came since the spin last looked at the time (the clock is read then, not
    /// at each completion; on a crowded host, at the first turn after it).
    fresh: bool,
    /// More of the job's processes on this host than cores: a spin yields the core.
    crowded: bool,
    /// Progress calls, and when TCP was last polled: with no TCP peer, a busy loop looks at
    /// the TCP listener only now and then (each look is a system call).
    calls: u32,
    last_tcp: Instant,
    /// Turns of a spin since the last completion: the clock is read on few of them.
    spins: u32,
    /// After a sleep: which backends' descriptors were readable (TCP, shared memory, RDMA).
    /// Having armed, the others have no work, and the next progress does not look at them.
    woke: Option<[bool; 3]>,
    /// Whether the last [`Net::wait`] slept in `poll` (rather than spun).
    pub(crate) slept: bool,
}

/// How often a busy loop with no TCP peer polls the TCP backend.
const TCP_IDLE_POLL: Duration = Duration::from_micros(200);

/// What makes two processes "on the same host" for shared memory: the same boot of the same
/// kernel and the same network namespace.
pub(crate) fn host_id() -> String {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let net = std::fs::read_link("/proc/self/ns/net")
        .map(|p| p.display().to_string())
        .unwrap_or_default();
    format!("{}/{}", boot.trim(), net.replace(['[', ']', ':'], ""))
}

/// A name for a server's shared-memory listener (abstract, per network namespace): random,
/// drawn before the server registers and passed to the workers in the roster, so that it says
/// nothing of the job's secret and no one can take it first.
pub(crate) fn shm_name() -> std::io::Result<String> {
    Ok(crate::auth::hex(&crate::auth::random::<16>()?))
}

/// An array's memory as a region of `b`: the array's own region if `b` allocated it (pool pages
/// go by reference), else its storage registered with `b` (the region holds it alive).
pub(crate) fn region_of(
    b: &mut dyn Backend,
    a: &NDArray,
) -> std::result::Result<Region, TransportError> {
    match a.region().filter(|r| r.backend_id() == b.id()) {
        Some(r) => Ok(r.clone()),
        None => b.register(a.storage()),
    }
}

/// `len` bytes of memory registered with `b` for `access`: the medium's own (pool or landing
/// pages) where it has room, else zeroed private memory registered with it.
pub(crate) fn alloc(
    b: &mut dyn Backend,
    len: usize,
    access: kvstore_transport::Access,
) -> std::result::Result<Region, TransportError> {
    match b.alloc(len, access) {
        Ok(r) => Ok(r),
        Err(_) => b.register(kvstore_transport::Mem::zeroed_or_refused(len)?),
    }
}

/// The cores this process may run on (read once: the query reads cgroup files).
pub(crate) fn cores() -> usize {
    static CORES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

fn transport(e: kvstore_transport::TransportError) -> KvError {
    KvError::Transport(e)
}

impl Net {
    /// TCP, refusing frames over `max_message` bytes; and, when `shm` is set, shared memory
    /// with a send pool of `send_bytes` and a landing pool of `landing_bytes` (address space,
    /// backed only where touched).
    pub(crate) fn new(
        max_message: u64,
        shm: bool,
        send_bytes: usize,
        landing_bytes: usize,
    ) -> Result<Net> {
        let tcp = TcpBackend::new(max_message).map_err(transport)?;
        let shm = if shm {
            let cfg = ShmConfig::default();
            let pages = |bytes: usize| bytes.div_ceil(cfg.page_size).max(16);
            Some(
                ShmBackend::new(
                    &format!("kvstore-{}", std::process::id()),
                    ShmConfig {
                        pages: pages(send_bytes),
                        landing_pages: pages(landing_bytes),
                        ..cfg
                    },
                )
                .map_err(transport)?,
            )
        } else {
            None
        };
        Ok(Net {
            tcp,
            shm,
            rdma: None,
            last_active: Instant::now(),
            fresh: false,
            crowded: false,
            calls: 0,
            last_tcp: Instant::now(),
            spins: 0,
            woke: None,
            slept: false,
        })
    }

    /// Says how many of the job's processes share this host, so that spinning yields the core
    /// when they outnumber the cores.
    pub(crate) fn set_local_processes(&mut self, n: usize) {
        self.crowded = n > cores();
    }

    /// The backend of `m`.
    pub(crate) fn backend(&mut self, m: Medium) -> Result<&mut dyn Backend> {
        match m {
            Medium::Tcp => Ok(&mut self.tcp),
            Medium::Shm => match &mut self.shm {
                Some(s) => Ok(s),
                None => Err(KvError::Protocol("no shared-memory backend".into())),
            },
            Medium::Rdma => match &mut self.rdma {
                Some(r) => Ok(r.as_mut()),
                None => Err(KvError::Protocol("no RDMA backend".into())),
            },
        }
    }

    /// Does what every backend can do without blocking; `on` sees each completion with the
    /// backend it came from. Returns how many completions there were.
    pub(crate) fn progress(&mut self, on: &mut dyn FnMut(Medium, Completion<'_>)) -> Result<usize> {
        self.calls = self.calls.wrapping_add(1);
        let woke = self.woke.take();
        let poll_tcp = match woke {
            Some([tcp, _, _]) => tcp,
            None => {
                !self.tcp.is_idle()
                    || self.shm.is_none()
                    || (self.calls % 32 == 0 && self.last_tcp.elapsed() >= TCP_IDLE_POLL)
            }
        };
        let poll_shm = woke.is_none_or(|[_, shm, _]| shm);
        let poll_rdma = woke.is_none_or(|[_, _, rdma]| rdma);
        let mut n = 0;
        if poll_tcp {
            self.last_tcp = Instant::now();
            n += self
                .tcp
                .progress(&mut |c| on(Medium::Tcp, c))
                .map_err(transport)?;
        }
        if let (Some(s), true) = (&mut self.shm, poll_shm) {
            n += s.progress(&mut |c| on(Medium::Shm, c)).map_err(transport)?;
        }
        if let (Some(r), true) = (&mut self.rdma, poll_rdma) {
            n += r
                .progress(&mut |c| on(Medium::Rdma, c))
                .map_err(transport)?;
        }
        if n > 0 {
            self.spins = 0;
            self.fresh = true;
        }
        Ok(n)
    }

    /// Something happened at `t` (a call started): a wait spins for a while after it.
    pub(crate) fn active_at(&mut self, t: Instant) {
        self.last_active = t;
        self.fresh = false;
    }

    /// Whether the last completion came less than [`SPIN`] ago (one that came since the last
    /// look counts as now: it came within the last 64 turns).
    fn spun_briefly(&mut self) -> bool {
        if std::mem::take(&mut self.fresh) {
            self.last_active = Instant::now();
            return true;
        }
        self.last_active.elapsed() < SPIN
    }

    /// Pushes out what was posted.
    pub(crate) fn flush(&mut self) -> Result<()> {
        self.tcp.flush().map_err(transport)?;
        if let Some(s) = &mut self.shm {
            s.flush().map_err(transport)?;
        }
        if let Some(r) = &mut self.rdma {
            r.flush().map_err(transport)?;
        }
        Ok(())
    }

    /// Waits for work, at most `timeout`: with shared-memory peers it first spins a while after
    /// the last completion (yielding the core on a crowded host); then it arms every backend and
    /// sleeps on their descriptors and on `extra` (the scheduler's socket), unless one of them
    /// says work is already pending.
    /// Returns whether `extra` is readable.
    pub(crate) fn wait(
        &mut self,
        extra: Option<BorrowedFd<'_>>,
        timeout: Duration,
    ) -> Result<bool> {
        self.flush()?;
        self.slept = false;
        self.spins = self.spins.wrapping_add(1);
        if self.crowded && self.spins == 1 && std::mem::take(&mut self.fresh) {
            // Each turn of a crowded host's spin may give the core away for long: the time
            // of the last completion is read now, not 64 turns later.
            self.last_active = Instant::now();
        }
        // Rings are read without a system call; a TCP peer is polled (one `epoll_wait` a
        // turn), which still answers sooner than a sleep and a wake-up.
        let peers = self.shm.as_ref().is_some_and(|s| s.has_peers())
            || self.tcp.has_peers()
            || self.rdma.is_some();
        if peers && (self.spins % 64 != 0 || self.spun_briefly()) {
            if self.crowded {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
            return Ok(false);
        }
        if self.shm.is_none() && self.rdma.is_none() && extra.is_none() {
            self.tcp.sleep(timeout).map_err(transport)?;
            return Ok(false);
        }
        if !self.tcp.arm().map_err(transport)? {
            return Ok(false);
        }
        if let Some(s) = &mut self.shm {
            if !s.arm().map_err(transport)? {
                return Ok(false);
            }
        }
        if let Some(r) = &mut self.rdma {
            if !r.arm().map_err(transport)? {
                return Ok(false);
            }
        }
        use rustix::event::{poll, PollFd, PollFlags, Timespec};
        let mut fds = vec![PollFd::from_borrowed_fd(self.tcp.as_fd(), PollFlags::IN)];
        if let Some(s) = &self.shm {
            fds.push(PollFd::from_borrowed_fd(s.as_fd(), PollFlags::IN));
        }
        if let Some(r) = &self.rdma {
            fds.push(PollFd::from_borrowed_fd(r.fd(), PollFlags::IN));
        }
        if let Some(e) = extra {
            fds.push(PollFd::from_borrowed_fd(e, PollFlags::IN));
        }
        self.slept = true;
        let ts = Timespec {
            tv_sec: timeout.as_secs() as i64,
            tv_nsec: timeout.subsec_nanos() as i64,
        };
        match poll(&mut fds, Some(&ts)) {
            Ok(_) => {
                let ready = |i: usize| fds.get(i).is_some_and(|f| !f.revents().is_empty());
                let has_shm = self.shm.is_some() as usize;
                let has_rdma = self.rdma.is_some() as usize;
                self.woke = Some([
                    ready(0),
                    has_shm == 1 && ready(1),
                    has_rdma == 1 && ready(1 + has_shm),
                ]);
                Ok(extra.is_some() && ready(1 + has_shm + has_rdma))
            }
            Err(e) if e == rustix::io::Errno::INTR => Ok(extra.is_some()),
            Err(e) => Err(std::io::Error::from(e).into()),
        }
    }
}
