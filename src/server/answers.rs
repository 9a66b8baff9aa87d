//! Posting one answer to a worker: its value put into the granted destination (once) or,
//! where the worker maps the value's pages, named in the reply; then the reply.

use kvstore_transport::{Sent, Token, TransportError};

use super::peers::{Pending, MAX_CONTROL};
use super::state::Payload;
use crate::net::{region_of, Addr};
use crate::protocol::{flags, slot_imm, status};

/// Posts one answer: the value's put (once), then the reply. `false`: the link is full.
pub(super) fn send(
    b: &mut dyn kvstore_transport::Backend,
    addr: &Addr,
    p: &mut Pending,
    body: &mut Vec<u8>,
) -> Result<bool, TransportError> {
    let follows = p.out.msg.follows_put();
    if let (Payload::Array(a), Some(g), false) = (&p.out.payload, &p.grant, p.put) {
        let region = region_of(b, a)?;
        if b.sends_in_place(&region) {
            // The value lies in pages the worker maps (read-only): the reply names them and
            // the worker copies the value into its destination itself, at memory speed, as an
            // RDMA read would. The region holds the value until the worker lets go of it, and
            // the store writes its values copy-on-write, so nothing changes under the reader.
            let mut m = p.out.msg;
            m.flags |= flags::DATA;
            body.clear();
            body.extend_from_slice(&m.encode());
            if let Some(slot) = &p.slot {
                body.extend_from_slice(&slot.to_bytes());
            }
            let data = Some((&region, 0..a.nbytes(), Token(0)));
            // SAFETY: the value is read only (above) until the token completes.
            return match unsafe { b.send(addr.peer, body, data) }? {
                Sent::Posted => Ok(true),
                Sent::WouldBlock => Ok(false),
            };
        }
        // SAFETY: the stored value is never written through this storage while the put reads
        // it: the region holds a clone of the array's storage, and the store writes its values
        // copy-on-write, so an update after this point writes other memory.
        let sent = unsafe {
            b.put(
                addr.peer,
                &region,
                0..a.nbytes(),
                g,
                0,
                slot_imm(p.out.msg.req_id, follows),
                Token(0),
            )
        };
        match sent {
            Ok(Sent::WouldBlock) => return Ok(false),
            Ok(Sent::Posted) if !follows => return Ok(true),
            Ok(Sent::Posted) => p.put = true,
            // The destination is gone (the worker revoked it after giving up on the call) or
            // was never valid: the answer says so instead.
            Err(TransportError::PeerLost(e)) => return Err(TransportError::PeerLost(e)),
            Err(e) => {
                p.put = true;
                p.out.msg.status = status::FAILED;
                p.out.payload =
                    Payload::Text(format!("the answer was not delivered: {e}").into_bytes());
            }
        }
    }
    let text: &[u8] = match &p.out.payload {
        Payload::Text(t) => crate::format::cut_text(t, MAX_CONTROL),
        _ => &[],
    };
    body.clear();
    body.extend_from_slice(&p.out.msg.encode());
    if let Some(g) = &p.slot {
        body.extend_from_slice(&g.to_bytes());
    }
    body.extend_from_slice(text);
    // SAFETY: no data rides with the reply.
    match unsafe { b.send(addr.peer, body, None) }? {
        Sent::Posted => Ok(true),
        Sent::WouldBlock => Ok(false),
    }
}
