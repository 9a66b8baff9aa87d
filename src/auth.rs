//! Authentication by the job's secret, which never travels.
//!
//! Every link of a job (a node to the scheduler, a worker to a server) begins with a mutual
//! challenge-response: the side that connects (the initiator) sends a fresh nonce; the side
//! that accepted (the responder) answers with its own nonce and an HMAC-SHA256, keyed by the
//! secret, over both nonces and what the initiator claims (its role, rank and addresses); the
//! initiator checks it, so it never talks on to a process that squats the address, and answers
//! with its own HMAC, which the responder checks. Nonces are fresh on both sides, so nothing
//! seen on the wire can be replayed, and the MACs are compared in constant time.
//!
//! A worker's proof to a server is keyed also by a token that the scheduler drew for that
//! worker's rank: the scheduler gives it to that worker alone (and to the servers), masked with
//! a key of that node's own handshake, so a link can claim only the rank its process was given.

use std::io::Read;

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Bytes of a nonce.
pub const NONCE: usize = 16;
/// Bytes of a MAC (and of a rank's token).
pub const MAC: usize = 32;

/// The shortest secret accepted: a secret a guess can find would let a guesser check each guess
/// offline against one handshake it saw.
pub const MIN_SECRET: usize = 16;

type HmacSha256 = Hmac<Sha256>;

/// `n` random bytes from the kernel.
pub fn random<const N: usize>() -> std::io::Result<[u8; N]> {
    let mut b = [0u8; N];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut b)?;
    Ok(b)
}

fn mac(key: &[&[u8]], parts: &[&[u8]]) -> HmacSha256 {
    let k: Vec<u8> = key.concat();
    // HMAC takes a key of any length: this cannot fail.
    let mut m = HmacSha256::new_from_slice(&k).expect("HMAC takes keys of any length");
    for p in parts {
        // Each part is framed by its length, so that no two sequences of parts collide.
        m.update(&(p.len() as u64).to_le_bytes());
        m.update(p);
    }
    m
}

/// An HMAC of `data` under `key` (the job's side channels).
pub fn plain_mac(key: &[u8], data: &[u8]) -> [u8; MAC] {
    mac(&[key], &[data]).finalize().into_bytes().into()
}

/// Whether `got` is [`plain_mac`] of `data` under `key` (compared in constant time).
pub fn plain_check(key: &[u8], data: &[u8], got: &[u8]) -> bool {
    mac(&[key], &[data]).verify_slice(got).is_ok()
}

/// The two sides of a handshake.
#[derive(Clone, Copy)]
pub enum Side {
    /// The side that connected.
    Initiator,
    /// The side that accepted.
    Responder,
}

impl Side {
    fn label(self) -> &'static [u8] {
        match self {
            Side::Initiator => b"kvstore initiator v1",
            Side::Responder => b"kvstore responder v1",
        }
    }
}

/// The proof that `side` knows `key` (the secret, and a rank's token where there is one), for
/// the handshake of nonces `initiator` and `responder` about `claim`.
pub fn proof(
    key: &[&[u8]],
    side: Side,
    initiator: &[u8; NONCE],
    responder: &[u8; NONCE],
    claim: &[u8],
) -> [u8; MAC] {
    mac(key, &[side.label(), initiator, responder, claim])
        .finalize()
        .into_bytes()
        .into()
}

/// Whether `got` is that proof (compared in constant time).
pub fn check(
    key: &[&[u8]],
    side: Side,
    initiator: &[u8; NONCE],
    responder: &[u8; NONCE],
    claim: &[u8],
    got: &[u8],
) -> bool {
    mac(key, &[side.label(), initiator, responder, claim])
        .verify_slice(got)
        .is_ok()
}

/// The mask that hides a rank's token in the roster of the node whose handshake had these
/// nonces: only a process that knows the secret and took part in it can take it off.
pub fn token_mask(secret: &[u8], initiator: &[u8; NONCE], responder: &[u8; NONCE]) -> [u8; MAC] {
    proof(
        &[secret],
        Side::Responder,
        initiator,
        responder,
        b"token mask",
    )
}

/// What a node claims in its hello to the scheduler (role, rank hint, and the hello's lines
/// after the nonce), which both sides' proofs cover.
pub fn hello_claim(role: u64, hint: u32, rest: &str) -> Vec<u8> {
    format!("{role} {hint}\n{rest}").into_bytes()
}

/// What a worker claims in its hello to a server.
pub fn worker_claim(rank: usize) -> Vec<u8> {
    format!("worker {rank}").into_bytes()
}

/// `a` XOR `b`.
pub fn xor(a: &[u8; MAC], b: &[u8; MAC]) -> [u8; MAC] {
    std::array::from_fn(|i| a[i] ^ b[i])
}

/// Lowercase hex.
pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Bytes of `N` from hex.
pub fn unhex<const N: usize>(s: &str) -> Option<[u8; N]> {
    let s = s.as_bytes();
    if s.len() != 2 * N {
        return None;
    }
    let d = |c: u8| (c as char).to_digit(16).map(|v| v as u8);
    let mut out = [0u8; N];
    for (i, o) in out.iter_mut().enumerate() {
        *o = d(s[2 * i])? << 4 | d(s[2 * i + 1])?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hmac_sha256_matches_rfc_4231() {
        // RFC 4231, test case 2 (key "Jefe"), computed without our length framing.
        let mut m = HmacSha256::new_from_slice(b"Jefe").unwrap();
        m.update(b"what do ya want for nothing?");
        assert_eq!(
            hex(&m.finalize().into_bytes()),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }

    #[test]
    fn proofs_bind_the_key_the_side_the_nonces_and_the_claim() {
        let (i, r) = ([1u8; NONCE], [2u8; NONCE]);
        let p = proof(&[b"secret"], Side::Initiator, &i, &r, b"worker 0");
        assert!(check(
            &[b"secret"],
            Side::Initiator,
            &i,
            &r,
            b"worker 0",
            &p
        ));
        assert!(!check(
            &[b"secreT"],
            Side::Initiator,
            &i,
            &r,
            b"worker 0",
            &p
        ));
        assert!(!check(
            &[b"secret"],
            Side::Responder,
            &i,
            &r,
            b"worker 0",
            &p
        ));
        assert!(!check(
            &[b"secret"],
            Side::Initiator,
            &r,
            &i,
            b"worker 0",
            &p
        ));
        assert!(!check(
            &[b"secret"],
            Side::Initiator,
            &i,
            &r,
            b"worker 1",
            &p
        ));
        assert!(!check(
            &[b"secret"],
            Side::Initiator,
            &i,
            &r,
            b"worker 0",
            &p[..31]
        ));
        // The key is its parts concatenated (the secret, then a fixed-length token).
        let q = proof(&[b"sec", b"ret"], Side::Initiator, &i, &r, b"worker 0");
        assert_eq!(p, q, "the key is the concatenation of its parts");
        let t = token_mask(b"secret", &i, &r);
        assert_eq!(xor(&xor(&p, &t), &t), p);
        assert_eq!(unhex::<MAC>(&hex(&p)), Some(p));
        assert_eq!(unhex::<2>("zz00"), None);
        assert_ne!(random::<NONCE>().unwrap(), random::<NONCE>().unwrap());
    }
}
