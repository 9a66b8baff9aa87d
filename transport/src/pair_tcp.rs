//! [`Transport`] over one TCP connection: framed messages; a put is a frame whose payload is
//! read straight into the exposed region.

use std::io::{IoSlice, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use crate::frame::{FrameHeader, HEADER_LEN, META_LEN};
use crate::tcp::blocking::read_exact_until;
use crate::{Event, RegionHandle, Transport, TransportError};

const SEND: u8 = 1;
const PUT: u8 = 2;

/// A TCP connection as a [`Transport`].
pub struct TcpPair {
    s: TcpStream,
    regions: Vec<Vec<u8>>,
    max: u64,
}

fn meta(kind: u8, a: u64, b: u64, c: u64) -> [u8; META_LEN] {
    let mut m = [0u8; META_LEN];
    m[0] = kind;
    m[8..16].copy_from_slice(&a.to_le_bytes());
    m[16..24].copy_from_slice(&b.to_le_bytes());
    m[24..32].copy_from_slice(&c.to_le_bytes());
    m
}

fn word(m: &[u8; META_LEN], i: usize) -> u64 {
    u64::from_le_bytes(m[8 + 8 * i..16 + 8 * i].try_into().unwrap_or([0; 8]))
}

impl TcpPair {
    fn new(s: TcpStream) -> Result<TcpPair, TransportError> {
        s.set_nodelay(true)?;
        Ok(TcpPair {
            s,
            regions: Vec::new(),
            max: 1 << 34,
        })
    }

    /// Connects to a peer waiting in [`TcpPair::accept`].
    pub fn connect(addr: SocketAddr, timeout: Duration) -> Result<TcpPair, TransportError> {
        TcpPair::new(crate::tcp::connect_retry(addr, timeout)?)
    }

    /// Waits for one peer on `listener`.
    pub fn accept(listener: &TcpListener) -> Result<TcpPair, TransportError> {
        let (s, _) = listener.accept()?;
        TcpPair::new(s)
    }

    fn write_frame(
        &mut self,
        m: [u8; META_LEN],
        payload: &[u8],
        deadline: Instant,
    ) -> Result<(), TransportError> {
        let h = FrameHeader::new(m, payload.len() as u64).encode();
        let total = HEADER_LEN + payload.len();
        let mut done = 0;
        while done < total {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(TransportError::Timeout("sending".into()));
            }
            self.s.set_write_timeout(Some(left))?;
            let n = if done < HEADER_LEN {
                self.s
                    .write_vectored(&[IoSlice::new(&h[done..]), IoSlice::new(payload)])
            } else {
                self.s.write(&payload[done - HEADER_LEN..])
            };
            match n {
                Ok(0) => return Err(TransportError::Closed),
                Ok(n) => done += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }
}

impl Transport for TcpPair {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn send(&mut self, tag: u64, payload: &[u8], deadline: Instant) -> Result<(), TransportError> {
        self.write_frame(meta(SEND, tag, 0, 0), payload, deadline)
    }

    fn recv(&mut self, buf: &mut [u8], deadline: Instant) -> Result<Event, TransportError> {
        let mut hb = [0u8; HEADER_LEN];
        read_exact_until(&mut self.s, &mut hb, Some(deadline), false)?;
        let h = FrameHeader::decode(&hb, self.max)?;
        let len = h.payload_len as usize;
        match h.meta[0] {
            SEND => {
                if len > buf.len() {
                    return Err(TransportError::Refused(format!(
                        "{len} bytes for a buffer of {}",
                        buf.len()
                    )));
                }
                read_exact_until(&mut self.s, &mut buf[..len], Some(deadline), true)?;
                Ok(Event::Message {
                    tag: word(&h.meta, 0),
                    len,
                })
            }
            PUT => {
                let (id, offset, imm) = (
                    word(&h.meta, 0),
                    word(&h.meta, 1) as usize,
                    word(&h.meta, 2),
                );
                let Some(r) = self.regions.get_mut(id as usize) else {
                    return Err(TransportError::Refused(format!(
                        "put into unknown region {id}"
                    )));
                };
                let rlen = r.len();
                if offset.checked_add(len).is_none_or(|e| e > rlen) {
                    return Err(TransportError::Refused(format!(
                        "put of {len} at {offset} into {rlen} bytes"
                    )));
                }
                // Straight into the region.
                read_exact_until(
                    &mut self.s,
                    &mut r[offset..offset + len],
                    Some(deadline),
                    true,
                )?;
                Ok(Event::Put {
                    imm,
                    region: RegionHandle {
                        key: id,
                        len: rlen as u64,
                    },
                    offset,
                    len,
                })
            }
            k => Err(TransportError::Refused(format!("unknown frame kind {k}"))),
        }
    }

    fn expose(&mut self, len: usize) -> Result<RegionHandle, TransportError> {
        self.regions.push(vec![0u8; len]);
        Ok(RegionHandle {
            key: (self.regions.len() - 1) as u64,
            len: len as u64,
        })
    }

    fn release(&mut self, region: RegionHandle) -> Result<(), TransportError> {
        match self.regions.get_mut(region.key as usize) {
            Some(r) if !r.is_empty() => {
                *r = Vec::new();
                Ok(())
            }
            _ => Err(TransportError::Refused(
                "release of an unknown region".into(),
            )),
        }
    }

    fn put(
        &mut self,
        remote: RegionHandle,
        offset: usize,
        data: &[u8],
        imm: u64,
        deadline: Instant,
    ) -> Result<(), TransportError> {
        if (offset + data.len()) as u64 > remote.len {
            return Err(TransportError::Refused(
                "put beyond the remote region".into(),
            ));
        }
        self.write_frame(meta(PUT, remote.key, offset as u64, imm), data, deadline)
    }

    fn read_region(
        &self,
        region: RegionHandle,
        offset: usize,
        out: &mut [u8],
    ) -> Result<(), TransportError> {
        let r = self
            .regions
            .get(region.key as usize)
            .ok_or_else(|| TransportError::Refused("unknown region".into()))?;
        let src = r
            .get(offset..offset + out.len())
            .ok_or_else(|| TransportError::Refused("read beyond the region".into()))?;
        out.copy_from_slice(src);
        Ok(())
    }
}
