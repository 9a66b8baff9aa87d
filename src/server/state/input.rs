//! A request's payload as the server's state machine takes it.

use super::{PeerData, PeerId, ServerState};
use crate::protocol::{status, Msg};
use crate::NDArray;

/// A request's payload, as the I/O layer received it.
pub enum Input<'a> {
    /// In this server's own receive buffer: it may become the stored or merged value without
    /// a copy (another buffer is left in its place).
    Owned(&'a mut NDArray),
    /// Lent by the transport, possibly in a peer's pages: read through copies or in-place
    /// sums only. With the number of the receive slot it lies in, if it does: a sync round's
    /// first push may be kept there until the round's next push is summed with it
    /// ([`super::ServerState::take_kept`]).
    Peer(&'a PeerData<'a>, Option<usize>),
}

impl<'a> From<&'a mut NDArray> for Input<'a> {
    fn from(a: &'a mut NDArray) -> Self {
        Input::Owned(a)
    }
}

impl Input<'_> {
    pub(super) fn bytes(&self) -> crate::Result<Vec<u8>> {
        match self {
            Input::Owned(a) => Ok(a.as_bytes().to_vec()),
            Input::Peer(p, _) => Ok(p.to_bytes()),
        }
    }

    pub(super) fn copy_into(&self, dst: &mut NDArray) -> crate::Result<()> {
        match self {
            Input::Owned(a) => dst.copy_from(a),
            Input::Peer(p, _) => p.copy_into(dst),
        }
    }

    pub(super) fn add_into(&self, dst: &mut NDArray) -> crate::Result<()> {
        match self {
            Input::Owned(a) => dst.add_assign(a),
            Input::Peer(p, _) => p.add_into(dst),
        }
    }

    /// The payload as an array of this process: taken from the receive buffer, or copied
    /// into an array from `alloc` (the transport's memory, which answers can send in place,
    /// as every buffer that may become the stored value is).
    pub(super) fn take(self, alloc: &mut Option<super::Alloc>) -> crate::Result<NDArray> {
        match self {
            Input::Owned(a) => {
                let dtype = a.dtype();
                Ok(std::mem::replace(a, NDArray::placeholder(dtype)))
            }
            Input::Peer(p, _) => {
                let mut a = super::new_array(alloc, &[p.len()], p.dtype());
                p.copy_into(&mut a)?;
                Ok(a)
            }
        }
    }
}

impl ServerState {
    /// Answers a push that came without its data (dropped as it was read, since it does not
    /// fit its key here) with what is wrong with it: the key unknown, or another size.
    pub fn answer_unfit(&mut self, peer: PeerId, m: &Msg) {
        let (code, text) = self.check_slot(m).err().unwrap_or_else(|| {
            let text = "payload length does not match the message".to_string();
            (status::FAILED, text)
        });
        self.err(peer, m, code, text);
    }
}
