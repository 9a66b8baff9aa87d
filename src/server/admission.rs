//! What a server admits over TCP before reading a message's data: the message is judged by
//! its header (the data must be what it describes, a push must fit its key as initialised),
//! so that nothing it merely claims takes memory.

use rustc_hash::FxHashMap;

use crate::protocol::{Msg, Op};

/// Each initialised key's bytes on this server.
pub type Sizes = std::sync::Arc<std::sync::Mutex<FxHashMap<u64, u64>>>;

/// Judges a worker's message by its header before the data it brings is read (the TCP
/// backend's admission): the data must be what the header describes, and a batch must be
/// within a batch's bounds, or the message is refused (and its link closed) before a byte of
/// its data takes memory. A well-formed push that does not fit its key as initialised here
/// (an unknown key, another size) has its data dropped as it is read, and is answered with
/// the typed error, as over the other transports.
pub fn admission(sizes: Sizes) -> Box<kvstore_transport::tcp::Admission> {
    Box::new(move |_peer, body, data| {
        let (m, _) = Msg::from_body(body).map_err(|e| e.to_string())?;
        let claims = m.data_bytes();
        let fits = match m.op {
            Op::Init | Op::LoadStates => claims == Some(data as u64),
            Op::Push | Op::PushPull if claims == Some(data as u64) => {
                let known = sizes
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .get(&m.key)
                    .copied();
                // A packed push brings less than the key holds.
                return Ok(known == m.value_bytes());
            }
            Op::Batch => m.len == data as u64 && data <= crate::protocol::batch::DATA_MAX,
            _ => false,
        };
        if fits {
            Ok(true)
        } else {
            Err(format!(
                "a {:?} of key {} bringing {data} bytes of data, which it does not fit",
                m.op, m.key
            ))
        }
    })
}
