//! A sync round's first push, kept where it lies in a receive slot.

use super::{Input, PeerData};
use crate::{DType, NDArray};

/// A push's data kept in receive slot `id` of the loop's pool: the loop keeps that slot's
/// memory alive and out of the pool (no worker is credited with it) until the state machine
/// names it in [`super::ServerState::take_released`].
pub(super) struct Kept {
    pub(super) id: usize,
    ptr: usize,
    len: usize,
    dtype: DType,
}

impl Kept {
    pub(super) fn of(p: &PeerData<'_>, id: usize) -> Kept {
        let (ptr, len, dtype) = p.raw();
        Kept {
            id,
            ptr: ptr as usize,
            len,
            dtype,
        }
    }

    /// `dst = kept + next`.
    pub(super) fn sum_with(&self, next: &Input<'_>, dst: &mut NDArray) -> crate::Result<()> {
        // SAFETY: the loop keeps the slot's memory, `len` elements of `dtype` at `ptr`, alive
        // and uncredited until this machine releases it (`Kept`'s contract); it is read only
        // through copies and sums, since a peer could still write it.
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
