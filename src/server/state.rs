//! The server's protocol state machine: no sockets, no clocks.
//!
//! Requests go in through [`ServerState::handle`] with the peer they came from; answers come out
//! of [`ServerState::outbox`], addressed to peers. The I/O loop ([`super::server`]) only moves
//! bytes; everything about `dist_sync` rounds, slices and updaters is decided here, and tested
//! here without I/O.

use rustc_hash::FxHashMap;

use crate::optimizer::{Optimizer, OptimizerUpdater};
use crate::protocol::{status, Msg, Op};
use crate::registry;
pub use crate::server::peer_data::PeerData;
use crate::{DType, NDArray};

/// A connection, as the I/O layer numbers them.
pub type PeerId = usize;

/// The payload of an outgoing frame.
#[derive(Clone, Debug)]
pub enum Payload {
    /// No payload.
    None,
    /// Tensor data (a copy-on-write clone of the stored value: later updates never touch it).
    Array(NDArray),
    /// Text (error messages).
    Text(Vec<u8>),
}

/// An outgoing frame.
#[derive(Debug)]
pub struct Out {
    /// The connection it goes to.
    pub to: PeerId,
    /// Its metadata.
    pub msg: Msg,
    /// Its payload.
    pub payload: Payload,
}

pub use input::Input;

/// A push waiting for its round to complete.
struct Held {
    peer: PeerId,
    req: Msg,
}

/// One key (or this server's slice of it).
struct Slot {
    stored: NDArray,
    /// The sum of this round's pushes (dist_sync).
    merge: Option<NDArray>,
    pushed: Vec<bool>,
    count: usize,
    held: Vec<Held>,
    /// Pulls that came after their worker's own push in this round (sync): answered when the
    /// round completes, so a worker sees what it pushed, as MXNet's engine orders a pull
    /// after the push before it (`push_async`, then `pull`).
    behind: Vec<Held>,
    total: u64,
    start: u64,
    /// The whole tensor's shape, as rank 0's init gave it: every request must name it.
    shape: ([u64; crate::protocol::MAX_NDIM], u8),
    /// The other buffer of the double buffer: a value an answer's put still reads stays
    /// there, untouched, while the update writes this one.
    spare: Option<NDArray>,
    /// A sync round's first push, kept where it lies in a receive slot until the next push
    /// is summed with it in one pass (rather than copied, then summed with).
    first: Option<Kept>,
    /// Pushes of workers that pushed this round already (`push_async`, then a push of the
    /// same key), at most one each, kept for the next round, as MXNet's engine runs one key's
    /// pushes in order; and the pulls that came after them, answered by that round.
    next: Vec<Deferred>,
    behind_next: Vec<Held>,
    /// Why the value is gone, where an updater replaced it with another shape or dtype:
    /// every later request of the key is refused, saying so.
    lost: Option<String>,
}

/// A push held for the round after the one in progress, its value copied.
struct Deferred {
    worker: usize,
    held: Held,
    value: NDArray,
}

/// Makes the server's arrays (stored values, merge and spare buffers), zeroed: the loop puts
/// them where its answers can be sent from by reference, while there is room (`None`: no room,
/// an ordinary array instead).
pub type Alloc = Box<dyn FnMut(&[usize], DType) -> Option<NDArray>>;

fn new_array(alloc: &mut Option<Alloc>, shape: &[usize], dtype: DType) -> NDArray {
    alloc
        .as_mut()
        .and_then(|f| f(shape, dtype))
        .unwrap_or_else(|| NDArray::zeros_dtype(shape, dtype))
}

/// Makes `a` writable in place without disturbing an answer whose put still reads it: if a
/// clone pins its storage, `a` moves to the spare buffer (with its values copied over if `keep`)
/// and the pinned buffer becomes the spare, to be written again once the put let go of it.
/// With no pin, nothing happens; so a stored value is never copied just because a reply holds
/// it, and the update never allocates.
fn unpin(
    a: &mut NDArray,
    spare: &mut Option<NDArray>,
    keep: bool,
    alloc: &mut Option<Alloc>,
) -> crate::Result<()> {
    if a.is_unique() {
        return Ok(());
    }
    let mut other = spare
        .take()
        .and_then(|mut s| {
            let fits = s.nbytes() == a.nbytes() && s.dtype() == a.dtype() && s.is_unique();
            fits.then_some(s)
        })
        .unwrap_or_else(|| new_array(alloc, a.shape(), a.dtype()));
    if keep {
        other.copy_from(a)?;
    }
    *spare = Some(std::mem::replace(a, other));
    Ok(())
}

/// The state of one server.
pub struct ServerState {
    num_workers: usize,
    sync: bool,
    slots: FxHashMap<u64, Slot>,
    updater: Updater,
    failed: Option<String>,
    /// Workers gone from the job, and why: a sync round they have not pushed cannot complete.
    /// (Usually empty: a push looks at no one.)
    gone: Vec<(usize, String)>,
    /// Each key's bytes, once initialised, shared with the admission of TCP messages
    /// ([`admission`]).
    sizes: Option<Sizes>,
    alloc: Option<Alloc>,
    /// What this server counted.
    metrics: crate::metrics::ServerMetrics,
    /// Snapshots of the optimizer's state, by the connection that asked ([`Op::States`]).
    snapshots: FxHashMap<PeerId, Vec<u8>>,
    /// The receive slot the last request's data was kept in ([`ServerState::take_kept`]).
    kept: Option<usize>,
    /// Receive slots kept earlier whose data was consumed ([`ServerState::take_released`]).
    released: Vec<usize>,
    /// Messages' data held earlier and consumed ([`ServerState::take_released_held`]).
    released_held: Vec<(PeerId, kvstore_transport::Held)>,
    /// Frames to send, in order.
    pub outbox: Vec<Out>,
    /// Where packed pushes are unpacked.
    unpacked: Unpacked,
}

use super::admission::Sizes;

fn reply(req: &Msg) -> Msg {
    let mut m = *req;
    m.op = Op::Reply;
    m.status = status::OK;
    m.flags = 0;
    m.aux = 0;
    m
}

impl ServerState {
    /// A server for `num_workers` workers, in sync or async mode.
    pub fn new(num_workers: usize, sync: bool) -> Self {
        ServerState {
            num_workers,
            sync,
            slots: FxHashMap::default(),
            updater: Updater::Assign,
            failed: None,
            gone: Vec::new(),
            sizes: None,
            alloc: None,
            metrics: Default::default(),
            snapshots: FxHashMap::default(),
            kept: None,
            released: Vec::new(),
            released_held: Vec::new(),
            outbox: Vec::new(),
            unpacked: Unpacked::default(),
        }
    }

    /// Shares each key's bytes, once initialised, with `sizes` ([`admission`]).
    pub fn share_sizes(&mut self, sizes: Sizes) {
        self.sizes = Some(sizes);
    }

    /// Makes the server's arrays with `alloc` from now on.
    pub fn set_alloc(&mut self, alloc: Alloc) {
        self.alloc = Some(alloc);
    }

    /// The receive slot whose data the last [`ServerState::handle`] kept (its
    /// [`Input::Peer`] named it): the loop keeps it out of the pool until it is released.
    /// Any other slot's data was read in full, and the slot is free.
    pub fn take_kept(&mut self) -> Option<usize> {
        self.kept.take()
    }

    /// Receive slots kept earlier whose data is consumed (summed, or its round failed): free.
    pub fn take_released(&mut self) -> std::vec::Drain<'_, usize> {
        self.released.drain(..)
    }

    /// Messages' data held earlier ([`kvstore_transport::Lent::hold`]) and consumed: for the
    /// loop to give back to their backends ([`kvstore_transport::Backend::release`]).
    pub fn take_released_held(&mut self) -> std::vec::Drain<'_, (PeerId, kvstore_transport::Held)> {
        self.released_held.drain(..)
    }

    /// Lets go of a kept push: its slot back to the pool, or its held data to its backend.
    fn release_kept(&mut self, k: Kept) {
        match k.from {
            kept::From::Slot(id) => self.released.push(id),
            kept::From::Held { peer, held, .. } => self.released_held.push((peer, held)),
        }
    }

    /// What this server counted: rounds, pushes, pulls, bytes, and pushes that waited for
    /// their round's stragglers.
    pub fn metrics(&self) -> crate::metrics::ServerMetrics {
        self.metrics.clone()
    }

    /// Why the server stopped serving, if it did.
    pub fn failed(&self) -> Option<&str> {
        self.failed.as_deref()
    }

    /// The stored value of a key's slice (for tests).
    #[cfg(test)]
    pub fn stored(&self, key: u64) -> Option<&NDArray> {
        self.slots.get(&key).map(|s| &s.stored)
    }

    fn ok(&mut self, peer: PeerId, req: &Msg, payload: Payload) {
        if let Payload::Array(a) = &payload {
            self.metrics.pulls += 1;
            self.metrics.bytes_out += a.nbytes() as u64;
        }
        self.outbox.push(Out {
            to: peer,
            msg: reply(req),
            payload,
        });
    }

    fn err(&mut self, peer: PeerId, req: &Msg, code: u16, text: String) {
        let mut m = reply(req);
        m.status = code;
        self.outbox.push(Out {
            to: peer,
            msg: m,
            payload: Payload::Text(text.into_bytes()),
        });
    }

    /// Handles one request from `worker` (the rank authenticated on connection `peer`).
    /// `payload` holds the frame's payload: tensor data of the request's dtype for data
    /// requests, bytes (`u8`) otherwise. The server may take an owned buffer (leaving another
    /// one of any size in its place), so a received tensor becomes the stored or merged value
    /// without a copy; a peer's pages are summed where they lie, or copied.
    pub fn handle<'p>(
        &mut self,
        peer: PeerId,
        worker: usize,
        m: &Msg,
        payload: impl Into<Input<'p>>,
    ) {
        let payload = payload.into();
        if let Some(why) = &self.failed {
            let why = why.clone();
            return self.err(peer, m, status::PEER_LOST, why);
        }
        match m.op {
            Op::Init => self.init(peer, m, &payload),
            Op::Push | Op::PushPull => self.push(peer, worker, m, payload),
            Op::Pull => self.pull(peer, worker, m),
            Op::States => self.states(peer, m),
            Op::LoadStates => self.load_states(peer, m, &payload),
            Op::SetOptimizer => {
                let bytes = match payload.bytes() {
                    Ok(b) => b,
                    Err(e) => return self.err(peer, m, status::FAILED, e.to_string()),
                };
                if m.key == crate::worker::ADD_MULTS {
                    // Multipliers of keys initialised since: for the optimizer it runs, if any.
                    let added = match &mut self.updater {
                        Updater::Optimizer(u) => u.add_mults(&bytes),
                        _ => Ok(()),
                    };
                    return match added {
                        Ok(()) => self.ok(peer, m, Payload::None),
                        Err(e) => self.err(peer, m, status::FAILED, e.to_string()),
                    };
                }
                match Optimizer::decode_with_mults(&bytes) {
                    Ok(o) => {
                        self.updater = Updater::Optimizer(Box::new(OptimizerUpdater::new(o)));
                        self.ok(peer, m, Payload::None);
                    }
                    Err(e) => self.err(peer, m, status::FAILED, e.to_string()),
                }
            }
            Op::SetUpdater => {
                let name = match payload.bytes() {
                    Ok(b) => String::from_utf8_lossy(&b).into_owned(),
                    Err(e) => return self.err(peer, m, status::FAILED, e.to_string()),
                };
                match registry::lookup(&name) {
                    Ok(f) => {
                        self.updater = Updater::Named(name, f);
                        self.ok(peer, m, Payload::None);
                    }
                    Err(e) => self.err(
                        peer,
                        m,
                        status::FAILED,
                        format!(
                            "{e} on this server: register_updater must run before \
                             kvstore::create in every process (a server's create does not \
                             return)"
                        ),
                    ),
                }
            }
            other => self.err(
                peer,
                m,
                status::FAILED,
                format!("a server does not take {other:?} requests"),
            ),
        }
    }

    fn init(&mut self, peer: PeerId, m: &Msg, payload: &Input<'_>) {
        if self.slots.contains_key(&m.key) {
            return self.err(
                peer,
                m,
                status::DOUBLE_INIT,
                format!("key {} is already initialised", m.key),
            );
        }
        // The shape every later request is checked against must hold the key's elements.
        let elements = m
            .shape
            .get(..usize::from(m.ndim))
            .and_then(|d| d.iter().try_fold(1u64, |a, &x| a.checked_mul(x)));
        if elements != Some(m.total) {
            let text = format!(
                "key {}: an init of shape {:?} for {} elements",
                m.key,
                m.shape.get(..usize::from(m.ndim)).unwrap_or_default(),
                m.total
            );
            return self.err(peer, m, status::MISMATCH, text);
        }
        // A fresh array: the connection's receive buffer is reused for the next frame.
        let mut stored = new_array(&mut self.alloc, &[m.len as usize], m.dtype);
        if let Err(e) = payload.copy_into(&mut stored) {
            return self.err(peer, m, status::MISMATCH, e.to_string());
        }
        if let Some(sizes) = &self.sizes {
            let bytes = stored.nbytes() as u64;
            sizes
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(m.key, bytes);
        }
        self.slots.insert(
            m.key,
            Slot {
                stored,
                merge: None,
                pushed: vec![false; self.num_workers],
                count: 0,
                held: Vec::new(),
                behind: Vec::new(),
                total: m.total,
                start: m.start,
                shape: (m.shape, m.ndim),
                spare: None,
                first: None,
                next: Vec::new(),
                behind_next: Vec::new(),
                lost: None,
            },
        );
        self.ok(peer, m, Payload::None);
    }

    /// Finds the slot of a request and checks that the request names it exactly.
    fn check_slot(&self, m: &Msg) -> Result<(), (u16, String)> {
        let Some(s) = self.slots.get(&m.key) else {
            return Err((
                status::UNKNOWN_KEY,
                format!("key {} has not been initialised", m.key),
            ));
        };
        if let Some(why) = &s.lost {
            let text = format!("key {}: {why}, so its value is lost", m.key);
            return Err((status::FAILED, text));
        }
        if s.total != m.total || !rows::names(m, s.start, s.stored.size() as u64) {
            return Err((
                status::MISMATCH,
                format!(
                    "key {}: this server holds elements {}..{} of {}, the request names {}..{} of {}",
                    m.key,
                    s.start,
                    s.start + s.stored.size() as u64,
                    s.total,
                    m.start,
                    m.start.saturating_add(m.len),
                    m.total
                ),
            ));
        }
        let (shape, ndim) = (&s.shape.0[..s.shape.1.into()], usize::from(m.ndim));
        if m.shape.get(..ndim) != Some(shape) {
            // Of the same size, or the slice check above would have refused it: a worker
            // that initialised the key with another shape than rank 0's, whose value the
            // store kept (MXNet's servers check the size alone).
            return Err((
                status::MISMATCH,
                format!(
                    "key {}: of shape {shape:?}, the request names {:?}",
                    m.key,
                    m.shape.get(..ndim).unwrap_or_default()
                ),
            ));
        }
        if s.stored.dtype() != m.dtype {
            return Err((
                status::MISMATCH,
                format!(
                    "key {}: stored as {}, the request names {}",
                    m.key,
                    s.stored.dtype(),
                    m.dtype
                ),
            ));
        }
        Ok(())
    }

    fn pull(&mut self, peer: PeerId, worker: usize, m: &Msg) {
        if let Err((code, text)) = self.check_slot(m) {
            return self.err(peer, m, code, text);
        }
        let Some(slot) = self.slots.get_mut(&m.key) else {
            return;
        };
        // After this worker's own push of the round: the round's result, once it is in (after
        // its push held for the next round: that round's).
        if slot.next.iter().any(|d| d.worker == worker) {
            slot.behind_next.push(Held { peer, req: *m });
            return;
        }
        if slot.pushed.get(worker).copied().unwrap_or(false) {
            slot.behind.push(Held { peer, req: *m });
            return;
        }
        match rows::pulled(&slot.stored, slot.start, m) {
            Ok(p) => self.ok(peer, m, p),
            Err(e) => self.err(peer, m, status::FAILED, e),
        }
    }
}

mod input;
mod kept;
mod leave;
mod packed;
mod push;
mod round;
mod rows;
mod states;
mod updater;

use kept::Kept;
use packed::Unpacked;
use updater::{apply, Updater};

#[cfg(test)]
#[path = "state_lost_tests.rs"]
mod lost_tests;
#[cfg(test)]
#[path = "state_tests.rs"]
mod tests;
