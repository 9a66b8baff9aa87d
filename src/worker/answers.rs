//! The answers to a worker's requests, as the call machine takes them: replies, replies that
//! carry their value, and the servers' puts into granted destinations. An OK answer must bring
//! its request's value where the request has a destination, or the server broke the protocol
//! and every call fails.

use super::{CallId, Calls};
use crate::protocol::{status, Msg, Op, IMM_FOLLOWS};
use crate::KvError;

impl<G: Clone> Calls<G> {
    /// A reply from `server`, with the text after its header, and the receive slot it carries
    /// (the credit for the next push of its request's key slice).
    pub(crate) fn on_reply(&mut self, server: usize, m: &Msg, text: &[u8], slot: Option<G>) {
        if let Some(at) = self.unanswered(server, m.req_id) {
            self.answer_at(at, server, m.status, text, slot, false);
        }
    }

    /// A reply from `server` that carries its value ([`crate::protocol::flags::DATA`]): `fill`
    /// copies the value into the request's destination, a slice it must fill exactly (`false`:
    /// the value has another length). The server answered so instead of writing the grant, and
    /// never writes it afterwards. A value for a request with no destination, or of the wrong
    /// length, breaks the protocol: every call fails.
    pub(crate) fn on_reply_value(
        &mut self,
        server: usize,
        m: &Msg,
        text: &[u8],
        slot: Option<G>,
        fill: impl FnOnce(&mut [u8]) -> bool,
    ) {
        let Some((id, i)) = self.unanswered(server, m.req_id) else {
            return;
        };
        let Some(c) = self.live.get(&id) else {
            return;
        };
        let filled = match &c.reqs[i].dest {
            Some((o, range)) => {
                let out = &c.outputs[*o];
                let base = kvstore_transport::Storage::ptr(&*out.storage());
                // SAFETY: the call owns the output (no other reference to it in this process
                // while the call lives), and `start` checked that the range lies inside it;
                // its only other holder is the grant, which the server no longer writes.
                let dst =
                    unsafe { std::slice::from_raw_parts_mut(base.add(range.start), range.len()) };
                fill(dst)
            }
            None => false,
        };
        if !filled {
            self.on_fatal(KvError::Protocol(format!(
                "server {server} answered request {} with a value that does not fill its \
                 destination",
                m.req_id
            )));
            return;
        }
        self.answer_at((id, i), server, m.status, text, slot, true);
    }

    /// The call and index of request `req_id` if it is live, was sent to `server`, and is not
    /// answered yet.
    fn unanswered(&self, server: usize, req_id: u64) -> Option<(CallId, usize)> {
        let &(id, i) = self.by_req.get(&req_id)?;
        let c = self.live.get(&id)?;
        (!c.per[i].answered && c.reqs[i].server == server).then_some((id, i))
    }

    /// Request `i` of call `id` (`at`, found by [`Calls::unanswered`]) is answered with `st`, its
    /// value brought with the answer (`brought`) or put into its destination before: an OK for
    /// a destination neither filled breaks the protocol, and every call fails (the output
    /// would be taken as written).
    fn answer_at(
        &mut self,
        (id, i): (CallId, usize),
        server: usize,
        st: u16,
        text: &[u8],
        slot: Option<G>,
        brought: bool,
    ) {
        let Some(c) = self.live.get_mut(&id) else {
            return;
        };
        let wants = c.reqs[i].dest.as_ref().is_some_and(|(_, r)| !r.is_empty());
        if st == status::OK && wants && !brought && !c.per[i].filled {
            let req_id = c.reqs[i].msg.req_id;
            self.on_fatal(KvError::Protocol(format!(
                "server {server} answered request {req_id} OK without its value"
            )));
            return;
        }
        c.per[i].answered = true;
        if std::mem::take(&mut c.per[i].counted) {
            let m = &c.reqs[i].msg;
            super::rounds::uncount(&mut self.sliced_in_flight, m.key, m.start);
        }
        c.remaining -= 1;
        self.by_req.remove(&c.reqs[i].msg.req_id);
        let r = &c.reqs[i].msg;
        if let (Some(g), Op::Push | Op::PushPull) = (slot, r.op) {
            self.slots.insert((server, r.key, r.start), g);
        }
        if st != status::OK {
            let text = String::from_utf8_lossy(text).into_owned();
            let e = status::to_error(st, c.reqs[i].msg.key, server, text);
            // (Whichever error of the call came first.)
            let at = (server, st);
            if let Some(fatal) = super::rounds::refused_slice(self.sync, &c.reqs, i, at, &e) {
                return self.fail_all(fatal);
            }
            c.first_err.get_or_insert(e);
        }
        self.finish_if_complete(id);
    }

    /// `server` put `len` bytes at `offset` into a grant of this worker (`is_grant` tells
    /// whether a request's grant is the one written), with immediate `imm`. Unless a message
    /// follows ([`IMM_FOLLOWS`]), the put is the whole answer, as a reply with no text: then
    /// it must have filled its request's destination exactly, or the server broke the
    /// protocol and every call fails.
    pub(crate) fn on_answer_put(
        &mut self,
        server: usize,
        imm: u32,
        is_grant: impl Fn(&G) -> bool,
        offset: usize,
        len: usize,
    ) {
        let follows = imm & IMM_FOLLOWS != 0;
        let req_id = (imm & !IMM_FOLLOWS) as u64;
        let Some(&(id, i)) = self.by_req.get(&req_id) else {
            return;
        };
        let Some(c) = self.live.get_mut(&id) else {
            return;
        };
        let whole = c.reqs[i].dest.as_ref().map(|(_, r)| r.len());
        let fits = c.reqs[i].server == server
            && c.per[i].grant.as_ref().is_some_and(is_grant)
            && offset == 0
            && whole == Some(len);
        match (fits, follows) {
            // The reply that follows answers the request.
            (true, true) => c.per[i].filled = true,
            (true, false) => self.answer_at((id, i), server, status::OK, &[], None, true),
            (false, _) => self.on_fatal(KvError::Protocol(format!(
                "server {server} answered request {req_id} with a put of {len} bytes at \
                 {offset} that does not fill its destination"
            ))),
        }
    }
}
