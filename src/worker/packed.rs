//! Pushes under gradient compression ([`crate::KVStore::set_gradient_compression`]): each
//! key's value (the sum of its list) goes to its servers 2-bit packed, slice by slice, and
//! what it does not send stays in this worker's residual for the key.

use crate::protocol::{flags, Op};
use crate::worker::calls::{Request, Requests};
use crate::worker::requests::{byte_range, data_msg};
use crate::worker::DistWorker;
use crate::{Compression, DType, Key, KvError, NDArray, Result};

impl DistWorker {
    /// Compresses every push from now on. The job's keys must not be initialised yet, so
    /// that every push of a key travels alike (MXNet's Trainer and Module call it first).
    pub(crate) fn set_compression(&mut self, c: Compression) -> Result<()> {
        self.checked()?;
        if !self.keys.is_empty() {
            return Err(KvError::Unsupported(
                "set_gradient_compression must come before a distributed store's first init".into(),
            ));
        }
        self.compression = Some(c);
        Ok(())
    }

    /// Requests carrying each key's value (`values`, in `pairs`' order) packed, slice by slice;
    /// `dest(i)` is the output the answer for the `i`th key goes to, if any. Every key must
    /// hold float32 values: checked for all before any residual changes.
    pub(super) fn packed_requests(
        &mut self,
        c: Compression,
        op: Op,
        keys: &[&Key],
        values: Vec<NDArray>,
        dest: impl Fn(usize) -> Option<usize>,
    ) -> Result<Requests> {
        for k in keys {
            Compression::check_dtype(k, self.info(k)?.dtype)?;
        }
        // Every value on the host before any residual changes.
        let values = values
            .into_iter()
            .map(|v| v.on(crate::Device::default()))
            .collect::<Result<Vec<_>>>()?;
        let mut reqs = Requests::new();
        for (i, (k, v)) in keys.iter().zip(values).enumerate() {
            let info = &self.keys[*k];
            let grad = v.as_slice::<f32>()?;
            let residual = self
                .residuals
                .entry((*k).clone())
                .or_insert_with(|| vec![0.0; grad.len()]);
            let ranges: Vec<std::ops::Range<usize>> = info
                .parts
                .iter()
                .scan(0usize, |at, p| {
                    let n = Compression::packed_bytes(p.len) as usize;
                    *at += n;
                    Some(*at - n..*at)
                })
                .collect();
            let mut packed = NDArray::zeros_dtype(&[ranges.last().map_or(0, |r| r.end)], DType::U8);
            let bytes = packed.as_bytes_mut();
            for (p, r) in info.parts.iter().zip(&ranges) {
                let e = p.start as usize..(p.start + p.len) as usize;
                c.quantize(&grad[e.clone()], &mut residual[e], &mut bytes[r.clone()])?;
            }
            for (p, r) in info.parts.iter().zip(ranges) {
                let mut msg = data_msg(op, info, p);
                msg.flags |= flags::PACKED;
                msg.aux = c.to_wire();
                reqs.push(Request {
                    server: p.server,
                    msg,
                    data: Some((packed.clone(), r)),
                    text: Vec::new(),
                    dest: dest(i).map(|d| (d, byte_range(p, info.dtype.size()))),
                });
            }
        }
        Ok(reqs)
    }
}
