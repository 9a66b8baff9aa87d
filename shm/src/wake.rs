//! Waiting for the other process without burning a core: spin briefly, then sleep on a futex
//! in the segment. The waker makes a system call only when the waiter is asleep.

use std::sync::atomic::{fence, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustix::thread::futex;

use crate::{Segment, ShmError};

/// A doorbell for a sleeper that waits in its poll loop: the end it reads (registered there,
/// emptied by [`drain_doorbell`] when it wakes) and the end it gives the other side to ring,
/// of a pair of Unix datagram sockets. Ringing sends with `MSG_DONTWAIT`, a flag of the call,
/// not of the file: the side that gave the end cannot make a ring wait (as it could an
/// eventfd's, by clearing `O_NONBLOCK` on the file they share and filling its counter).
pub fn doorbell() -> std::io::Result<(std::os::fd::OwnedFd, std::os::fd::OwnedFd)> {
    use rustix::net::{socketpair, AddressFamily, SocketFlags, SocketType};
    Ok(socketpair(
        AddressFamily::UNIX,
        SocketType::DGRAM,
        SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
        None,
    )?)
}

/// Empties the reading end of a [`doorbell`] after a wake-up (at most what a full socket
/// holds: rings coming meanwhile are for the next wake-up).
pub fn drain_doorbell(fd: &std::os::fd::OwnedFd) {
    let mut b = [0u8; 8];
    for _ in 0..4096 {
        if rustix::net::recv(fd, &mut b, rustix::net::RecvFlags::DONTWAIT).is_err() {
            break;
        }
    }
}

/// A wake-up word pair (`seq`, `sleeping`) in a segment, at an 8-aligned offset; optionally
/// also a doorbell (a [`doorbell`] the sleeper waits on in its poll loop, with its sockets).
pub struct Wake {
    seg: Arc<Segment>,
    off: usize,
    doorbell: Option<std::os::fd::OwnedFd>,
}

impl Wake {
    /// The wake-up words at `off` of `seg` (8 bytes).
    pub fn new(seg: Arc<Segment>, off: usize) -> Result<Wake, ShmError> {
        seg.atomic_u32(off)?;
        seg.atomic_u32(off + 4)?;
        Ok(Wake {
            seg,
            off,
            doorbell: None,
        })
    }

    /// Also rings `doorbell` when the other side sleeps (for a sleeper that waits in epoll):
    /// the ringing end of the other side's [`doorbell`] pair.
    pub fn set_doorbell(&mut self, doorbell: std::os::fd::OwnedFd) {
        self.doorbell = Some(doorbell);
    }

    /// The sleeper, before it blocks elsewhere (epoll on a doorbell): says it sleeps. The caller
    /// must check for work once more afterwards, then [`Wake::disarm`] when it wakes.
    pub fn arm(&self) -> Result<(), ShmError> {
        self.seg
            .atomic_u32(self.off + 4)?
            .store(1, Ordering::Relaxed);
        fence(Ordering::SeqCst);
        Ok(())
    }

    /// The sleeper is awake again.
    pub fn disarm(&self) -> Result<(), ShmError> {
        self.seg
            .atomic_u32(self.off + 4)?
            .store(0, Ordering::Relaxed);
        Ok(())
    }

    /// Called by the producer after publishing: wakes the consumer if it sleeps.
    pub fn notify(&self) -> Result<(), ShmError> {
        let sleeping = self.seg.atomic_u32(self.off + 4)?;
        // Pairs with the fence in `wait`: either the waiter sees what was published, or this
        // sees that it sleeps.
        fence(Ordering::SeqCst);
        if sleeping.load(Ordering::Relaxed) != 0 {
            self.ring()?;
        }
        Ok(())
    }

    /// Wakes the other side whether or not it says it sleeps (it asked for a wake-up in
    /// another way).
    pub fn ring(&self) -> Result<(), ShmError> {
        let seq = self.seg.atomic_u32(self.off)?;
        seq.fetch_add(1, Ordering::Release);
        futex::wake(seq, futex::Flags::empty(), u32::MAX)?;
        if let Some(fd) = &self.doorbell {
            // Never waits, whatever the other side did to the socket it shares with this one
            // (a file's O_NONBLOCK is the other side's to change): a full socket is rung
            // already, a closed one is a peer that left.
            let _ = rustix::net::send(
                fd,
                &[1],
                rustix::net::SendFlags::DONTWAIT | rustix::net::SendFlags::NOSIGNAL,
            );
        }
        Ok(())
    }

    /// Waits until `ready()` is true: polls it for `spin`, then sleeps until notified (or a
    /// short tick, as a guard), until `deadline`.
    pub fn wait(
        &self,
        mut ready: impl FnMut() -> bool,
        spin: Duration,
        deadline: Instant,
    ) -> Result<(), ShmError> {
        let start = Instant::now();
        loop {
            for _ in 0..64 {
                if ready() {
                    return Ok(());
                }
                std::hint::spin_loop();
            }
            if start.elapsed() >= spin {
                break;
            }
        }
        let seq = self.seg.atomic_u32(self.off)?;
        let sleeping = self.seg.atomic_u32(self.off + 4)?;
        loop {
            let s = seq.load(Ordering::Acquire);
            sleeping.store(1, Ordering::Relaxed);
            fence(Ordering::SeqCst);
            if ready() {
                sleeping.store(0, Ordering::Relaxed);
                return Ok(());
            }
            let now = Instant::now();
            if now >= deadline {
                sleeping.store(0, Ordering::Relaxed);
                return Err(ShmError::Timeout);
            }
            let left = (deadline - now).min(Duration::from_millis(100));
            let ts = rustix::thread::Timespec {
                tv_sec: left.as_secs() as i64,
                tv_nsec: left.subsec_nanos() as i64,
            };
            match futex::wait(seq, futex::Flags::empty(), s, Some(&ts)) {
                Ok(()) => {}
                Err(e)
                    if e == rustix::io::Errno::AGAIN
                        || e == rustix::io::Errno::TIMEDOUT
                        || e == rustix::io::Errno::INTR => {}
                Err(e) => {
                    sleeping.store(0, Ordering::Relaxed);
                    return Err(e.into());
                }
            }
            sleeping.store(0, Ordering::Relaxed);
            if ready() {
                return Ok(());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;

    #[test]
    fn a_sleeping_waiter_is_woken_and_a_deadline_is_kept() {
        let seg = Arc::new(Segment::create("wake", 4096).unwrap());
        let w = Arc::new(Wake::new(seg.clone(), 64).unwrap());
        let flag = Arc::new(AtomicBool::new(false));
        let (w2, f2) = (w.clone(), flag.clone());
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            f2.store(true, Ordering::Release);
            w2.notify().unwrap();
        });
        let start = Instant::now();
        w.wait(
            || flag.load(Ordering::Acquire),
            Duration::from_micros(10),
            Instant::now() + Duration::from_secs(5),
        )
        .unwrap();
        assert!(start.elapsed() < Duration::from_secs(5));
        t.join().unwrap();
        let r = w.wait(
            || false,
            Duration::ZERO,
            Instant::now() + Duration::from_millis(30),
        );
        assert!(matches!(r, Err(ShmError::Timeout)));
    }
}
