//! `kvperf lat` and `kvperf bw`: latency and bandwidth of a raw transport, perftest-style.
//!
//! The client sends the plan (sizes, iterations, mode) as the first message; the server follows
//! it. In `send` mode messages are two-sided; in `write` mode the data is put straight into a
//! region the peer exposed, and the notification carries an immediate (RDMA WRITE_WITH_IMM's
//! shape).

use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use kvstore_transport::{Access, Region, RemoteRegion, REMOTE_LEN};

use crate::conn::{Conn, Event};

const PLAN: u64 = 1;
const HANDLE: u64 = 2;
const ACK: u64 = 3;
const DATA: u64 = 4;

/// What to measure.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    /// `lat` or `bw`.
    pub test: String,
    /// `send` or `write`.
    pub mode: String,
    /// Message sizes in bytes.
    pub sizes: Vec<usize>,
    /// Timed iterations per size (0: use `duration`).
    pub iters: usize,
    /// Seconds per size when `iters` is 0.
    pub duration: f64,
    /// Untimed iterations first.
    pub warmup: usize,
    /// Messages in flight (bw).
    pub window: usize,
}

impl Plan {
    fn encode(&self) -> String {
        let sizes: Vec<String> = self.sizes.iter().map(|s| s.to_string()).collect();
        format!(
            "{} {} {} {} {} {} {}",
            self.test,
            self.mode,
            sizes.join(","),
            self.iters,
            self.duration,
            self.warmup,
            self.window
        )
    }

    fn decode(s: &str) -> Result<Plan, String> {
        let w: Vec<&str> = s.split_whitespace().collect();
        let bad = || format!("malformed plan {s:?}");
        if w.len() != 7 {
            return Err(bad());
        }
        Ok(Plan {
            test: w[0].into(),
            mode: w[1].into(),
            sizes: w[2]
                .split(',')
                .map(|x| x.parse().map_err(|_| bad()))
                .collect::<Result<_, _>>()?,
            iters: w[3].parse().map_err(|_| bad())?,
            duration: w[4].parse().map_err(|_| bad())?,
            warmup: w[5].parse().map_err(|_| bad())?,
            window: w[6].parse().map_err(|_| bad())?,
        })
    }
}

/// One size's latency figures (one-way: half the round trip), in microseconds.
#[derive(Clone, Debug)]
pub struct LatRow {
    /// Message size.
    pub size: usize,
    /// Round trips timed.
    pub iters: usize,
    /// min, p50, p90, p99, p99.9, max.
    pub us: [f64; 6],
}

/// One size's bandwidth figures.
#[derive(Clone, Debug)]
pub struct BwRow {
    /// Message size.
    pub size: usize,
    /// Messages timed.
    pub iters: usize,
    /// Bytes per second.
    pub bytes_per_s: f64,
    /// Messages per second.
    pub msgs_per_s: f64,
}

/// What a client measured.
pub enum Results {
    /// Latency rows.
    Lat(Vec<LatRow>),
    /// Bandwidth rows.
    Bw(Vec<BwRow>),
}

/// Bytes of the region a side exposes for `write` mode: room for `slots` messages.
fn region_slots(plan: &Plan, size: usize) -> usize {
    let max_bytes = 256usize << 20;
    let want = if plan.test == "bw" {
        plan.window.max(1)
    } else {
        1
    };
    // Each slot is a grant, and their handles go in one message.
    want.min((max_bytes / size.max(1)).max(1)).min(256)
}

/// Memory for one size: the source of sends and puts, and (in `write` mode) a region whose
/// slots are granted to the peer one by one (a put fills its grant, as the store's do), and
/// the peer's grants.
struct Bufs {
    src: Region,
    mine: Vec<RemoteRegion>,
    landing: Option<Region>,
    remote: Vec<RemoteRegion>,
}

fn setup(
    c: &mut Conn,
    plan: &Plan,
    size: usize,
    salt: u8,
    timeout: Duration,
) -> Result<Bufs, String> {
    let src = c.alloc(size, Access::Send)?;
    let bytes: Vec<u8> = (0..size).map(|i| i as u8 ^ salt).collect();
    // SAFETY: fresh memory, not yet sent or granted.
    unsafe { src.write(0, &bytes) }.map_err(|e| e.to_string())?;
    if plan.mode != "write" {
        return Ok(Bufs {
            src,
            mine: Vec::new(),
            landing: None,
            remote: Vec::new(),
        });
    }
    let slots = region_slots(plan, size);
    let s = size.max(1);
    let landing = c.alloc(s * slots, Access::Land)?;
    let mine = (0..slots)
        .map(|i| c.grant(&landing, i * s..(i + 1) * s))
        .collect::<Result<Vec<_>, _>>()?;
    let handles: Vec<u8> = mine.iter().flat_map(|g| g.to_bytes()).collect();
    c.send(HANDLE, &handles, None, Instant::now() + timeout)?;
    match c.recv(Instant::now() + timeout)? {
        Event::Msg {
            tag: HANDLE, body, ..
        } => Ok(Bufs {
            src,
            mine,
            landing: Some(landing),
            remote: body
                .chunks(REMOTE_LEN)
                .map(|b| RemoteRegion::from_bytes(b).ok_or("bad region handle"))
                .collect::<Result<Vec<_>, _>>()?,
        }),
        other => Err(format!("expected region handles, got {other:?}")),
    }
}

impl Bufs {
    /// After the size's last exchange (both sides drained their operations before it).
    fn release(self, c: &mut Conn) {
        for g in &self.mine {
            c.forget(g);
        }
    }
}

/// Sends `size` bytes one way: a message with data, or a put into the peer's slot `slot`.
fn one(c: &mut Conn, b: &Bufs, size: usize, slot: usize, deadline: Instant) -> Result<(), String> {
    match b.remote.get(slot) {
        Some(r) => c.put(&b.src, 0..size, r, 0, DATA as u32, deadline),
        None => c.send(DATA, &[], Some((&b.src, 0..size)), deadline),
    }
}

/// Takes the peer's next `size` bytes (a message's data, or a put).
fn expect_data(c: &mut Conn, size: usize, deadline: Instant) -> Result<(), String> {
    let ev = c.recv(deadline)?;
    is_data(&ev, size)
}

/// `Ok` for data of `size` bytes (anything else is an error).
fn is_data(ev: &Event, size: usize) -> Result<(), String> {
    let len = match *ev {
        Event::Msg {
            tag: DATA, data, ..
        } => data,
        Event::Put { imm, len } if imm as u64 == DATA => len,
        _ => return Err(format!("expected {size} bytes of data, got {ev:?}")),
    };
    match len == size {
        true => Ok(()),
        false => Err(format!("expected {size} bytes of data, got {len}")),
    }
}

/// Checks that the last data of `size` bytes from the peer (what its last message brought,
/// or its puts into slot 0) is its pattern (`salt`): a transport that changed the bytes
/// fails the run.
fn check_data(c: &Conn, b: &Bufs, size: usize, salt: u8) -> Result<(), String> {
    let mut landed = Vec::new();
    let got = match &b.landing {
        Some(l) => {
            landed.resize(size, 0);
            // SAFETY: after the size's last exchange, drained: the peer writes it no more.
            unsafe { l.read(0, &mut landed) }.map_err(|e| e.to_string())?;
            &landed[..]
        }
        None => c.last_data(size),
    };
    if got.len() == size && got.iter().enumerate().all(|(i, &x)| x == i as u8 ^ salt) {
        Ok(())
    } else {
        Err(format!("the {size} bytes of data arrived changed"))
    }
}

fn expect_ack(c: &mut Conn, deadline: Instant) -> Result<(), String> {
    match c.recv(deadline)? {
        Event::Msg { tag: ACK, .. } => Ok(()),
        other => Err(format!("expected an ack, got {other:?}")),
    }
}

fn ack(c: &mut Conn, what: &[u8], timeout: Duration) -> Result<(), String> {
    c.send(ACK, what, None, Instant::now() + timeout)
}

/// The client side: runs the plan against a connected server.
pub fn client(c: &mut Conn, plan: &Plan, timeout: Duration) -> Result<Results, String> {
    c.send(
        PLAN,
        plan.encode().as_bytes(),
        None,
        Instant::now() + timeout,
    )?;
    let mut lat = Vec::new();
    let mut bw = Vec::new();
    for &size in &plan.sizes {
        let bufs = setup(c, plan, size, 0, timeout)?;
        let slots = region_slots(plan, size);
        // At least one timed iteration, however short the duration: a run that timed none
        // would print zeros as if they were measured.
        let timed = |i: usize, start: Instant| {
            if plan.iters > 0 {
                i < plan.iters
            } else {
                i == 0 || start.elapsed().as_secs_f64() < plan.duration
            }
        };
        if plan.test == "lat" {
            let mut h = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3)
                .map_err(|x| x.to_string())?;
            for _ in 0..plan.warmup {
                one(c, &bufs, size, 0, Instant::now() + timeout)?;
                expect_data(c, size, Instant::now() + timeout)?;
            }
            let start = Instant::now();
            let mut n = 0;
            while timed(n, start) {
                let t0 = Instant::now();
                one(c, &bufs, size, 0, t0 + timeout)?;
                expect_data(c, size, t0 + timeout)?;
                let half = (t0.elapsed().as_nanos() as u64 / 2).max(1);
                // (A half round trip past the histogram's 60 s is counted as 60 s.)
                h.saturating_record(half);
                n += 1;
            }
            c.drain(Instant::now() + timeout)?;
            check_data(c, &bufs, size, 0x5a)?;
            ack(c, b"end", timeout)?;
            let us = |ns: u64| ns as f64 / 1000.0;
            lat.push(LatRow {
                size,
                iters: n,
                us: [
                    us(h.min()),
                    us(h.value_at_quantile(0.5)),
                    us(h.value_at_quantile(0.9)),
                    us(h.value_at_quantile(0.99)),
                    us(h.value_at_quantile(0.999)),
                    us(h.max()),
                ],
            });
        } else {
            let window = plan.window.max(1).min(if plan.mode == "write" {
                slots
            } else {
                usize::MAX
            });
            for i in 0..plan.warmup {
                one(c, &bufs, size, i % slots, Instant::now() + timeout)?;
                if (i + 1) % window == 0 {
                    expect_ack(c, Instant::now() + timeout)?;
                }
            }
            if plan.warmup % window != 0 {
                // A short last window: the flush makes the server ack and count afresh.
                ack(c, b"flush", timeout)?;
                expect_ack(c, Instant::now() + timeout)?;
            }
            let start = Instant::now();
            let mut n = 0;
            loop {
                let more = timed(n, start);
                if more {
                    one(c, &bufs, size, n % slots, Instant::now() + timeout)?;
                    n += 1;
                }
                if n > 0 && (n % window == 0 || !more) {
                    if !more {
                        // Tell the server the last window is short: it acks on this message.
                        ack(c, b"flush", timeout)?;
                    }
                    expect_ack(c, Instant::now() + timeout)?;
                }
                if !more {
                    break;
                }
            }
            let secs = start.elapsed().as_secs_f64();
            c.drain(Instant::now() + timeout)?;
            ack(c, b"end", timeout)?;
            bw.push(BwRow {
                size,
                iters: n,
                bytes_per_s: (n * size) as f64 / secs,
                msgs_per_s: n as f64 / secs,
            });
        }
        expect_ack(c, Instant::now() + timeout)?;
        bufs.release(c);
    }
    Ok(if plan.test == "lat" {
        Results::Lat(lat)
    } else {
        Results::Bw(bw)
    })
}

/// The server side: follows the client's plan until it is done.
pub fn server(c: &mut Conn, timeout: Duration) -> Result<(), String> {
    let plan = match c.recv(Instant::now() + timeout)? {
        Event::Msg {
            tag: PLAN, body, ..
        } => Plan::decode(&String::from_utf8_lossy(&body))?,
        other => return Err(format!("expected a plan, got {other:?}")),
    };
    for &size in &plan.sizes {
        let bufs = setup(c, &plan, size, 0x5a, timeout)?;
        let window = plan.window.max(1).min(if plan.mode == "write" {
            region_slots(&plan, size)
        } else {
            usize::MAX
        });
        let mut got = 0usize;
        let mut any = false;
        loop {
            // The client may pause between sizes; a peer gone is still seen within `timeout`.
            match c.recv(Instant::now() + timeout)? {
                ev @ (Event::Msg { tag: DATA, .. } | Event::Put { .. }) => {
                    is_data(&ev, size)?;
                    got += 1;
                    any = true;
                    if plan.test == "lat" {
                        one(c, &bufs, size, 0, Instant::now() + timeout)?;
                    } else if got % window == 0 {
                        ack(c, b"", timeout)?;
                    }
                }
                Event::Msg { tag: ACK, body, .. } if body == b"flush" => {
                    got = 0;
                    ack(c, b"", timeout)?;
                }
                Event::Msg { tag: ACK, body, .. } if body == b"end" => {
                    c.drain(Instant::now() + timeout)?;
                    if any {
                        check_data(c, &bufs, size, 0)?;
                    }
                    ack(c, b"", timeout)?;
                    break;
                }
                other => return Err(format!("unexpected {other:?}")),
            }
        }
        bufs.release(c);
    }
    Ok(())
}

/// Single-threaded memcpy bandwidth for buffers of `size` bytes (bytes per second).
pub fn memcpy_bandwidth(size: usize, min_time: Duration) -> f64 {
    // Both ends at a page: a reference measures the best copy.
    let src = crate::Paged::new(size.max(1), 1u8);
    let mut dst = crate::Paged::new(size.max(1), 0u8);
    let (src, dst): (&[u8], &mut [u8]) = (&src, &mut dst);
    // Copies per clock reading, so the clock costs nothing next to small copies.
    let batch = ((1usize << 20) / size.max(1)).max(1);
    // Untimed: the first copy faults the destination's pages in.
    dst.copy_from_slice(src);
    let start = Instant::now();
    let mut n = 0usize;
    while start.elapsed() < min_time || n < 3 {
        for _ in 0..batch {
            dst.copy_from_slice(std::hint::black_box(src));
            std::hint::black_box(&mut *dst);
        }
        n += batch;
    }
    (n * size) as f64 / start.elapsed().as_secs_f64()
}

/// One-way latency (half the median round trip, µs) of a plain blocking-socket ping-pong of
/// `size` bytes over loopback.
pub fn socket_pingpong_us(size: usize, iters: usize) -> std::io::Result<f64> {
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};
    let l = TcpListener::bind("127.0.0.1:0")?;
    let addr = l.local_addr()?;
    let echo = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut s, _) = l.accept()?;
        s.set_nodelay(true)?;
        let mut buf = vec![0u8; size.max(1)];
        loop {
            match s.read_exact(&mut buf) {
                Ok(()) => s.write_all(&buf)?,
                Err(_) => return Ok(()),
            }
        }
    });
    let mut c = TcpStream::connect(addr)?;
    c.set_nodelay(true)?;
    let mut buf = vec![0u8; size.max(1)];
    let mut samples = Vec::with_capacity(iters);
    for _ in 0..iters.max(1) {
        let t0 = Instant::now();
        c.write_all(&buf)?;
        c.read_exact(&mut buf)?;
        samples.push(t0.elapsed().as_nanos() as f64 / 2000.0);
    }
    drop(c);
    let _ = echo.join();
    samples.sort_by(f64::total_cmp);
    Ok(samples[samples.len() / 2])
}

/// One-way latency (half the median round trip, µs) of `size` bytes passed back and forth
/// between two threads through shared memory with nothing else: the message written into a
/// buffer and published by one store, the other thread waiting on that word (a spin), copying
/// the message out and answering the same way. The floor of any shared-memory transport on
/// this host (one cache line each way for a small message).
pub fn shared_pingpong_us(size: usize, iters: usize) -> Result<f64, kvstore_shm::ShmError> {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    /// Tells the echo thread to stop, on every way out of the function.
    struct Stop(Arc<AtomicBool>);
    impl Drop for Stop {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Relaxed);
        }
    }
    // The two flags on their own cache lines, then the two buffers, each page-aligned.
    let (flag_ab, flag_ba, at_ab) = (0usize, 64usize, 4096usize);
    let at_ba = at_ab + size.div_ceil(4096).max(1) * 4096;
    let len = at_ba + size.div_ceil(4096).max(1) * 4096;
    let seg = Arc::new(kvstore_shm::Segment::create("kvperf-ref", len)?);
    let n = iters.max(1) as u64;
    let (other, stop) = (seg.clone(), Arc::new(AtomicBool::new(false)));
    let stopped = stop.clone();
    let echo = std::thread::spawn(move || -> Result<(), kvstore_shm::ShmError> {
        let mut buf = vec![0u8; size];
        let (ab, ba) = (other.atomic_u64(flag_ab)?, other.atomic_u64(flag_ba)?);
        for i in 1..=n {
            while ab.load(Ordering::Acquire) != i {
                if stopped.load(Ordering::Relaxed) {
                    return Ok(());
                }
                std::hint::spin_loop();
            }
            other.read(at_ab, &mut buf)?;
            other.write(at_ba, &buf)?;
            ba.store(i, Ordering::Release);
        }
        Ok(())
    });
    let guard = Stop(stop);
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut buf = vec![7u8; size];
    let (ab, ba) = (seg.atomic_u64(flag_ab)?, seg.atomic_u64(flag_ba)?);
    let mut samples = Vec::with_capacity(n as usize);
    for i in 1..=n {
        let t0 = Instant::now();
        seg.write(at_ab, &buf)?;
        ab.store(i, Ordering::Release);
        let mut spins = 0u32;
        while ba.load(Ordering::Acquire) != i {
            spins = spins.wrapping_add(1);
            if spins % 4096 == 0 && (echo.is_finished() || Instant::now() >= deadline) {
                return Err(kvstore_shm::ShmError::Timeout);
            }
            std::hint::spin_loop();
        }
        seg.read(at_ba, &mut buf)?;
        samples.push(t0.elapsed().as_nanos() as f64 / 2000.0);
    }
    drop(guard);
    echo.join()
        .map_err(|_| kvstore_shm::ShmError::Corrupt("the echo thread panicked".into()))??;
    samples.sort_by(f64::total_cmp);
    Ok(samples[samples.len() / 2])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_round_trip_and_garbage_is_refused() {
        let p = Plan {
            test: "bw".into(),
            mode: "write".into(),
            sizes: vec![8, 16],
            iters: 10,
            duration: 0.5,
            warmup: 2,
            window: 4,
        };
        assert_eq!(Plan::decode(&p.encode()).unwrap(), p);
        assert!(Plan::decode("lat send x 1 1 1 1").is_err());
        assert!(Plan::decode("").is_err());
    }

    #[test]
    fn references_are_positive() {
        assert!(memcpy_bandwidth(1 << 16, Duration::from_millis(10)) > 0.0);
        assert!(socket_pingpong_us(64, 20).unwrap() > 0.0);
        assert!(shared_pingpong_us(64, 20).unwrap() > 0.0);
        assert!(shared_pingpong_us(0, 20).unwrap() > 0.0);
    }
}
