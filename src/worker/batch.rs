//! Batches of a worker's requests: the small value requests to one server that are queued
//! together go as one message ([`crate::protocol::batch`]), their data gathered into one
//! region, and their answers come back as one message, whose values the worker copies into
//! the destinations. A call of many small keys thus costs each server a message or two
//! instead of one message (and a grant) per key. A request on its own, a big value, or a
//! control request goes alone, as before; per server, requests still go out in order.

use kvstore_transport::{Access, Lent, RemoteRegion, Sent, Token};

use super::{Links, Posted};
use crate::protocol::batch::{self, DATA_MAX, ENTRY_LEN, ITEM_MAX};
use crate::protocol::{Msg, Op};
use crate::worker::calls::{Action, Calls, SlotUse};
use crate::{KvError, Result};
use kvstore_transport::META_LEN;

/// The requests gathered for one server's next batch: their places in the queue.
#[derive(Default)]
struct Open {
    idx: Vec<usize>,
    data: usize,
}

impl Links {
    /// The server of request `req` of `call`, and its data bytes if it may go in a batch;
    /// `None` if its call is over.
    fn batchable(
        &self,
        call: crate::worker::calls::CallId,
        req: usize,
    ) -> Option<(usize, Option<usize>)> {
        let (r, _) = self.calls.request(call, req)?;
        let data = r.data.as_ref().map_or(0, |(_, range)| range.len());
        let small = data <= ITEM_MAX && r.dest.as_ref().is_none_or(|(_, d)| d.len() <= ITEM_MAX);
        let ok = small
            && matches!(r.msg.op, Op::Push | Op::Pull | Op::PushPull)
            && r.text.is_empty()
            && self.calls.slot(call, req) != SlotUse::Posted;
        Some((r.server, ok.then_some(data)))
    }

    /// Posts the queued requests in order, as far as the links take them; the first that
    /// finds its link full stops it, and it waits in the queue with every request after it.
    pub(super) fn post_queue(&mut self) -> Result<()> {
        // One request (a call of one key slice): posted as it is, with nothing to gather.
        if let [Action::Send { call, req, token }] = self.queue.make_contiguous() {
            let (call, req, token) = (*call, *req, *token);
            if let Posted::Yes = self.post(call, req, token)? {
                self.queue.clear();
            }
            return Ok(());
        }
        let q: Vec<Action<RemoteRegion>> = self.queue.drain(..).collect();
        let mut posted = vec![false; q.len()];
        let mut open: Vec<Open> = (0..self.servers.len()).map(|_| Open::default()).collect();
        let mut max = Vec::with_capacity(self.servers.len());
        for i in 0..self.servers.len() {
            let b = self.net.backend(self.servers[i].medium)?;
            max.push(b.max_body().saturating_sub(META_LEN) / ENTRY_LEN);
        }
        let mut full = false;
        for (i, a) in q.iter().enumerate() {
            let &Action::Send { call, req, token } = a else {
                posted[i] = true;
                continue;
            };
            let Some((server, batch)) = self.batchable(call, req) else {
                // Its call is over: nothing to send.
                posted[i] = true;
                continue;
            };
            let o = &mut open[server];
            if let Some(data) = batch {
                if (o.idx.len() >= max[server] || o.data + data > DATA_MAX)
                    && !self.flush(server, &q, o, &mut posted)?
                {
                    full = true;
                    break;
                }
                o.idx.push(i);
                o.data += data;
                continue;
            }
            // Alone, after what was gathered for its server.
            if !self.flush(server, &q, o, &mut posted)? {
                full = true;
                break;
            }
            match self.post(call, req, token)? {
                Posted::Yes => posted[i] = true,
                Posted::Full => {
                    full = true;
                    break;
                }
            }
        }
        if !full {
            for (server, o) in open.iter_mut().enumerate() {
                if !self.flush(server, &q, o, &mut posted)? {
                    break;
                }
            }
        }
        self.queue = q
            .into_iter()
            .zip(posted)
            .filter_map(|(a, p)| (!p).then_some(a))
            .collect();
        Ok(())
    }

    /// Posts what was gathered for `server`: one request alone, several as a batch. `false`:
    /// the link is full (nothing was posted).
    fn flush(
        &mut self,
        server: usize,
        q: &[Action<RemoteRegion>],
        o: &mut Open,
        posted: &mut [bool],
    ) -> Result<bool> {
        let sent = match o.idx[..] {
            [] => return Ok(true),
            [i] => match q[i] {
                Action::Send { call, req, token } => {
                    matches!(self.post(call, req, token)?, Posted::Yes)
                }
                Action::Release { .. } => true,
            },
            _ => self.post_batch(server, q, o)?,
        };
        if sent {
            for &i in &o.idx {
                posted[i] = true;
            }
            o.idx.clear();
            o.data = 0;
        }
        Ok(sent)
    }

    /// Posts the requests of `o` to `server` as one batch, their data gathered into a region
    /// of the batch's own. `false`: the link is full.
    fn post_batch(&mut self, server: usize, q: &[Action<RemoteRegion>], o: &Open) -> Result<bool> {
        let addr = self.servers[server];
        let b = self.net.backend(addr.medium)?;
        let region = match o.data {
            0 => None,
            n => Some(crate::net::alloc(b, n, Access::Send)?),
        };
        self.batch.clear(self.rank);
        for &i in &o.idx {
            let Action::Send { call, req, .. } = q[i] else {
                continue;
            };
            let Some((r, _)) = self.calls.request(call, req) else {
                continue;
            };
            let at = self.batch.add(&r.msg, &[]);
            if let (Some(region), Some((v, range))) = (&region, &r.data) {
                // SAFETY: the region is new and this batch's alone: no backend reads or
                // writes it before the send below.
                unsafe { region.write(at.start, &v.as_bytes()[range.clone()]) }?;
                self.copies.0 += 1;
                self.copies.1 += range.len() as u64;
            }
        }
        let data = region.as_ref().map(|r| (r, 0..o.data, Token(0)));
        // SAFETY: nothing writes the batch's region after this; the backend holds it until
        // the send is complete.
        Ok(
            match unsafe { b.send(addr.peer, self.batch.finish(), data) }? {
                Sent::Posted => {
                    self.batched += o.idx.len() as u64;
                    true
                }
                Sent::WouldBlock => false,
            },
        )
    }
}

/// Copies lent data from `off` into `dst` (all of it, or `false`), counting the copy.
pub(super) fn copy_out(
    copies: &mut (u64, u64),
    data: &Option<Lent<'_>>,
    off: usize,
    dst: &mut [u8],
) -> bool {
    if dst.is_empty() {
        // A batch whose values are all empty comes with no data at all.
        return true;
    }
    let ok = data.as_ref().is_some_and(|d| d.read(off, dst).is_ok());
    if ok {
        copies.0 += 1;
        copies.1 += dst.len() as u64;
    }
    ok
}

/// A batch of answers from server `s`: each is taken as if it had come alone, a value copied
/// from the batch's data into its request's destination. A malformed batch fails every call.
pub(super) fn on_answers(
    calls: &mut Calls<RemoteRegion>,
    copies: &mut (u64, u64),
    s: usize,
    h: &Msg,
    rest: &[u8],
    data: Option<Lent<'_>>,
) {
    let len = data.as_ref().map_or(0, |d| d.len());
    let entries = match batch::read(h, rest, len, |op| op == Op::Reply) {
        Ok(e) => e,
        Err(e) => {
            calls.on_fatal(KvError::Protocol(format!("server {s}: {e}")));
            return;
        }
    };
    for e in entries {
        let Some(r) = e.data else {
            calls.on_reply(s, &e.msg, e.text, None);
            continue;
        };
        let fill = |dst: &mut [u8]| dst.len() == r.len() && copy_out(copies, &data, r.start, dst);
        calls.on_reply_value(s, &e.msg, e.text, None, fill);
    }
}
