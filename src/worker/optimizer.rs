//! The built-in optimizer a worker sends the servers, with its per-key multipliers by the
//! numbers the servers know keys by.

use crate::optimizer::{encode_mults, Optimizer};
use crate::protocol::{Msg, Op};
use crate::worker::DistWorker;
use crate::{Key, KvError, Multiplied, Result};

/// The most an optimizer and its multipliers take on the wire (a control message).
const MAX_OPTIMIZER_BYTES: usize = 28 * 1024;

/// [`Msg::key`] of a [`Op::SetOptimizer`] that adds multipliers to the optimizer the servers
/// run (its parameters and state kept); its payload is the multipliers alone.
pub(crate) const ADD_MULTS: u64 = 1;

impl DistWorker {
    /// Rank 0 sends the optimizer to every server: its parameters, then its multipliers of
    /// the keys initialised so far, by number; every worker waits until it is in place.
    ///
    /// The multipliers of keys initialised later go to the servers at their init, as MXNet's
    /// Trainer sets the optimizer before it initialises the keys (every worker makes the same
    /// calls, so every worker knows when). Multipliers for keys of the other kind than the
    /// store's cannot apply and are left out (the parameter names that `param_idx2name` maps
    /// to int keys, say).
    pub(crate) fn set_optimizer(&mut self, opt: &Multiplied) -> Result<()> {
        // (`KVStore::set_optimizer` checked the multipliers.)
        Optimizer::decode(&opt.opt.encode())?;
        let mut payload = opt.encode_head();
        let mults = self.numbered_mults(opt, payload.len(), |_| true)?;
        if payload.len() + mults.len() > MAX_OPTIMIZER_BYTES {
            return Err(KvError::Unsupported(format!(
                "the optimizer takes {} bytes with its scheduler and multipliers: at most {} \
                 travel to the servers",
                payload.len() + mults.len(),
                MAX_OPTIMIZER_BYTES
            )));
        }
        payload.extend(mults);
        self.broadcast(Op::SetOptimizer, &payload, false)?;
        self.optimizer = Some(opt.clone());
        Ok(())
    }

    /// After `new` keys were initialised: the optimizer's multipliers of them go to the
    /// servers, added to what they run.
    pub(super) fn mults_of_new_keys(&mut self, new: &[&Key]) -> Result<()> {
        let Some(opt) = self.optimizer.take() else {
            return Ok(());
        };
        let head = opt.encode_head().len();
        let result = self.numbered_mults(&opt, head, |k| new.contains(&k));
        let result = match result {
            Ok(entries) if entries.is_empty() => Ok(()),
            Ok(entries) => {
                let mut m = Msg::new(Op::SetOptimizer);
                m.key = ADD_MULTS;
                self.broadcast_msg(m, &entries, false)
            }
            Err(e) => Err(e),
        };
        self.optimizer = Some(opt);
        result
    }

    /// `opt`'s multipliers of the initialised keys that `pick` picks, each by its number, for
    /// the wire (none before the store's first init, when the keys' kind is not known): at
    /// most what fits in a message beside the optimizer's `head` bytes.
    fn numbered_mults(
        &self,
        opt: &Multiplied,
        head: usize,
        pick: impl Fn(&Key) -> bool,
    ) -> Result<Vec<u8>> {
        let numbered: Vec<(u64, (f64, f64))> = opt
            .mults
            .entries()
            .filter(|(k, _)| pick(k))
            .filter_map(|(k, m)| self.keys.get(k).map(|info| (info.id, m)))
            .collect();
        let bytes = encode_mults(numbered);
        if bytes.len() + head > MAX_OPTIMIZER_BYTES {
            return Err(KvError::Unsupported(format!(
                "multipliers for {} keys: at most {} travel to the servers with this optimizer",
                bytes.len() / 24,
                MAX_OPTIMIZER_BYTES.saturating_sub(head) / 24
            )));
        }
        Ok(bytes)
    }
}
