//! AFL target: `kvstore::fuzz::protocol` on every input (see tests/fuzz/run.sh).
fn main() {
    afl::fuzz!(|data: &[u8]| {
        kvstore::fuzz::protocol(data);
    });
}
