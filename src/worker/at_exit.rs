//! A worker that ends its process with `std::process::exit` runs no destructor: the links of
//! the process's live workers to the scheduler are kept here, and an `atexit` handler tells
//! the scheduler each one finished. (Whether the job then goes on is the scheduler's to say:
//! a round that waits on the worker fails, naming it.)

use std::net::TcpStream;
use std::sync::{Arc, Mutex, Once};

use kvstore_transport::tcp::blocking::write_frame;
use kvstore_transport::FrameHeader;

use crate::protocol::{Msg, Op};

/// A worker's number, its link to the scheduler, the lock of that link's writes, and the
/// process that made it (a child made by fork inherits the list but must not speak).
type Link = (u64, TcpStream, Arc<Mutex<()>>, u32);
static LINKS: Mutex<Vec<Link>> = Mutex::new(Vec::new());
static REGISTER: Once = Once::new();
static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

extern "C" fn finish_all() {
    // Never blocks on a lock held by a thread the exit interrupted.
    let Ok(mut links) = LINKS.try_lock() else {
        return;
    };
    let me = std::process::id();
    for (_, mut s, lock, pid) in links.drain(..) {
        if pid != me {
            continue;
        }
        // The heartbeat thread may be writing a beat (microseconds): the lock is tried
        // for a bounded while, so that a clean exit is not taken for a lost worker.
        let deadline = std::time::Instant::now() + std::time::Duration::from_millis(200);
        let g = loop {
            match lock.try_lock() {
                Ok(g) => break Some(g),
                Err(_) if std::time::Instant::now() < deadline => {
                    std::thread::sleep(std::time::Duration::from_millis(1))
                }
                Err(_) => break None,
            }
        };
        let Some(_g) = g else { continue };
        let h = FrameHeader::new(Msg::new(Op::Finish).encode(), 0);
        let _ = write_frame(&mut s, &h, &[]);
    }
}

/// Keeps `sched` (a clone of a worker's link) to be told at exit; returns its number.
pub(super) fn keep(sched: TcpStream, lock: Arc<Mutex<()>>) -> u64 {
    REGISTER.call_once(|| {
        // SAFETY: registers a plain `extern "C" fn` of no arguments, as atexit(3) takes;
        // it touches only statics that live as long as the process.
        unsafe { libc::atexit(finish_all) };
    });
    let id = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    LINKS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push((id, sched, lock, std::process::id()));
    id
}

/// The worker `id` said it finished itself.
pub(super) fn forget(id: u64) {
    LINKS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .retain(|l| l.0 != id);
}
