//! The frame header: 16 fixed bytes of framing plus [`META_LEN`] bytes of protocol metadata.
//!
//! ```text
//! 0       4         6          8               16                    128
//! | magic | version | reserved | payload length | meta (protocol's)    |
//! ```
//! All integers are little-endian.

use crate::TransportError;

/// "KVST".
pub const MAGIC: u32 = 0x5453_564b;
/// Wire version; a peer with another version is refused.
pub const VERSION: u16 = 1;
/// The size of a frame header.
pub const HEADER_LEN: usize = 128;
/// The bytes of protocol metadata in a header.
pub const META_LEN: usize = HEADER_LEN - 16;

/// A decoded frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    /// The payload's length in bytes.
    pub payload_len: u64,
    /// Protocol metadata, opaque to the transport.
    pub meta: [u8; META_LEN],
}

impl FrameHeader {
    /// A header for a payload of `payload_len` bytes.
    pub fn new(meta: [u8; META_LEN], payload_len: u64) -> Self {
        FrameHeader { payload_len, meta }
    }

    /// The header's bytes.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4..6].copy_from_slice(&VERSION.to_le_bytes());
        b[8..16].copy_from_slice(&self.payload_len.to_le_bytes());
        b[16..].copy_from_slice(&self.meta);
        b
    }

    /// Decodes and validates a header; payloads over `max_payload` bytes are refused.
    pub fn decode(b: &[u8; HEADER_LEN], max_payload: u64) -> Result<Self, TransportError> {
        let magic = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        if magic != MAGIC {
            return Err(TransportError::BadMagic(magic));
        }
        let version = u16::from_le_bytes([b[4], b[5]]);
        if version != VERSION {
            return Err(TransportError::VersionSkew {
                got: version,
                expected: VERSION,
            });
        }
        let mut len = [0u8; 8];
        len.copy_from_slice(&b[8..16]);
        let payload_len = u64::from_le_bytes(len);
        if payload_len > max_payload {
            return Err(TransportError::Oversize {
                len: payload_len,
                max: max_payload,
            });
        }
        let mut meta = [0u8; META_LEN];
        meta.copy_from_slice(&b[16..]);
        Ok(FrameHeader { payload_len, meta })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let mut meta = [0u8; META_LEN];
        meta[0] = 7;
        meta[META_LEN - 1] = 9;
        let h = FrameHeader::new(meta, 12345);
        assert_eq!(FrameHeader::decode(&h.encode(), u64::MAX).unwrap(), h);
    }

    #[test]
    fn bad_magic_version_and_oversize_are_refused() {
        let h = FrameHeader::new([0; META_LEN], 100);
        let mut b = h.encode();
        assert!(matches!(
            FrameHeader::decode(&b, 99),
            Err(TransportError::Oversize { len: 100, max: 99 })
        ));
        b[4] = 2;
        assert!(matches!(
            FrameHeader::decode(&b, 1000),
            Err(TransportError::VersionSkew { got: 2, .. })
        ));
        b[0] = b'X';
        assert!(matches!(
            FrameHeader::decode(&b, 1000),
            Err(TransportError::BadMagic(_))
        ));
    }
}
