//! Entry points for the fuzzers (`tests/fuzz`, afl.rs) and for the regression tests that replay
//! what they found (feature `internals`, not an API): arbitrary bytes through the decoders of
//! what peers send (a message's header and body, a batch, the roster, the handshake's hex),
//! which must never panic or allocate what the bytes merely claim.

use crate::protocol::{batch, Msg};

/// A message body, and a batch made of it; the roster and the handshake's words as text.
pub fn protocol(data: &[u8]) {
    if let Ok((m, rest)) = Msg::from_body(data) {
        assert_eq!(
            Msg::decode(&m.encode()).ok(),
            Some(m),
            "a header decodes as it encodes"
        );
        let _ = (
            m.data_bytes(),
            m.value_bytes(),
            m.payload_layout(),
            m.compression(),
        );
        // The data that came with it: as much as the header's last byte says, at most what
        // is left.
        let data_len = rest.len().min(data.last().map_or(0, |&b| b as usize * 64));
        if let Ok(entries) = batch::read(&m, rest, data_len, |_| true) {
            for e in entries {
                if let Some(r) = e.data {
                    assert!(r.end <= data_len, "an entry's data past what came");
                }
            }
        }
    }
    // A SetOptimizer's body (a worker's optimizer, scheduler and multipliers), and saved
    // optimizer states (a LoadStates body): a server reads both from its peers.
    if let Ok(m) = crate::Optimizer::decode_with_mults(data) {
        let mut u = crate::OptimizerUpdater::new(m);
        let mut w = crate::NDArray::zeros(&[2]);
        for _ in 0..3 {
            let _ = u.update(&crate::Key::Int(0), &crate::NDArray::ones(&[2]), &mut w);
        }
        let _ = u.learning_rate();
    }
    // Saved states, then updates of float32 and float16 weights from them (a master copy or
    // moments of any size the bytes claim).
    let mut u = crate::OptimizerUpdater::new(crate::Optimizer::adam(0.1));
    if u.load_states(data).is_ok() {
        let mut w = crate::NDArray::zeros(&[2]);
        let mut h = crate::NDArray::zeros_dtype(&[2], crate::DType::F16);
        let g = crate::NDArray::ones(&[2]);
        let gh = crate::NDArray::full_dtype(&[2], 1.0, crate::DType::F16);
        for key in [0, 1, 2] {
            let _ = u.update(&crate::Key::Int(key), &g, &mut w);
            let _ = u.update(&crate::Key::Int(key), &gh, &mut h);
        }
    }
    // What a node's hello says of it, after its nonce (the scheduler reads it).
    let _ = crate::scheduler::node_lines(data);
    let text = String::from_utf8_lossy(data);
    let _ = crate::roles::parse_roster(&text, &[0x5a; crate::auth::MAC]);
    for word in text.split_whitespace() {
        let _ = crate::auth::unhex::<{ crate::auth::NONCE }>(word);
        let _ = crate::auth::unhex::<{ crate::auth::MAC }>(word);
    }
}
