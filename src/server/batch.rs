//! Answers to batched requests go back as batches ([`crate::protocol::batch`]): the answers
//! waiting at the front of a worker's backlog whose requests came in batches, as many as one
//! batch holds, their values copied into one region that the worker reads them from.

use std::collections::VecDeque;

use kvstore_transport::{Access, Backend, Sent, Token, TransportError};

use crate::net::{alloc, Addr};
use crate::protocol::batch::{Writer, TEXT_MAX};
use crate::protocol::{flags, status};
use crate::server::peers::Pending;
use crate::server::state::Payload;

/// Sends the batched answers at the front of `backlog` (its first is one) as one batch to
/// `addr`: how many went (0: the link is full).
pub(super) fn send_batch(
    b: &mut dyn Backend,
    addr: &Addr,
    backlog: &VecDeque<Pending>,
    w: &mut Writer,
) -> Result<usize, TransportError> {
    w.clear(0);
    let max_body = b.max_body();
    // The answers that fit, and where each one's value goes in the batch's data.
    let mut values = Vec::new();
    for p in backlog.iter().take_while(|p| p.batched) {
        let mut m = p.out.msg;
        let (text, value): (&[u8], _) = match &p.out.payload {
            Payload::Array(a) if m.status == status::OK => {
                if Some(a.nbytes() as u64) != m.value_bytes() {
                    // Never so: the state machine answers with the slice asked for.
                    return Err(TransportError::Refused(format!(
                        "an answer of {} bytes for a slice of {:?}",
                        a.nbytes(),
                        m.value_bytes()
                    )));
                }
                m.flags |= flags::DATA;
                (&[], Some(a))
            }
            Payload::Text(t) => (crate::format::cut_text(t, TEXT_MAX), None),
            _ => (&[], None),
        };
        let bytes = value.map_or(0, |a| a.nbytes());
        if !w.room(text.len(), bytes, max_body) {
            break;
        }
        let at = w.add(&m, text);
        if let Some(a) = value {
            values.push((at, a));
        }
    }
    let n = w.count();
    let region = match w.data_len() {
        0 => None,
        len => Some(alloc(b, len, Access::Send)?),
    };
    if let Some(r) = &region {
        for (at, a) in values {
            // SAFETY: the region is new and this batch's alone: no backend reads or writes it
            // before the send below.
            unsafe { r.write(at.start, a.as_bytes()) }?;
        }
    }
    let data = region.as_ref().map(|r| (r, 0..r.len(), Token(0)));
    // SAFETY: nothing writes the batch's region after this; the backend holds it until the
    // send is complete.
    Ok(match unsafe { b.send(addr.peer, w.finish(), data) }? {
        Sent::Posted => n,
        Sent::WouldBlock => 0,
    })
}
