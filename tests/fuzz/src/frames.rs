//! AFL target: `kvstore_transport::fuzz::frames` on every input (see tests/fuzz/run.sh).
fn main() {
    afl::fuzz!(|data: &[u8]| {
        kvstore_transport::fuzz::frames(data);
    });
}
