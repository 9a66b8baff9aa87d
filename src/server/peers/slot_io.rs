//! The receive slots as the loop drives them: requests whose data lies in a slot, slots kept
//! by the state machine and given back, and the credits replies carry.

use kvstore_transport::{Region, RemoteRegion};

use super::Workers;
use crate::net::{alloc, Addr, Net};
use crate::protocol::{flags, Msg};
use crate::server::slots::{Credit, Domain, PutAction};
use crate::server::state::{Input, Out, PeerData, ServerState};

/// A receive slot's bytes as the data of request `m`.
pub(super) fn slot_data<'a>(region: &'a Region, m: &Msg) -> Result<PeerData<'a>, String> {
    if m.data_bytes() != Some(region.len() as u64) {
        return Err("a slot of another size".into());
    }
    let (n, dtype) = m.payload_layout();
    // SAFETY: the region is `n * dtype.size()` bytes (`data_bytes`, checked) of live storage,
    // held by the slot for the borrow; a worker writes it only with its credit, which no
    // worker holds while the server reads (and reads are copies or in-place sums, never
    // slices).
    Ok(unsafe { PeerData::new(region.storage().ptr(), n, dtype) })
}

impl Workers {
    /// Hands the state machine request `m`, whose data lies in receive slot `id`; the slot is
    /// then free, or kept ([`Workers::after_slot`]); a slot whose memory cannot be read is
    /// given back, and the request breaks the protocol.
    pub(super) fn serve_slot(
        &mut self,
        state: &mut ServerState,
        addr: Addr,
        rank: usize,
        m: &Msg,
        id: usize,
    ) -> Result<(), String> {
        let served = match self.slots.mem_of(id) {
            Some(mem) => slot_data(mem, m)
                .map(|p| state.handle(addr.id(), rank, m, Input::Peer(&p, Some(id)))),
            None => Err("a slot that is gone".into()),
        };
        match served {
            Ok(()) => {
                self.after_slot(state, id);
                Ok(())
            }
            Err(e) => {
                self.slots.give_back(id);
                Err(e)
            }
        }
    }

    /// A request whose data lay in receive slot `id` was handled: the slot is free unless
    /// the state machine kept its data (until it releases it, [`ServerState::take_released`]).
    pub(super) fn after_slot(&mut self, state: &mut ServerState, id: usize) {
        if state.take_kept() != Some(id) {
            self.slots.give_back(id);
        }
        for id in state.take_released() {
            self.slots.give_back(id);
        }
    }

    /// A push put into a receive slot: handled where it landed.
    pub(super) fn slot_put(
        &mut self,
        state: &mut ServerState,
        addr: Addr,
        grant: u64,
        offset: usize,
        len: usize,
        imm: u32,
    ) -> Result<(), String> {
        let Some(rank) = self.peers.get(&addr).and_then(|w| w.rank) else {
            return Err("a put before the hello".into());
        };
        let (action, id, _) = self.slots.on_put(addr.id(), grant, offset, len, imm)?;
        match action {
            PutAction::Push(m) => self.serve_slot(state, addr, rank, &m, id),
            PutAction::Wait => Ok(()),
        }
    }

    /// The receive slot credit a reply carries, if any: a buffer of the pool, made and granted
    /// to the worker as needed; the reply is flagged.
    pub(super) fn credit(&mut self, net: &mut Net, out: &mut Out) -> Option<RemoteRegion> {
        let addr = Addr::from_id(out.to);
        let domain = addr.medium as Domain;
        let (id, region) = match self.slots.credit(out.to, domain, &out.msg) {
            Credit::None => return None,
            Credit::Granted(g) => {
                out.msg.flags |= flags::SLOT;
                return Some(g);
            }
            Credit::Grant(id, region) => (id, region),
            Credit::Make(bytes) => match net.backend(addr.medium) {
                // Landing pages where the medium has them: a put is then a plain copy.
                Ok(b) => match alloc(b, bytes, kvstore_transport::Access::Land) {
                    Ok(r) => (self.slots.made(r.clone(), domain, bytes), r),
                    Err(e) => {
                        tracing::warn!("no receive slot of {bytes} bytes: {e}");
                        self.slots.not_made(bytes);
                        return None;
                    }
                },
                Err(_) => {
                    self.slots.not_made(bytes);
                    return None;
                }
            },
        };
        // SAFETY: the server reads the slot only after a put into it arrived and before its
        // buffer is credited again, and never writes it.
        let grant = net
            .backend(addr.medium)
            .ok()
            .and_then(|b| unsafe { b.grant(addr.peer, &region, 0..region.len()) }.ok());
        match grant {
            Some(g) => {
                self.slots.granted(out.to, id, g.id(), g);
                out.msg.flags |= flags::SLOT;
                Some(g)
            }
            None => {
                self.slots.not_granted(id);
                None
            }
        }
    }
}
