//! A child's output, copied to kvrun's own with each piece prefixed by who wrote it.

use std::io::{BufRead, BufReader, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use crate::child::STARTED;

/// The most of one line that is held before it is written out: a child's output with no line
/// ends (a binary file, say) goes out in pieces of this size, each prefixed.
const MAX_LINE: usize = 64 * 1024;

/// Writes of the children's output under way, and when the last one ended (milliseconds from
/// [`epoch`]): kvrun waits for its output while it still flows ([`flowing`]), however slowly
/// its own stdout drains (a pipe to a slow reader), as mpirun does.
static IN_WRITE: AtomicUsize = AtomicUsize::new(0);
static LAST_WRITE_MS: AtomicU64 = AtomicU64::new(0);

fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

/// Whether a write of the children's output is under way, or one ended within `recently`.
pub(crate) fn flowing(recently: Duration) -> bool {
    let last = Duration::from_millis(LAST_WRITE_MS.load(Ordering::Relaxed));
    IN_WRITE.load(Ordering::Relaxed) > 0 || epoch().elapsed().saturating_sub(last) < recently
}

/// The next piece of a child's output to write: up to and including a `\n` or a `\r` (a
/// progress bar redraws its line with `\r`: each redraw goes out as it comes, prefixed, so the
/// bar moves), or [`MAX_LINE`] bytes of a longer line. Appended to `piece`; `Ok(false)` at the
/// end of the output.
fn next_piece(r: &mut impl BufRead, piece: &mut Vec<u8>) -> std::io::Result<bool> {
    loop {
        let buf = match r.fill_buf() {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if buf.is_empty() {
            return Ok(!piece.is_empty());
        }
        let room = MAX_LINE - piece.len();
        let (n, ends) = match buf
            .iter()
            .take(room)
            .position(|&b| b == b'\n' || b == b'\r')
        {
            // A `\r\n` seen whole is one line end.
            Some(i) if buf[i] == b'\r' && buf.get(i + 1) == Some(&b'\n') => (i + 2, true),
            Some(i) => (i + 1, true),
            None => (buf.len().min(room), buf.len() >= room),
        };
        piece.extend_from_slice(&buf[..n]);
        r.consume(n);
        if ends {
            return Ok(true);
        }
    }
}

pub(crate) fn forward(
    prefix: String,
    from: impl std::io::Read + Send + 'static,
    to_stderr: bool,
    mut started: Option<Arc<AtomicBool>>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut r = BufReader::new(from);
        let mut line = Vec::new();
        let mut after_cr = false;
        loop {
            line.clear();
            match next_piece(&mut r, &mut line) {
                Ok(false) | Err(_) => return,
                // A remote wrapper's line that says it runs: taken, not shown (what a login
                // prints on stderr, such as ssh's warnings, may come before it).
                Ok(true) if started.is_some() && line == STARTED => {
                    if let Some(s) = started.take() {
                        s.store(true, Ordering::Relaxed);
                    }
                }
                Ok(true) => {
                    frame(&prefix, &mut line, &mut after_cr);
                    // Flushed: stdout holds what does not end in a newline (a redraw).
                    epoch();
                    IN_WRITE.fetch_add(1, Ordering::Relaxed);
                    let _ = if to_stderr {
                        std::io::stderr().lock().write_all(&line)
                    } else {
                        let mut out = std::io::stdout().lock();
                        out.write_all(&line).and_then(|()| out.flush())
                    };
                    let now = epoch().elapsed().as_millis() as u64;
                    LAST_WRITE_MS.store(now, Ordering::Relaxed);
                    IN_WRITE.fetch_sub(1, Ordering::Relaxed);
                }
            }
        }
    })
}

/// Makes `piece` what goes out, in one write (lines of several processes never interleave):
/// its bytes as they came (not every program writes UTF-8) after the prefix, with a line end
/// where the output ended without one. A lone `\n` just after a piece that ended in `\r` is
/// the rest of a `\r\n` that two reads split: it goes out alone, not as an empty line.
fn frame(prefix: &str, piece: &mut Vec<u8>, after_cr: &mut bool) {
    let rest_of_crlf = *after_cr && piece.as_slice() == b"\n";
    *after_cr = piece.last() == Some(&b'\r');
    if rest_of_crlf {
        return;
    }
    if !matches!(piece.last(), Some(b'\n' | b'\r')) {
        piece.push(b'\n');
    }
    piece.splice(0..0, prefix.bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_goes_out_by_lines_redraws_and_bounded_pieces() {
        let mut out = Vec::new();
        out.extend_from_slice(b"one\n 10%\r 20%\rtwo\r\n");
        out.extend(std::iter::repeat_n(b'x', MAX_LINE + 5));
        out.extend_from_slice(b"\nlast");
        // A small buffer, so that pieces span refills (`two\r\n` lies within one).
        let mut r = BufReader::with_capacity(7, &out[..]);
        let mut pieces = Vec::new();
        let mut piece = Vec::new();
        while next_piece(&mut r, &mut piece).unwrap() {
            pieces.push(std::mem::take(&mut piece));
        }
        let x = |n| vec![b'x'; n];
        let mut tail = x(5);
        tail.push(b'\n');
        assert_eq!(
            pieces,
            [
                b"one\n".to_vec(),
                b" 10%\r".to_vec(),
                b" 20%\r".to_vec(),
                b"two\r\n".to_vec(),
                x(MAX_LINE),
                tail,
                b"last".to_vec(),
            ]
        );
    }

    #[test]
    fn a_line_end_split_between_two_reads_is_one_line_end() {
        let mut after_cr = false;
        let out: Vec<Vec<u8>> = [&b"a\r"[..], b"\n", b"\n", b"b\r", b"c"]
            .iter()
            .map(|p| {
                let mut p = p.to_vec();
                frame("[w] ", &mut p, &mut after_cr);
                p
            })
            .collect();
        let want: [&[u8]; 5] = [b"[w] a\r", b"\n", b"[w] \n", b"[w] b\r", b"[w] c\n"];
        assert_eq!(out, want);
    }
}
