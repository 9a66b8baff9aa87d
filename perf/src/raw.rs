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
    /// The mean and the standard deviation (what osu_latency and perftest report beside the
    /// percentiles).
    pub mean_stdev_us: [f64; 2],
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

/// Checks that the last data of `size` bytes from the peer is its pattern (`salt`): what its
/// last message brought, or, in `write` mode, every slot its last `n` puts filled. A
/// transport that changed the bytes, or dropped them, fails the run.
fn check_data(c: &Conn, b: &Bufs, size: usize, n: usize, salt: u8) -> Result<(), String> {
    let good =
        |got: &[u8]| got.len() == size && got.iter().enumerate().all(|(i, &x)| x == i as u8 ^ salt);
    let ok = match &b.landing {
        Some(l) => {
            let mut landed = vec![0; size];
            (0..n.min(b.mine.len())).all(|slot| {
                // SAFETY: the peer's puts into the landing are over: it sent what followed
                // them, and puts no more until this side answers.
                unsafe { l.read(slot * size.max(1), &mut landed) }.is_ok() && good(&landed)
            })
        }
        None => good(c.last_data(size)),
    };
    match ok {
        true => Ok(()),
        false => Err(format!("the {size} bytes of data arrived changed")),
    }
}

/// Zeroes what the peer's data brought (the landing's slots, or the last message's copy), so
/// that a later check cannot pass on what an earlier phase left.
fn wipe(c: &mut Conn, b: &Bufs, size: usize) -> Result<(), String> {
    match &b.landing {
        Some(l) => {
            let zeros = vec![0; size.max(1) * b.mine.len()];
            // SAFETY: as in `check_data`: the peer puts nothing until this side answers.
            unsafe { l.write(0, &zeros) }.map_err(|e| e.to_string())
        }
        None => {
            c.wipe_data();
            Ok(())
        }
    }
}

/// Sends data while `more(i)` says so (`i`: how many were sent), keeping at most `window`
/// messages the server has not counted in flight: a credit window topped up as its counts
/// come back, never drained while it runs (perftest's `run_iter_bw`, which posts while fewer
/// than its depth are outstanding). Then a flush, and the server's count of them all, which
/// must be what was sent. Returns how many were sent.
fn stream(
    c: &mut Conn,
    b: &Bufs,
    size: usize,
    slots: usize,
    window: usize,
    more: impl Fn(usize) -> bool,
    timeout: Duration,
) -> Result<usize, String> {
    let (mut sent, mut counted, every) = (0usize, 0usize, (window / 2).max(1));
    while more(sent) {
        while sent - counted >= window {
            counted = counted.max(count(c.recv(Instant::now() + timeout)?)?);
        }
        // In `write` mode the slot was last written `slots >= window` messages ago: counted.
        one(c, b, size, sent % slots, Instant::now() + timeout)?;
        sent += 1;
        // Counts come back every half window: looked for as often (a look is a progress
        // call, which costs as much as a small send).
        if sent % every == 0 {
            while let Some(ev) = c.try_recv()? {
                counted = counted.max(count(ev)?);
            }
        }
    }
    ack(c, b"flush", timeout)?;
    loop {
        match c.recv(Instant::now() + timeout)? {
            Event::Msg { tag: ACK, body, .. } if body.len() == 12 && body.starts_with(b"done") => {
                let got = u64::from_le_bytes(body[4..].try_into().unwrap_or([0; 8]));
                return match got == sent as u64 {
                    true => Ok(sent),
                    false => Err(format!(
                        "{sent} messages of {size} bytes sent, and the peer counted {got}"
                    )),
                };
            }
            ev => {
                count(ev)?;
            }
        }
    }
}

/// The server's count of the data messages it took, from one of its acks.
fn count(ev: Event) -> Result<usize, String> {
    match ev {
        Event::Msg { tag: ACK, body, .. } if body.len() == 8 => {
            Ok(u64::from_le_bytes(body[..].try_into().unwrap_or([0; 8])) as usize)
        }
        other => Err(format!("expected a count, got {other:?}")),
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
            check_data(c, &bufs, size, 1, 0x5a)?;
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
                mean_stdev_us: [h.mean() / 1000.0, h.stdev() / 1000.0],
            });
        } else {
            let window = plan.window.max(1).min(if plan.mode == "write" {
                slots
            } else {
                usize::MAX
            });
            stream(c, &bufs, size, slots, window, |i| i < plan.warmup, timeout)?;
            let start = Instant::now();
            let n = stream(c, &bufs, size, slots, window, |i| timed(i, start), timeout)?;
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
        // A count goes back every half window: the client's credit returns while it still
        // has messages in flight.
        let every = (window / 2).max(1);
        let (mut got, mut any, mut flushes, mut timed) = (0usize, false, 0, 0);
        loop {
            // The client may pause between sizes; a peer gone is still seen within `timeout`
            // (of each message: a large one may take long on a slow link).
            match c.recv(Instant::now() + timeout)? {
                ev @ (Event::Msg { tag: DATA, .. } | Event::Put { .. }) => {
                    is_data(&ev, size)?;
                    got += 1;
                    any = true;
                    if plan.test == "lat" {
                        one(c, &bufs, size, 0, Instant::now() + timeout)?;
                    } else if got % every == 0 {
                        ack(c, &(got as u64).to_le_bytes(), timeout)?;
                    }
                }
                Event::Msg { tag: ACK, body, .. } if body == b"flush" => {
                    // Every message of the phase came before its flush. The warmup's data is
                    // checked, then wiped, so that the timed phase's check (at the end, out of
                    // its time) sees its own.
                    flushes += 1;
                    if flushes == 1 {
                        if got > 0 {
                            check_data(c, &bufs, size, got, 0)?;
                        }
                        wipe(c, &bufs, size)?;
                    } else {
                        timed = got;
                    }
                    let mut done = b"done".to_vec();
                    done.extend_from_slice(&(got as u64).to_le_bytes());
                    got = 0;
                    ack(c, &done, timeout)?;
                }
                Event::Msg { tag: ACK, body, .. } if body == b"end" => {
                    c.drain(Instant::now() + timeout)?;
                    match plan.test == "lat" {
                        true if any => check_data(c, &bufs, size, 1, 0)?,
                        false if timed > 0 => check_data(c, &bufs, size, timed, 0)?,
                        _ => {}
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
}
