//! A worker's exchange: the requests of one call go out to every server over whichever backend
//! reaches it, and the loop in the calling thread takes every answer. A pull's destination is
//! granted to its server with each request; the server puts the value there, then replies.
//! Every wait is bounded by the configured timeout.
//!
//! Ownership: from the moment a destination is granted until its answer is in, the transport
//! owns it. A call that fails with answers outstanding revokes the grants (the backend keeps
//! the memory until the peer can no longer write it) and gives the caller fresh storage in
//! place of each output, so a late answer never lands in memory the caller got back; values a
//! backend may still be reading are held, so a caller's write goes to a copy.

use std::collections::HashMap;
use std::ops::Range;
use std::time::{Duration, Instant};

use kvstore_transport::{Completion, RemoteRegion, Sent, Token};

use crate::net::{region_of, Addr, Medium, Net};
use crate::protocol::{status, Msg, Op};
use crate::{Key, KvError, NDArray, Result};

/// One request of a call.
pub(crate) struct Req<'a> {
    pub(crate) server: usize,
    pub(crate) msg: Msg,
    /// Tensor data: a range of bytes of a value.
    pub(crate) data: Option<(&'a NDArray, Range<usize>)>,
    /// Control bytes after the header (optimizer parameters, an updater's name).
    pub(crate) text: &'a [u8],
    /// Where the answer's value goes: an output (by index) and a range of its bytes.
    pub(crate) dest: Option<(usize, Range<usize>)>,
}

/// A worker's links to its servers.
pub(crate) struct Links {
    pub(crate) net: Net,
    /// The link to each server.
    pub(crate) servers: Vec<Addr>,
    pub(crate) next_req: u64,
    next_token: u64,
    pub(crate) rank: u32,
    pub(crate) timeout: Duration,
    pub(crate) broken: Option<String>,
    /// Values a backend may still read after their call failed, held so that the caller's
    /// next write copies first.
    held: HashMap<Token, NDArray>,
    /// A request's body is assembled here, reused.
    body: Vec<u8>,
}

/// The error a server's answer with a non-zero status stands for.
pub(crate) fn remote_error(status: u16, key: u64, server: usize, text: String) -> KvError {
    let key = Key::Int(key as i64);
    match status {
        status::UNKNOWN_KEY => KvError::UnknownKey(key),
        status::DOUBLE_INIT => KvError::DoubleInit(key),
        status::PEER_LOST => KvError::PeerLost(format!("server {server}: {text}")),
        _ => KvError::Remote {
            server,
            message: text,
        },
    }
}

/// What one call is waiting for.
struct Call {
    base: u64,
    /// Per request: answered yet, and the grant it made.
    answered: Vec<bool>,
    grants: Vec<Option<RemoteRegion>>,
    remaining: usize,
    /// Data tokens not yet complete, with the request they belong to.
    tokens: HashMap<Token, usize>,
    first_err: Option<KvError>,
    /// A lost server or a failed send: the call cannot complete.
    fatal: Option<KvError>,
}

impl Links {
    pub(crate) fn new(net: Net, servers: Vec<Addr>, rank: u32, timeout: Duration) -> Links {
        Links {
            net,
            servers,
            next_req: 1,
            next_token: 1,
            rank,
            timeout,
            broken: None,
            held: HashMap::new(),
            body: Vec::new(),
        }
    }

    pub(crate) fn check(&self) -> Result<()> {
        match &self.broken {
            Some(why) => Err(KvError::Aborted(format!("this store is unusable: {why}"))),
            None => Ok(()),
        }
    }

    pub(crate) fn fail(&mut self, e: KvError) -> KvError {
        self.broken = Some(e.to_string());
        e
    }

    /// Takes what the backends have for `call` (or, with none, for held values only).
    fn pump(&mut self, reqs: &[Req<'_>], mut call: Option<&mut Call>) -> Result<()> {
        let servers = &self.servers;
        let held = &mut self.held;
        self.net.progress(&mut |medium, c| {
            let Some(call) = call.as_deref_mut() else {
                if let Completion::Done(t) | Completion::Failed(t, _) = c {
                    held.remove(&t);
                }
                return;
            };
            match c {
                Completion::Recv { peer, body, .. } => {
                    let addr = Addr { medium, peer };
                    let Some(server) = servers.iter().position(|a| *a == addr) else {
                        return;
                    };
                    let (m, text) = match Msg::from_body(body) {
                        Ok((m, text)) if m.op == Op::Reply => (m, text),
                        Ok((m, _)) => {
                            call.fatal.get_or_insert(KvError::Protocol(format!(
                                "server {server} sent {:?}, not a reply",
                                m.op
                            )));
                            return;
                        }
                        Err(e) => {
                            call.fatal.get_or_insert(e);
                            return;
                        }
                    };
                    let idx = m.req_id.wrapping_sub(call.base) as usize;
                    if idx >= reqs.len() || call.answered[idx] || reqs[idx].server != server {
                        return;
                    }
                    call.answered[idx] = true;
                    call.remaining -= 1;
                    if m.status != status::OK && call.first_err.is_none() {
                        let text = String::from_utf8_lossy(text).into_owned();
                        call.first_err =
                            Some(remote_error(m.status, reqs[idx].msg.key, server, text));
                    }
                }
                Completion::Done(t) => {
                    call.tokens.remove(&t);
                    held.remove(&t);
                }
                Completion::Failed(t, e) => {
                    held.remove(&t);
                    if call.tokens.remove(&t).is_some() {
                        call.fatal.get_or_insert(KvError::Transport(e));
                    }
                }
                Completion::Lost { peer, error } => {
                    let addr = Addr { medium, peer };
                    if let Some(s) = servers.iter().position(|a| *a == addr) {
                        call.fatal
                            .get_or_insert(KvError::PeerLost(format!("server {s}: {error}")));
                    }
                }
                Completion::Put { .. } | Completion::Connected { .. } => {}
            }
        })?;
        Ok(())
    }

    /// Posts one request, taking answers while its link is full.
    fn post(
        &mut self,
        reqs: &[Req<'_>],
        i: usize,
        call: &mut Call,
        outs: &[&mut NDArray],
        deadline: Instant,
    ) -> Result<()> {
        let mut body = std::mem::take(&mut self.body);
        let res = self.post_body(reqs, i, call, outs, deadline, &mut body);
        self.body = body;
        res
    }

    fn post_body(
        &mut self,
        reqs: &[Req<'_>],
        i: usize,
        call: &mut Call,
        outs: &[&mut NDArray],
        deadline: Instant,
        body: &mut Vec<u8>,
    ) -> Result<()> {
        let r = &reqs[i];
        let addr = self.servers[r.server];
        body.clear();
        body.extend_from_slice(&r.msg.encode());
        if let Some((o, range)) = &r.dest {
            let b = self.net.backend(addr.medium)?;
            let region = region_of(b, outs[*o])?;
            // SAFETY: the call holds the output mutably and touches it only after the answer
            // is in; a call that fails first revokes the grant and takes the storage out of
            // the output.
            let g = unsafe { b.grant(addr.peer, &region, range.clone()) }?;
            body.extend_from_slice(&g.to_bytes());
            call.grants[i] = Some(g);
        }
        body.extend_from_slice(r.text);
        let data = match &r.data {
            Some((v, range)) => {
                let region = region_of(self.net.backend(addr.medium)?, v)?;
                Some((region, range.clone(), (*v).clone()))
            }
            None => None,
        };
        loop {
            let token = Token(self.next_token);
            let b = self.net.backend(addr.medium)?;
            let d = data.as_ref().map(|(g, range, _)| (g, range.clone(), token));
            // SAFETY: the value is read only: the caller holds it shared for the call, and
            // after a failed call a clone is held until the token completes, so the caller's
            // writes go to a copy.
            match unsafe { b.send(addr.peer, body, d) }? {
                Sent::Posted => {
                    if let Some((_, _, v)) = data {
                        self.next_token += 1;
                        call.tokens.insert(token, i);
                        self.held.insert(token, v);
                    }
                    return Ok(());
                }
                Sent::WouldBlock => {
                    self.net.flush()?;
                    self.pump(reqs, Some(call))?;
                    if let Some(e) = call.fatal.take() {
                        return Err(e);
                    }
                    if Instant::now() >= deadline {
                        return Err(self.timed_out("room in a link to a server"));
                    }
                }
            }
        }
    }

    fn timed_out(&self, what: &str) -> KvError {
        KvError::Timeout {
            what: what.into(),
            secs: self.timeout.as_secs_f64(),
        }
    }

    /// Sends every request and waits for every answer; answers' values land in `outs`.
    pub(crate) fn exchange(
        &mut self,
        reqs: &mut [Req<'_>],
        outs: &mut [&mut NDArray],
    ) -> Result<()> {
        self.check()?;
        if reqs.is_empty() {
            return Ok(());
        }
        let base = self.next_req;
        self.next_req += reqs.len() as u64;
        for (i, r) in reqs.iter_mut().enumerate() {
            r.msg.req_id = base + i as u64;
            r.msg.sender = self.rank;
        }
        let reqs: &[Req<'_>] = reqs;
        let mut call = Call {
            base,
            answered: vec![false; reqs.len()],
            grants: vec![None; reqs.len()],
            remaining: reqs.len(),
            tokens: HashMap::new(),
            first_err: None,
            fatal: None,
        };
        // Every output gets storage of its own before anything is granted (a grant shares the
        // storage, so making it unique later would copy it away from the grant).
        for o in outs.iter_mut() {
            o.as_bytes_mut();
        }
        let deadline = Instant::now() + self.timeout;
        let res = self.run(reqs, &mut call, outs, deadline);
        // Grants whose answers are in were written once and are done with; the others are
        // revoked, and their outputs get fresh storage.
        for (i, g) in call.grants.iter().enumerate() {
            let Some(g) = g else { continue };
            let addr = self.servers[reqs[i].server];
            let Ok(b) = self.net.backend(addr.medium) else {
                continue;
            };
            if call.answered[i] {
                b.forget(addr.peer, g);
            } else {
                let _ = b.revoke(addr.peer, g, Token(0));
                if let Some((o, _)) = &reqs[i].dest {
                    outs[*o].replace_storage();
                }
            }
        }
        match res {
            Ok(()) => match call.first_err.take() {
                Some(e) => Err(e),
                None => Ok(()),
            },
            Err(e) => Err(self.fail(e)),
        }
    }

    fn run(
        &mut self,
        reqs: &[Req<'_>],
        call: &mut Call,
        outs: &mut [&mut NDArray],
        deadline: Instant,
    ) -> Result<()> {
        for i in 0..reqs.len() {
            self.post(reqs, i, call, outs, deadline)?;
        }
        let mut turns = 0u32;
        loop {
            self.pump(reqs, Some(call))?;
            if let Some(e) = call.fatal.take() {
                return Err(e);
            }
            if call.remaining == 0 && call.tokens.is_empty() {
                return Ok(());
            }
            // The clock is read on few turns of a busy wait (a wait that sleeps ends within
            // its timeout, so the deadline is still seen in time).
            turns = turns.wrapping_add(1);
            if turns % 32 != 0 {
                self.net.wait(None, Duration::from_millis(1))?;
                continue;
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(self.timed_out("the servers' answers"));
            }
            self.net
                .wait(None, (deadline - now).min(Duration::from_millis(100)))?;
        }
    }

    /// Sends a message with no data and no answer expected (a goodbye), best effort.
    pub(crate) fn notify(&mut self, op: Op) {
        let mut m = Msg::new(op);
        m.sender = self.rank;
        let body = m.encode();
        for addr in self.servers.clone() {
            if let Ok(b) = self.net.backend(addr.medium) {
                // SAFETY: no data rides with it.
                let _ = unsafe { b.send(addr.peer, &body, None) };
            }
        }
        let _ = self.net.flush();
        let _ = self.pump(&[], None);
    }

    /// Sends the hello to every server and waits for every acknowledgement.
    pub(crate) fn hello(&mut self, secret: &str) -> Result<()> {
        let mut m = Msg::new(Op::Hello);
        m.key = crate::protocol::role::WORKER;
        m.sender = self.rank;
        let mut body = m.encode().to_vec();
        body.extend_from_slice(secret.as_bytes());
        let deadline = Instant::now() + self.timeout;
        for addr in self.servers.clone() {
            let b = self.net.backend(addr.medium)?;
            // SAFETY: no data rides with it.
            if let Sent::WouldBlock = unsafe { b.send(addr.peer, &body, None) }? {
                return Err(KvError::Protocol("a new link is full".into()));
            }
        }
        let mut acked = vec![false; self.servers.len()];
        let mut failure: Option<KvError> = None;
        while acked.iter().any(|a| !a) {
            let servers = &self.servers;
            self.net.progress(&mut |medium, c| match c {
                Completion::Recv { peer, body, .. } => {
                    let Some(s) = servers.iter().position(|a| *a == Addr { medium, peer }) else {
                        return;
                    };
                    let ok = Msg::from_body(body).is_ok_and(|(m, _)| m.op == Op::HelloAck);
                    if ok {
                        acked[s] = true;
                    } else {
                        failure.get_or_insert(KvError::Protocol(format!(
                            "server {s} did not acknowledge the hello"
                        )));
                    }
                }
                Completion::Lost { peer, error } => {
                    if let Some(s) = servers.iter().position(|a| *a == Addr { medium, peer }) {
                        failure.get_or_insert(KvError::PeerLost(format!(
                            "server {s} refused the hello: {error}"
                        )));
                    }
                }
                _ => {}
            })?;
            if let Some(e) = failure.take() {
                return Err(e);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(self.timed_out("the servers' acknowledgement of the hello"));
            }
            self.net
                .wait(None, (deadline - now).min(Duration::from_millis(50)))?;
        }
        Ok(())
    }

    /// The medium of each server's link.
    pub(crate) fn media(&self) -> impl Iterator<Item = Medium> + '_ {
        self.servers.iter().map(|a| a.medium)
    }
}
