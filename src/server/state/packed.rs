//! Pushes of packed (2-bit compressed) values: unpacked into an array of the server's, which
//! the push then is, as if the value had come whole.

use rustc_hash::FxHashMap;

use super::{new_array, Input, PeerId, ServerState};
use crate::protocol::{status, Msg};
use crate::{Compression, DType, NDArray};

/// The buffers of unpacking: the packed bytes, copied out of a peer's pages (a sixteenth of
/// the value), and arrays of the values they stand for, one per length. Such an array is made
/// as the server's other arrays are (where answers are sent from by reference), and a push
/// may swap it for the merge buffer of its key, of the same length and kind: no allocation
/// in steady state, and the stored values stay where they were made.
#[derive(Default)]
pub(in crate::server) struct Unpacked {
    bytes: Vec<u8>,
    values: FxHashMap<usize, NDArray>,
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
        let len = m.len as usize;
        let mut value = self
            .unpacked
            .values
            .remove(&len)
            .and_then(|mut v| {
                let fits = v.is_unique() && v.size() == len && v.dtype() == DType::F32;
                fits.then_some(v)
            })
            .unwrap_or_else(|| new_array(&mut self.alloc, &[len], DType::F32));
        match unpack(c, &payload, &mut self.unpacked.bytes, &mut value) {
            Ok(()) => self.push_value(peer, worker, m, Input::Owned(&mut value)),
            Err(e) => self.err(peer, m, status::MISMATCH, e.to_string()),
        }
        // What the push left in its place (the key's old merge buffer, or a placeholder).
        self.unpacked.values.insert(len, value);
    }
}

/// The value `payload` packs, into `value` (its length): read where it lies when it is this
/// process's, else through `bytes`, a copy (a peer's pages are never viewed as a slice).
fn unpack(
    c: Compression,
    payload: &Input<'_>,
    bytes: &mut Vec<u8>,
    value: &mut NDArray,
) -> crate::Result<()> {
    let out = value.as_mut_slice::<f32>()?;
    match payload {
        Input::Owned(a) => c.dequantize(a.as_bytes(), out),
        Input::Peer(p, _) => {
            bytes.clear();
            p.append_to(bytes);
            c.dequantize(bytes, out)
        }
    }
}
