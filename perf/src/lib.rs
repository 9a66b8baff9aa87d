//! Measurement helpers for `kvperf`: size arguments, reference figures measured in the same
//! run (a plain blocking-socket stream, `iperf3` when installed), and result formatting.
#![deny(missing_docs)]

pub mod chart;
pub mod compress;
pub mod conn;
#[cfg(feature = "cuda")]
pub mod gpu;
pub mod limit;
pub mod raw;
pub mod reference;
pub mod staging;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::Command;
use std::time::{Duration, Instant};

/// Parses `4096`, `4K`, `64M`, `1G` (binary multiples).
pub fn parse_size(s: &str) -> Result<usize, String> {
    let s = s.trim();
    let (num, mult) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1usize << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    let n: usize = num
        .parse()
        .map_err(|_| format!("{s:?} is not a size (e.g. 4096, 4K, 64M)"))?;
    n.checked_mul(mult)
        .filter(|&v| v > 0)
        .ok_or_else(|| format!("{s:?} is out of range"))
}

/// Parses `MIN:MAX` into the powers of two from MIN to MAX (both rounded up to a power of two).
pub fn parse_sizes(s: &str) -> Result<Vec<usize>, String> {
    let (a, b) = s
        .split_once(':')
        .ok_or_else(|| format!("{s:?}: expected MIN:MAX, e.g. 4K:64M"))?;
    let (lo, hi) = (parse_size(a)?, parse_size(b)?);
    if lo > hi {
        return Err(format!("{s:?}: MIN is larger than MAX"));
    }
    let mut v = Vec::new();
    let mut x = lo.checked_next_power_of_two();
    while let Some(p) = x.filter(|&p| p <= hi) {
        v.push(p);
        x = p.checked_mul(2);
    }
    if v.is_empty() {
        return Err(format!("{s:?}: no power of two from MIN to MAX"));
    }
    Ok(v)
}

/// A JSON number, or null where there is none (JSON has no NaN).
pub fn json_num(x: f64) -> serde_json::Value {
    serde_json::Number::from_f64(x).map_or(serde_json::Value::Null, Into::into)
}

/// A table cell: `-` where there is no figure.
pub fn cell(x: f64, prec: usize) -> String {
    if x.is_finite() {
        format!("{x:.prec$}")
    } else {
        "-".into()
    }
}

/// A number of a child's JSON line (NaN where there is none).
pub fn field(line: &str, name: &str) -> f64 {
    serde_json::from_str::<serde_json::Value>(line)
        .ok()
        .and_then(|v| v.get(name).and_then(serde_json::Value::as_f64))
        .unwrap_or(f64::NAN)
}

/// A string of a child's JSON line ("-" where there is none).
pub fn text_field(line: &str, name: &str) -> String {
    serde_json::from_str::<serde_json::Value>(line)
        .ok()
        .and_then(|v| v.get(name).and_then(|s| s.as_str().map(str::to_string)))
        .unwrap_or_else(|| "-".into())
}

/// The median of `samples` (the upper one of an even count), sorting them.
pub fn median(samples: &mut [f64]) -> f64 {
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}

/// `4096` → `4K`, `67108864` → `64M`.
pub fn format_size(n: usize) -> String {
    match n {
        n if n >= 1 << 30 && n % (1 << 30) == 0 => format!("{}G", n >> 30),
        n if n >= 1 << 20 && n % (1 << 20) == 0 => format!("{}M", n >> 20),
        n if n >= 1 << 10 && n % (1 << 10) == 0 => format!("{}K", n >> 10),
        n => n.to_string(),
    }
}

/// Bandwidth of one plain blocking TCP stream over loopback (the sender writes `chunk`-byte
/// buffers for `dur`), in bytes per second: the floor any TCP transport is held against.
pub fn loopback_stream_bandwidth(chunk: usize, dur: Duration) -> std::io::Result<f64> {
    let l = TcpListener::bind("127.0.0.1:0")?;
    let addr = l.local_addr()?;
    let reader = std::thread::spawn(move || -> std::io::Result<u64> {
        let (mut s, _) = l.accept()?;
        let mut buf = vec![0u8; 1 << 20];
        let mut total = 0u64;
        loop {
            match s.read(&mut buf)? {
                0 => return Ok(total),
                n => total += n as u64,
            }
        }
    });
    let mut s = TcpStream::connect(addr)?;
    let buf = vec![1u8; chunk];
    let start = Instant::now();
    while start.elapsed() < dur {
        s.write_all(&buf)?;
    }
    drop(s);
    let total = reader
        .join()
        .map_err(|_| std::io::Error::other("reader panicked"))??;
    Ok(total as f64 / start.elapsed().as_secs_f64())
}

/// Single-stream loopback bandwidth measured by `iperf3` (bytes per second), if it is installed.
pub fn iperf3_loopback(secs: u32) -> Option<f64> {
    let port = TcpListener::bind("127.0.0.1:0")
        .ok()?
        .local_addr()
        .ok()?
        .port();
    let mut server = Command::new("iperf3")
        .args(["-s", "-1", "-B", "127.0.0.1", "-p", &port.to_string()])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .ok()?;
    std::thread::sleep(Duration::from_millis(300));
    let out = Command::new("iperf3")
        .args([
            "-c",
            "127.0.0.1",
            "-p",
            &port.to_string(),
            "-t",
            &secs.to_string(),
            "--json",
        ])
        .output()
        .ok();
    let _ = server.kill();
    let _ = server.wait();
    let text = String::from_utf8_lossy(&out?.stdout).into_owned();
    // The receiver's summary: "sum_received": { ..., "bits_per_second": X, ... }.
    let rest = text.split("\"sum_received\"").nth(1)?;
    let v = rest.split("\"bits_per_second\":").nth(1)?;
    let num = v.trim_start().split([',', '}', '\n']).next()?.trim();
    num.parse::<f64>().ok().map(|bits| bits / 8.0)
}

/// `n` elements starting at a page, as a reference's buffers are: heap vectors allocated back
/// to back lie a few bytes apart modulo a page, where glibc's copies of 2 KiB to 512 KiB run
/// 15-30x slower on AMD CPUs (see `kvstore_transport::copy`).
pub struct Paged<T> {
    buf: Vec<T>,
    at: usize,
    n: usize,
}

impl<T: Clone> Paged<T> {
    /// `n` copies of `fill`, the first at a page.
    pub fn new(n: usize, fill: T) -> Paged<T> {
        let page = (4096 / std::mem::size_of::<T>().max(1)).max(1);
        let buf = vec![fill; n + page];
        let at = buf.as_ptr().align_offset(4096).min(page);
        Paged { buf, at, n }
    }
}

impl<T> std::ops::Deref for Paged<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &self.buf[self.at..self.at + self.n]
    }
}

impl<T> std::ops::DerefMut for Paged<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        &mut self.buf[self.at..self.at + self.n]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4K"), Ok(4096));
        assert_eq!(parse_size("64M"), Ok(64 << 20));
        assert_eq!(parse_size("17"), Ok(17));
        assert!(parse_size("x").is_err());
        assert!(parse_size("0").is_err());
        assert_eq!(parse_sizes("8:64").unwrap(), vec![8, 16, 32, 64]);
        assert_eq!(parse_sizes("4K:16K").unwrap(), vec![4096, 8192, 16384]);
        assert!(parse_sizes("64:8").is_err());
        assert!(parse_sizes("64").is_err());
        // A range up to the largest size ends at the largest power of two (no overflow).
        let top = parse_sizes(&format!("{}:{}", 1usize << 62, usize::MAX)).unwrap();
        assert_eq!(top, vec![1usize << 62, 1 << 63]);
        assert!(parse_sizes(&format!("{}:{}", (1usize << 63) + 1, usize::MAX)).is_err());
        assert_eq!(format_size(64 << 20), "64M");
        assert_eq!(format_size(1000), "1000");
    }

    #[test]
    fn the_loopback_reference_is_positive() {
        let bw = loopback_stream_bandwidth(1 << 16, Duration::from_millis(100)).unwrap();
        assert!(bw > 0.0);
    }
}
