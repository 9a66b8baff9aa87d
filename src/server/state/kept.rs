//! A sync round's first push, kept where it lies: in a receive slot, or in the worker's own
//! pages, held past its message ([`kvstore_transport::Lent::hold`]).

use kvstore_transport::Held;

use super::{Input, PeerData, PeerId};
use crate::{DType, NDArray};

/// What keeps a kept push's memory: the loop, or the backend.
pub(super) enum From {
    /// Receive slot `id` of the loop's pool: the loop keeps that slot's memory alive and out
    /// of the pool (no worker is credited with it) until the state machine names it in
    /// [`super::ServerState::take_released`].
    Slot(usize),
    /// A message's data in worker `worker`'s pages, held (its mapping alive) until the loop
    /// gives it back to its backend ([`super::ServerState::take_released_held`]).
    Held {
        peer: PeerId,
        worker: usize,
        held: Held,
    },
}

/// A push's data kept where it lies, `len` elements of `dtype` at `ptr`.
pub(super) struct Kept {
    pub(super) from: From,
    ptr: usize,
    len: usize,
    dtype: DType,
}

impl Kept {
    pub(super) fn of(p: &PeerData<'_>, id: usize) -> Kept {
        let (ptr, len, dtype) = p.raw();
        Kept {
            from: From::Slot(id),
            ptr: ptr as usize,
            len,
            dtype,
        }
    }

    /// `p`'s data, from worker `worker` on `peer`, held by its backend (`None` where it
    /// cannot be held).
    pub(super) fn held(p: &PeerData<'_>, peer: PeerId, worker: usize) -> Option<Kept> {
        // All of the message's data (`PeerData::of_whole`): what the hold keeps.
        let held = p.hold()?;
        let (ptr, len, dtype) = p.raw();
        Some(Kept {
            from: From::Held { peer, worker, held },
            ptr: ptr as usize,
            len,
            dtype,
        })
    }

    /// Whether it lies in the pages of worker `rank` (held there).
    pub(super) fn held_from(&self, rank: usize) -> bool {
        matches!(self.from, From::Held { worker, .. } if worker == rank)
    }

    /// `dst = kept + next`.
    pub(super) fn sum_with(&self, next: &Input<'_>, dst: &mut NDArray) -> crate::Result<()> {
        // SAFETY: the loop (a slot) or the backend (held data) keeps the memory, `len` elements
        // of `dtype` at `ptr`, alive, and its worker uncredited or unanswered, until this
        // machine releases it (`From`'s contract); it is read only through copies and sums,
        // since a peer could still write it.
        let first = unsafe { PeerData::new(self.ptr as *const u8, self.len, self.dtype) };
        match next {
            Input::Peer(p, _) => first.sum_with(p, dst),
            Input::Owned(a) => {
                let b = a.as_bytes();
                // SAFETY: `a` is this process's array, valid for its bytes while borrowed here.
                let next = unsafe { PeerData::new(b.as_ptr(), a.size(), a.dtype()) };
                first.sum_with(&next, dst)
            }
        }
    }
}
