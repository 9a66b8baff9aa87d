//! Pushes of packed (2-bit compressed) values: unpacked into the server's own buffer, which
//! the push then is, as if the value had come whole.

use super::{Input, PeerId, ServerState};
use crate::protocol::{status, Msg};
use crate::{Compression, DType, NDArray};

/// The buffers of unpacking: the packed bytes, copied out of a peer's pages (a sixteenth of
/// the value), and the value they stand for.
pub(in crate::server) struct Unpacked {
    bytes: Vec<u8>,
    value: NDArray,
}

impl Default for Unpacked {
    fn default() -> Self {
        Unpacked {
            bytes: Vec::new(),
            value: NDArray::placeholder(DType::F32),
        }
    }
}

impl Unpacked {
    /// The value of the `m.len` elements that `payload` packs.
    fn unpack(&mut self, c: Compression, m: &Msg, payload: &Input<'_>) -> crate::Result<()> {
        self.bytes.clear();
        match payload {
            Input::Owned(a) => self.bytes.extend_from_slice(a.as_bytes()),
            Input::Peer(p, _) => p.append_to(&mut self.bytes),
        }
        self.value.reset_as(&[m.len as usize], DType::F32);
        c.dequantize(&self.bytes, self.value.as_mut_slice::<f32>()?)
    }
}

impl ServerState {
    /// A push or pushpull: its value, or ([`crate::protocol::flags::PACKED`]) the value its
    /// packed data stands for. A packed push is checked against its key before it is
    /// unpacked; it is then the server's own array, never kept in a receive slot.
    pub(super) fn push(&mut self, peer: PeerId, worker: usize, m: &Msg, payload: Input<'_>) {
        let Some(c) = m.compression() else {
            return self.push_value(peer, worker, m, payload);
        };
        if let Err((code, text)) = self.check_slot(m) {
            return self.err(peer, m, code, text);
        }
        let mut un = std::mem::take(&mut self.unpacked);
        match un.unpack(c, m, &payload) {
            Ok(()) => self.push_value(peer, worker, m, Input::Owned(&mut un.value)),
            Err(e) => self.err(peer, m, status::MISMATCH, e.to_string()),
        }
        self.unpacked = un;
    }
}
