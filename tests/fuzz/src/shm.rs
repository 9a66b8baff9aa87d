//! AFL target: `kvstore_transport::fuzz::shm` on every input (see tests/fuzz/run.sh).
fn main() {
    afl::fuzz!(|data: &[u8]| {
        kvstore_transport::fuzz::shm(data);
    });
}
