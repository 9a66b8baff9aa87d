//! The references kvperf measures beside a transport, in the same run: memcpy, a plain
//! socket ping-pong over loopback, and two threads passing messages through shared memory.

use std::time::{Duration, Instant};

/// The longest a reference's round trip may take before the measurement fails.
const ROUND_TRIP_LIMIT: Duration = Duration::from_secs(30);

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
/// `size` bytes over loopback: `iters` round trips, or as many as `budget` holds (10 at
/// least), after two untimed ones.
pub fn socket_pingpong_us(size: usize, iters: usize, budget: Duration) -> std::io::Result<f64> {
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
    // A round trip that takes this long ends the measurement with an error.
    c.set_read_timeout(Some(ROUND_TRIP_LIMIT))?;
    let mut buf = vec![0u8; size.max(1)];
    for _ in 0..2 {
        c.write_all(&buf)?;
        c.read_exact(&mut buf)?;
    }
    let mut samples = Vec::with_capacity(iters.min(1 << 16));
    let start = Instant::now();
    for i in 0..iters.max(1) {
        if i >= 10 && start.elapsed() > budget {
            break;
        }
        let t0 = Instant::now();
        c.write_all(&buf)?;
        c.read_exact(&mut buf)?;
        samples.push(t0.elapsed().as_nanos() as f64 / 2000.0);
    }
    drop(c);
    let _ = echo.join();
    Ok(crate::median(&mut samples))
}

/// One-way latency (half the median round trip, µs) of `size` bytes passed back and forth
/// between two threads through shared memory with nothing else: the message written into a
/// buffer and published by one store, the other thread waiting on that word (a spin), copying
/// the message out and answering the same way. The floor of any shared-memory transport on
/// this host (one cache line each way for a small message). `iters` round trips, or as many
/// as `budget` holds (10 at least).
pub fn shared_pingpong_us(
    size: usize,
    iters: usize,
    budget: Duration,
) -> Result<f64, kvstore_shm::ShmError> {
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
    let mut buf = vec![7u8; size];
    let (ab, ba) = (seg.atomic_u64(flag_ab)?, seg.atomic_u64(flag_ba)?);
    let mut samples = Vec::with_capacity(n.min(1 << 16) as usize);
    let start = Instant::now();
    for i in 1..=n {
        if i > 10 && start.elapsed() > budget {
            break;
        }
        let t0 = Instant::now();
        let deadline = t0 + ROUND_TRIP_LIMIT;
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
    Ok(crate::median(&mut samples))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn references_are_positive() {
        let budget = Duration::from_secs(1);
        assert!(memcpy_bandwidth(1 << 16, Duration::from_millis(10)) > 0.0);
        assert!(socket_pingpong_us(64, 20, budget).unwrap() > 0.0);
        assert!(shared_pingpong_us(64, 20, budget).unwrap() > 0.0);
        assert!(shared_pingpong_us(0, 20, budget).unwrap() > 0.0);
    }

    /// A count the budget cannot hold stops at the budget (10 round trips at least): 64 MiB,
    /// whose 1,000 round trips once took longer than the reference's deadline.
    #[test]
    fn a_reference_stops_at_its_budget() {
        let t = Instant::now();
        assert!(shared_pingpong_us(64 << 20, 1_000_000, Duration::from_millis(200)).unwrap() > 0.0);
        assert!(socket_pingpong_us(16 << 20, 1_000_000, Duration::from_millis(200)).unwrap() > 0.0);
        // 10 round trips of 64 MiB and of 16 MiB are far less than this on any machine.
        assert!(t.elapsed() < Duration::from_secs(60), "{:?}", t.elapsed());
    }
}
