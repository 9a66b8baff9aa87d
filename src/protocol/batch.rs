//! Batches: many small requests to one server, or many answers to one worker, in one message,
//! as ps-lite sends one message per server for all the keys of a call.
//!
//! ```text
//! body: a header (op Batch, key = entries, len = data bytes, dtype u8), then each entry as
//!       u32 (little-endian) length + that many bytes: the entry's own header, then its text
//! data: the data of the entries that carry some (`Msg::data_bytes` each), in entry order
//! ```
//! A worker batches pushes, pulls and pushpulls of small values: pushes and pushpulls carry
//! their data, and no entry grants a destination, since the answers come back as a batch too.
//! A server batches the answers to batched requests: an answer with [`flags::DATA`] carries
//! its value, an error its text. A batch is read whole before any entry is acted on, so a
//! malformed one does nothing but close its link.

use std::ops::Range;

use kvstore_transport::META_LEN;

use crate::protocol::{flags, Msg, Op};
use crate::DType;

/// The bytes an entry adds to a batch's body beside its text.
pub(crate) const ENTRY_LEN: usize = 4 + META_LEN;
/// The largest value that goes in a batch: bigger ones go alone (a receive slot, or by
/// reference, moves them without the batch's copy).
pub(crate) const ITEM_MAX: usize = 16 * 1024;
/// The most data one batch carries.
pub(crate) const DATA_MAX: usize = 256 * 1024;
/// The most text an answer in a batch carries (an error message, cut there).
pub(crate) const TEXT_MAX: usize = 1024;

/// Whether an entry carries data: a request's value, or an answer's.
fn carries(m: &Msg) -> bool {
    match m.op {
        Op::Reply => m.flags & flags::DATA != 0,
        op => op.carries_data(),
    }
}

/// A batch being assembled.
pub(crate) struct Writer {
    sender: u32,
    /// The header's place, then the entries.
    body: Vec<u8>,
    count: u64,
    data: u64,
}

impl Writer {
    /// An empty batch from `sender`.
    pub(crate) fn new(sender: u32) -> Writer {
        let mut w = Writer {
            sender,
            body: Vec::new(),
            count: 0,
            data: 0,
        };
        w.clear(sender);
        w
    }

    /// Empties the batch, keeping its buffer.
    pub(crate) fn clear(&mut self, sender: u32) {
        self.sender = sender;
        self.body.clear();
        self.body.resize(META_LEN, 0);
        self.count = 0;
        self.data = 0;
    }

    /// Entries so far.
    pub(crate) fn count(&self) -> usize {
        self.count as usize
    }

    /// Whether an entry with `text` bytes of text and `data` bytes of data still fits a body of
    /// at most `max_body` bytes and the data limit.
    pub(crate) fn room(&self, text: usize, data: usize, max_body: usize) -> bool {
        self.body.len() + ENTRY_LEN + text <= max_body && self.data as usize + data <= DATA_MAX
    }

    /// Adds an entry; its data (if its header says it carries some) is the batch's next
    /// `m.data_bytes()` bytes. Returns where they lie in the batch's data.
    pub(crate) fn add(&mut self, m: &Msg, text: &[u8]) -> Range<usize> {
        let len = (META_LEN + text.len()) as u32;
        self.body.extend_from_slice(&len.to_le_bytes());
        self.body.extend_from_slice(&m.encode());
        self.body.extend_from_slice(text);
        self.count += 1;
        let start = self.data as usize;
        if carries(m) {
            self.data += m.data_bytes().unwrap_or(0);
        }
        start..self.data as usize
    }

    /// Bytes of data the entries carry.
    pub(crate) fn data_len(&self) -> usize {
        self.data as usize
    }

    /// The body, its header written.
    pub(crate) fn finish(&mut self) -> &[u8] {
        let mut h = Msg::new(Op::Batch);
        h.sender = self.sender;
        h.key = self.count;
        h.dtype = DType::U8;
        h.total = self.data;
        h.len = self.data;
        self.body[..META_LEN].copy_from_slice(&h.encode());
        &self.body
    }
}

/// One entry of a batch that was read.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Entry<'a> {
    pub(crate) msg: Msg,
    /// What follows its header in the entry.
    pub(crate) text: &'a [u8],
    /// Its data, as a range of the batch's data.
    pub(crate) data: Option<Range<usize>>,
}

/// Reads a batch: `h` is its header and `rest` the body after it; `data_len` the bytes of data
/// that came with it. Every entry must be of an op `allowed` says yes to, and together they
/// must account for the body and the data exactly.
pub(crate) fn read<'a>(
    h: &Msg,
    rest: &'a [u8],
    data_len: usize,
    allowed: impl Fn(Op) -> bool,
) -> Result<Vec<Entry<'a>>, String> {
    if h.len != data_len as u64 || h.dtype != DType::U8 {
        return Err(format!(
            "a batch claiming {} bytes of data came with {data_len}",
            h.len
        ));
    }
    // Each entry takes at least ENTRY_LEN bytes, so the count is checked before it sizes
    // anything.
    if h.key > (rest.len() / ENTRY_LEN) as u64 {
        return Err(format!(
            "a batch of {} entries in {} bytes",
            h.key,
            rest.len()
        ));
    }
    let mut out = Vec::with_capacity(h.key as usize);
    let (mut at, mut data) = (0usize, 0usize);
    while at < rest.len() {
        let Some(&[a, b, c, d]) = rest.get(at..at + 4) else {
            return Err("a batch entry cut short".into());
        };
        let len = u32::from_le_bytes([a, b, c, d]) as usize;
        let Some(entry) = rest.get(at + 4..at + 4 + len) else {
            return Err(format!("a batch entry of {len} bytes past the body's end"));
        };
        at += 4 + len;
        let (msg, text) = Msg::from_body(entry).map_err(|e| e.to_string())?;
        if !allowed(msg.op) {
            return Err(format!("a {:?} in a batch", msg.op));
        }
        let range = if carries(&msg) {
            let end = msg
                .data_bytes()
                .and_then(|n| usize::try_from(n).ok())
                .and_then(|n| data.checked_add(n))
                .filter(|&e| e <= data_len)
                .ok_or_else(|| "batch entries claim more data than came".to_string())?;
            let r = data..end;
            data = end;
            Some(r)
        } else {
            None
        };
        out.push(Entry {
            msg,
            text,
            data: range,
        });
    }
    if out.len() as u64 != h.key || data != data_len {
        return Err(format!(
            "a batch of {} entries and {data_len} bytes of data holds {} entries and {data} bytes",
            h.key,
            out.len()
        ));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::status;

    fn push(op: Op, key: u64, len: u64) -> Msg {
        let mut m = Msg::new(op);
        m.key = key;
        m.dtype = DType::F32;
        m.total = len;
        m.len = len;
        m.req_id = key + 100;
        m
    }

    fn requests(op: Op) -> bool {
        matches!(op, Op::Push | Op::Pull | Op::PushPull)
    }

    fn decode(body: &[u8]) -> (Msg, &[u8]) {
        Msg::from_body(body).unwrap()
    }

    #[test]
    fn entries_come_back_with_their_data_ranges_in_order() {
        let mut w = Writer::new(3);
        assert_eq!(w.add(&push(Op::Push, 1, 4), &[]), 0..16);
        assert_eq!(w.add(&push(Op::Pull, 2, 8), &[]), 16..16);
        assert_eq!(w.add(&push(Op::PushPull, 3, 2), &[]), 16..24);
        assert_eq!((w.count(), w.data_len()), (3, 24));
        let body = w.finish().to_vec();
        let (h, rest) = decode(&body);
        assert_eq!((h.op, h.sender, h.key, h.len), (Op::Batch, 3, 3, 24));
        let e = read(&h, rest, 24, requests).unwrap();
        let got: Vec<_> = e.iter().map(|e| (e.msg.key, e.data.clone())).collect();
        assert_eq!(got, vec![(1, Some(0..16)), (2, None), (3, Some(16..24))]);
        assert_eq!(e[1].msg, push(Op::Pull, 2, 8));
    }

    #[test]
    fn answers_carry_data_when_flagged_and_text_otherwise() {
        let mut w = Writer::new(0);
        let mut ok = push(Op::Reply, 1, 4);
        ok.flags = flags::DATA;
        let mut bad = push(Op::Reply, 2, 4);
        bad.status = status::UNKNOWN_KEY;
        w.add(&ok, &[]);
        w.add(&bad, b"no such key");
        let body = w.finish().to_vec();
        let (h, rest) = decode(&body);
        let e = read(&h, rest, 16, |op| op == Op::Reply).unwrap();
        assert_eq!(e[0].data, Some(0..16));
        assert_eq!((e[1].data.clone(), e[1].text), (None, &b"no such key"[..]));
        // Requests are not answers.
        assert!(read(&h, rest, 16, requests).is_err());
    }

    #[test]
    fn a_malformed_batch_is_refused_whole() {
        let mut w = Writer::new(0);
        w.add(&push(Op::Push, 1, 4), &[]);
        w.add(&push(Op::Push, 2, 4), &[]);
        let body = w.finish().to_vec();
        let (h, rest) = decode(&body);
        assert!(read(&h, rest, 32, requests).is_ok());
        // Less or more data than claimed.
        assert!(read(&h, rest, 31, requests).is_err());
        assert!(read(&h, rest, 33, requests).is_err());
        // Cut anywhere: too few entries, or an entry past the end.
        for cut in 1..rest.len() {
            assert!(
                read(&h, &rest[..cut], 32, requests).is_err(),
                "cut at {cut}"
            );
        }
        // A count that does not match, or one far beyond what the body can hold.
        for count in [1, 3, u64::MAX] {
            let mut h2 = h;
            h2.key = count;
            assert!(read(&h2, rest, 32, requests).is_err());
        }
        // An entry whose length word runs past the body, or is shorter than a header.
        let mut long = rest.to_vec();
        long[0..4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(read(&h, &long, 32, requests).is_err());
        let mut short = rest.to_vec();
        short[0..4].copy_from_slice(&10u32.to_le_bytes());
        assert!(read(&h, &short, 32, requests).is_err());
        // An op the reader does not take, or data claims that overflow.
        assert!(read(&h, rest, 32, |op| op == Op::Pull).is_err());
        let mut w = Writer::new(0);
        let mut huge = push(Op::Push, 1, 4);
        huge.total = u64::MAX;
        huge.len = u64::MAX;
        w.add(&huge, &[]);
        let body = w.finish().to_vec();
        let (h, rest) = decode(&body);
        assert!(read(&h, rest, 0, requests).is_err());
    }

    #[test]
    fn room_keeps_a_batch_within_the_body_and_data_limits() {
        let mut w = Writer::new(0);
        let max_body = META_LEN + 2 * ENTRY_LEN;
        assert!(w.room(0, 16, max_body));
        w.add(&push(Op::Push, 1, 4), &[]);
        assert!(w.room(0, 16, max_body));
        assert!(!w.room(1, 16, max_body));
        w.add(&push(Op::Push, 2, 4), &[]);
        assert!(!w.room(0, 0, max_body));
        assert!(!Writer::new(0).room(0, DATA_MAX + 1, usize::MAX));
        w.clear(0);
        assert_eq!((w.count(), w.data_len()), (0, 0));
    }
}
