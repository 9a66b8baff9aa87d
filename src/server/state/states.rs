//! The built-in optimizer's state, saved and loaded from a worker ([`Op::States`],
//! [`Op::LoadStates`]).

use super::PeerId;
use super::{Input, Payload, ServerState, Updater};
use crate::protocol::{status, Msg, Op};
use crate::{DType, NDArray};

impl ServerState {
    /// [`Op::States`]: `key` 0 snapshots the state and answers its length, `key` 1 answers the
    /// snapshot, which must be `len` bytes.
    pub(super) fn states(&mut self, peer: PeerId, m: &Msg) {
        let answer = |bytes: &[u8]| NDArray::from_bytes(&[bytes.len()], DType::U8, bytes);
        let r = match (m.key, &self.updater) {
            (0, Updater::Optimizer(o)) => {
                let snap = o.save_states();
                let len = (snap.len() as u64).to_le_bytes();
                self.snapshots.insert(peer, snap);
                answer(&len)
            }
            (0, _) => {
                return self.err(
                    peer,
                    m,
                    status::FAILED,
                    "this server runs no built-in optimizer (set_optimizer): it has no \
                     optimizer state"
                        .into(),
                )
            }
            (1, _) => match self.snapshots.remove(&peer) {
                Some(snap) if snap.len() as u64 == m.len => answer(&snap),
                _ => {
                    return self.err(
                        peer,
                        m,
                        status::FAILED,
                        format!("no snapshot of the optimizer state {} bytes long", m.len),
                    )
                }
            },
            _ => {
                return self.err(
                    peer,
                    m,
                    status::FAILED,
                    format!("{:?} with key {}", Op::States, m.key),
                )
            }
        };
        match r {
            Ok(a) => self.ok(peer, m, Payload::Array(a)),
            Err(e) => self.err(peer, m, status::FAILED, e.to_string()),
        }
    }

    /// [`Op::LoadStates`]: the data replaces the optimizer's state.
    pub(super) fn load_states(&mut self, peer: PeerId, m: &Msg, payload: &Input<'_>) {
        let r = match (&mut self.updater, payload.bytes()) {
            (Updater::Optimizer(o), Ok(bytes)) => o.load_states(&bytes).map(|_| ()),
            (Updater::Optimizer(_), Err(e)) => Err(e),
            _ => Err(crate::KvError::Unsupported(
                "this server runs no built-in optimizer (set_optimizer) to load a state into"
                    .into(),
            )),
        };
        match r {
            Ok(()) => self.ok(peer, m, Payload::None),
            Err(e) => self.err(peer, m, status::FAILED, e.to_string()),
        }
    }
}
