//! The server process: a thin loop that moves messages between the backends and
//! [`ServerState`], and hears the scheduler.

mod admission;
mod advertise;
mod answers;
mod batch;
mod peer_data;
mod peers;
pub(crate) mod slots;
pub(crate) mod state;

use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use kvstore_transport::tcp::{FrameQueue, FrameReader};
use kvstore_transport::FrameHeader;

use crate::config::Config;
use crate::net::{self, Net};
use crate::protocol::{Msg, Op};
use crate::roles::join;
use crate::server::peers::{Workers, MAX_CONTROL};
use crate::server::state::ServerState;
use crate::{KvError, Result};

/// Address space of a server's send pool, where its stored values live while there is room
/// (beyond it they are ordinary memory, and answers are put into the worker's memory).
const STORE_POOL_BYTES: usize = 64 << 30;

/// Stored values of at least this many bytes live in the send pool.
const STORE_IN_POOL_FROM: usize = 32 * 1024;

/// How often a busy server reads the scheduler's socket.
const SCHED_EVERY: Duration = Duration::from_millis(1);

/// What the scheduler said in `frame`: a shutdown, an abort (with why), or nothing for the
/// server; an error if the frame is not a message.
fn sched_event(frame: &(FrameHeader, Vec<u8>)) -> std::result::Result<Option<Result<()>>, String> {
    let m = Msg::decode(&frame.0.meta).map_err(|e| e.to_string())?;
    Ok(match m.op {
        Op::Shutdown => Some(Ok(())),
        Op::Abort => Some(Err(KvError::Aborted(
            String::from_utf8_lossy(&frame.1).into_owned(),
        ))),
        _ => None,
    })
}

/// Runs a server until the scheduler ends the job. `Ok` on a normal shutdown; an error if the
/// job was aborted or a peer was lost.
pub fn run_server(cfg: &Config, sync: bool) -> Result<()> {
    let mut sched = kvstore_transport::tcp::connect_retry(cfg.root, cfg.timeout)?;
    let ip = advertise::address(cfg, sched.local_addr()?.ip())?;
    // Stored values live in the send pool, which workers on this host read answers from in
    // place (and can never write); receive slots in the landing pool, which a worker's put
    // fills with a plain copy.
    let mut net = Net::new(
        cfg.max_message,
        true,
        STORE_POOL_BYTES,
        (1 << 20) + cfg.slot_bytes,
    )?;
    // A connection may send only a small frame (its hello) until its worker proved itself:
    // what a stranger sends costs the server little.
    net.tcp.set_accepted_max_payload(MAX_CONTROL as u64);
    let addr = net.tcp.listen(SocketAddr::new(ip, 0))?;
    // Workers on this host attach over shared memory.
    let mut shm_name = None;
    if let Some(shm) = &mut net.shm {
        let name = net::shm_name()?;
        match shm.listen(&name) {
            Ok(()) => shm_name = Some(name),
            Err(e) => {
                tracing::warn!("no shared-memory listener ({e}); workers use TCP");
                net.shm = None;
            }
        }
    }
    // Over RDMA, as over TCP: until its worker proved itself, a link also cannot READ or
    // WRITE this server's memory.
    let rdma = crate::rdma::listen_for_workers(cfg, &mut net, ip, MAX_CONTROL as u64)?;
    // The heartbeat lives as long as the server's loop (a server writes nothing else).
    let (roster, _beat) = join(
        cfg,
        &mut sched,
        crate::protocol::role::SERVER,
        Some(addr),
        rdma,
        shm_name.as_deref(),
    )?;
    sched.set_nonblocking(true)?;
    let mut sched_reader = FrameReader::new(MAX_CONTROL as u64);
    let mut sched_frames = FrameQueue::default();
    // The job's processes on this host (the scheduler counts them) share its cores.
    net.set_local_processes(roster.local_processes);
    tracing::info!(
        "server {} of {}: {} workers, {}, at {addr}{}",
        roster.rank,
        roster.num_servers,
        roster.num_workers,
        if sync { "dist_sync" } else { "dist_async" },
        shm_name
            .as_deref()
            .map_or(String::new(), |n| format!(" and shared memory {n}"))
    );
    let mut state = ServerState::new(roster.num_workers, sync);
    // Messages over TCP are judged by their header before their data takes memory.
    let sizes = admission::Sizes::default();
    state.share_sizes(sizes.clone());
    net.tcp.set_admission(admission::admission(sizes));
    if let Some(shm) = &net.shm {
        // Values of at least half a pool page live in the send pool, so that answers to the
        // workers on this host go by reference; smaller ones would waste most of a page.
        let pages = shm.send_pages();
        state.set_alloc(Box::new(move |shape, dtype| {
            let bytes = shape.iter().product::<usize>().checked_mul(dtype.size())?;
            if bytes < STORE_IN_POOL_FROM {
                return None;
            }
            let r = pages.alloc(bytes, true).ok()?;
            Some(crate::NDArray::from_region(shape, dtype, r))
        }));
    }
    let mut workers = Workers::new(&cfg.secret, roster.tokens.clone(), cfg.slot_bytes);
    let mut outcome: Option<Result<()>> = None;
    let mut sched_open = true;
    let mut stop_by: Option<Instant> = None;
    let mut last_sched = Instant::now();
    // The scheduler answers each of this server's beats: a silence as long as the liveness a
    // process is judged by is a scheduler that was stopped or hangs (no Shutdown would come).
    let mut heard_sched = Instant::now();
    let sched_liveness = crate::roles::liveness(cfg.timeout);
    let mut turns = 0u32;
    let mut sched_ready = false;
    loop {
        net.progress(&mut |m, c| workers.on(&mut state, m, c))?;
        workers.close_refused(&mut state, &mut net);
        // The scheduler speaks rarely (shutdown, abort): a busy loop reads its socket once a
        // millisecond, not on every turn (each read is a system call).
        turns = turns.wrapping_add(1);
        // (A loop that slept reads it too: the clock and a read cost nothing then.)
        let due = turns % 64 == 0 && last_sched.elapsed() >= SCHED_EVERY;
        if sched_open && (sched_ready || net.slept || due) {
            last_sched = Instant::now();
            let mut r = sched_reader
                .read_from(&mut sched, &mut sched_frames)
                .map_err(|e| e.to_string());
            while let Some(f) = sched_frames.pop() {
                heard_sched = Instant::now();
                match sched_event(&f) {
                    Ok(Some(Ok(()))) => {
                        outcome.get_or_insert(Ok(()));
                    }
                    Ok(Some(Err(e))) => {
                        state.fail(&e.to_string());
                        outcome.get_or_insert(Err(e));
                    }
                    Ok(None) => {}
                    Err(e) => r = Err(e),
                }
            }
            let silent = heard_sched.elapsed() >= sched_liveness;
            if silent && r.is_ok() {
                r = Err(format!(
                    "no heartbeat for {:.1} s: it was stopped or hangs",
                    sched_liveness.as_secs_f64()
                ));
            }
            if let Err(e) = r {
                if outcome.is_none() {
                    let why = format!("lost the scheduler: {e}");
                    state.fail(&why);
                    outcome = Some(Err(KvError::PeerLost(why)));
                }
                sched_open = false;
            }
        }
        if let Some(why) = state.failed() {
            if outcome.is_none() {
                outcome = Some(Err(KvError::PeerLost(why.to_string())));
            }
        }
        // The answers of this turn (and, at the end, to failures) go out.
        workers.route(&mut state, &mut net);
        if outcome.is_some() {
            net.flush()?;
            let deadline = *stop_by.get_or_insert_with(|| Instant::now() + Duration::from_secs(2));
            if !workers.pending() || Instant::now() >= deadline {
                let m = state.metrics();
                crate::report::send_metrics("server", roster.rank, m.to_json(), |l| {
                    m.to_prometheus(l)
                });
                return outcome.unwrap_or(Ok(()));
            }
        }
        // Answers waiting for room are looked at again soon.
        let timeout = if workers.pending() {
            Duration::from_millis(1)
        } else {
            Duration::from_millis(200)
        };
        let extra = sched_open.then(|| sched.as_fd());
        sched_ready = net.wait(extra, timeout)?;
    }
}
