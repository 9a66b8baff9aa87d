//! The ceiling of a parameter server on this host: one push+pull round done by threads that
//! share memory, with nothing between them but barriers (as `../shared/bench/ps_limit.c`).
//!
//! W worker threads and S server threads; per round each worker copies its gradient into a
//! shared buffer (the one copy of a push from ordinary memory; skipped for the zero-copy
//! ceiling, as a push from `kv.alloc` pages needs none), the servers sum the W gradients of
//! their slice into the stored value (an ASSIGN of the sum), and each worker copies the stored
//! value out (the pull). No store can do a round faster on the same memory and cores.

use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::time::{Duration, Instant};

use crate::Paged;

/// Median round times of the ceiling, in seconds.
#[derive(Clone, Copy, Debug)]
pub struct Limit {
    /// Gradients already in shared memory (pushes from `kv.alloc` arrays).
    pub zero_copy: f64,
    /// Gradients copied in first (pushes from ordinary arrays).
    pub one_copy: f64,
}

/// The ceiling for `bytes` of f32 per round with `w` workers and `s` servers, the median of
/// `rounds` rounds (at least 3), each way. Errors if a round computes a wrong sum.
pub fn measure(bytes: usize, w: usize, s: usize, rounds: usize) -> Result<Limit, String> {
    if w == 0 || s == 0 {
        return Err("the ceiling needs a worker and a server".into());
    }
    Ok(Limit {
        zero_copy: median_round(bytes, w, s, false, rounds)?,
        one_copy: median_round(bytes, w, s, true, rounds)?,
    })
}

fn median_round(
    bytes: usize,
    w: usize,
    s: usize,
    copy_in: bool,
    rounds: usize,
) -> Result<f64, String> {
    let n = (bytes / 4).max(1);
    let rounds = rounds.max(3);
    let private: Arc<Vec<Paged<f32>>> =
        Arc::new((0..w).map(|i| Paged::new(n, (i + 1) as f32)).collect());
    let pool: Arc<Vec<RwLock<Paged<f32>>>> = Arc::new(
        (0..w)
            .map(|i| RwLock::new(Paged::new(n, (i + 1) as f32)))
            .collect(),
    );
    let bounds: Vec<(usize, usize)> = (0..s).map(|k| (n * k / s, n * (k + 1) / s)).collect();
    // As ps_limit.c, every buffer starts at a page (its `aligned_alloc(4096, ...)`).
    let stored: Arc<Vec<RwLock<Paged<f32>>>> = Arc::new(
        bounds
            .iter()
            .map(|&(lo, hi)| RwLock::new(Paged::new(hi - lo, 0.0)))
            .collect(),
    );
    let bar = Arc::new(Rendezvous::new(w + s));
    let mut handles = Vec::new();
    for i in 0..w {
        let (private, pool, stored, bar) =
            (private.clone(), pool.clone(), stored.clone(), bar.clone());
        handles.push(std::thread::spawn(move || -> Result<Vec<f64>, String> {
            let _leave = Leave(&bar);
            let mut out = Paged::new(n, 0.0);
            for _ in 0..rounds {
                bar.wait()?;
                if copy_in {
                    let mut p = pool[i].write().map_err(|e| e.to_string())?;
                    p.copy_from_slice(&private[i][..]);
                }
                bar.wait()?;
                bar.wait()?;
                let mut at = 0;
                for chunk in stored.iter() {
                    let c = chunk.read().map_err(|e| e.to_string())?;
                    out[at..at + c.len()].copy_from_slice(&c);
                    at += c.len();
                }
                bar.wait()?;
            }
            let want = (w * (w + 1) / 2) as f32;
            if out[0] != want || out[n - 1] != want {
                return Err(format!(
                    "the ceiling's round summed {} where {want} was due",
                    out[0]
                ));
            }
            Ok(Vec::new())
        }));
    }
    for (k, &(lo, hi)) in bounds.iter().enumerate() {
        let (pool, stored, bar) = (pool.clone(), stored.clone(), bar.clone());
        handles.push(std::thread::spawn(move || -> Result<Vec<f64>, String> {
            let _leave = Leave(&bar);
            let mut times = Vec::with_capacity(rounds);
            for _ in 0..rounds {
                bar.wait()?;
                let t0 = Instant::now();
                bar.wait()?;
                {
                    // As ps_limit.c: the first two gradients summed in one pass (a copy where
                    // there is one), the others added to it.
                    let mut dst = stored[k].write().map_err(|e| e.to_string())?;
                    let a = pool[0].read().map_err(|e| e.to_string())?;
                    match pool.get(1) {
                        None => dst.copy_from_slice(&a[lo..hi]),
                        Some(b) => {
                            let b = b.read().map_err(|e| e.to_string())?;
                            for ((d, x), y) in dst.iter_mut().zip(&a[lo..hi]).zip(&b[lo..hi]) {
                                *d = x + y;
                            }
                        }
                    }
                    for g in pool.iter().skip(2) {
                        let g = g.read().map_err(|e| e.to_string())?;
                        for (d, x) in dst.iter_mut().zip(&g[lo..hi]) {
                            *d += x;
                        }
                    }
                }
                bar.wait()?;
                bar.wait()?;
                times.push(t0.elapsed().as_secs_f64());
            }
            Ok(times)
        }));
    }
    let mut first = None;
    for h in handles {
        let t = h
            .join()
            .map_err(|_| "a ceiling thread panicked".to_string())??;
        if first.is_none() && !t.is_empty() {
            first = Some(t);
        }
    }
    let mut t = first.ok_or("no round was timed")?;
    // The first round faults the pages in.
    t.remove(0);
    Ok(crate::median(&mut t))
}

/// How long a thread waits at the barrier for the others before the measurement fails.
const BARRIER_TIMEOUT: Duration = Duration::from_secs(60);

/// A barrier for `n` threads that fails rather than waits forever: a wait times out after
/// [`BARRIER_TIMEOUT`], and a thread that leaves (see [`Leave`]) breaks it for the others, so
/// a thread that stops early, by an error or a panic, cannot leave the rest waiting.
struct Rendezvous {
    n: usize,
    state: Mutex<Crossing>,
    turned: Condvar,
}

#[derive(Default)]
struct Crossing {
    arrived: usize,
    generation: u64,
    broken: bool,
}

impl Rendezvous {
    fn new(n: usize) -> Rendezvous {
        Rendezvous {
            n,
            state: Mutex::new(Crossing::default()),
            turned: Condvar::new(),
        }
    }

    fn wait(&self) -> Result<(), String> {
        let broken = || "another thread of the ceiling stopped".to_string();
        let mut c = self.state.lock().map_err(|_| broken())?;
        if c.broken {
            return Err(broken());
        }
        let generation = c.generation;
        c.arrived += 1;
        if c.arrived == self.n {
            c.arrived = 0;
            c.generation += 1;
            self.turned.notify_all();
            return Ok(());
        }
        let deadline = Instant::now() + BARRIER_TIMEOUT;
        while c.generation == generation {
            if c.broken {
                return Err(broken());
            }
            let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                c.broken = true;
                self.turned.notify_all();
                return Err(format!(
                    "the ceiling's threads did not meet within {BARRIER_TIMEOUT:?}"
                ));
            };
            c = self.turned.wait_timeout(c, left).map_err(|_| broken())?.0;
        }
        Ok(())
    }
}

/// Breaks the barrier when its thread ends, however it ends. After a thread's last round
/// nobody waits at the barrier again, so breaking it then changes nothing.
struct Leave<'a>(&'a Rendezvous);

impl Drop for Leave<'_> {
    fn drop(&mut self) {
        let mut c = match self.0.state.lock() {
            Ok(c) => c,
            Err(poisoned) => poisoned.into_inner(),
        };
        c.broken = true;
        self.0.turned.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ceiling_sums_right_and_copying_in_costs_more_than_not() {
        let l = measure(4 << 20, 2, 2, 7).unwrap();
        assert!(l.zero_copy > 0.0 && l.one_copy > 0.0);
        let one = measure(4096, 1, 1, 3).unwrap();
        assert!(one.zero_copy > 0.0);
        assert!(measure(4096, 0, 1, 3).is_err());
    }

    #[test]
    fn a_thread_that_stops_early_fails_the_others_instead_of_leaving_them_waiting() {
        let bar = Arc::new(Rendezvous::new(3));
        let waiters: Vec<_> = (0..2)
            .map(|_| {
                let bar = bar.clone();
                std::thread::spawn(move || {
                    let _leave = Leave(&bar);
                    bar.wait()?;
                    bar.wait()
                })
            })
            .collect();
        {
            // The third thread crosses once, then stops before the second crossing.
            let _leave = Leave(&bar);
            bar.wait().unwrap();
        }
        for h in waiters {
            let err = h.join().unwrap().unwrap_err();
            assert!(err.contains("stopped"), "{err}");
        }
        assert!(bar.wait().is_err());
    }
}
