//! Two processes' channel: one segment holding a ring, a wake word and a room word per
//! direction, and a page pool per side (each side allocates from its own pool; the other may
//! read and free).

use std::sync::atomic::{fence, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::ring::SLOT;
use crate::{Pool, Ring, Segment, ShmError, Wake};

const MAGIC: u64 = u64::from_le_bytes(*b"KVSHMCH1");
const VERSION: u64 = 2;
const HEADER: usize = 4096;
const WAKE_AB: usize = 128;
const WAKE_BA: usize = 192;
/// Where the producer of each ring asks its consumer for a wake-up when a slot frees.
const ROOM_AB: usize = 256;
const ROOM_BA: usize = 320;

/// The sizes of a channel.
#[derive(Clone, Copy, Debug)]
pub struct ChannelConfig {
    /// Slots per ring.
    pub ring_slots: u64,
    /// Pool page size (a power of two, at least 4096).
    pub page_size: usize,
    /// Pages in each side's pool.
    pub pages: usize,
}

impl Default for ChannelConfig {
    fn default() -> Self {
        ChannelConfig {
            ring_slots: 256,
            page_size: 64 * 1024,
            pages: 2048, // 128 MiB per side, allocated by the kernel only when touched
        }
    }
}

/// Which end of a channel this is: `A` created it, `B` attached to it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// The creator.
    A,
    /// The other process.
    B,
}

/// One end of a channel.
///
/// ```
/// use kvstore_shm::{Channel, ChannelConfig, Segment, SLOT};
/// use std::time::{Duration, Instant};
/// let cfg = ChannelConfig { ring_slots: 8, page_size: 4096, pages: 4 };
/// let a = Channel::create("doc", cfg).unwrap();
/// let b = Channel::attach(Segment::from_fd(a.segment().fd().try_clone_to_owned().unwrap()).unwrap()).unwrap();
/// a.send(b"ping", Instant::now() + Duration::from_secs(1)).unwrap();
/// let mut slot = [0u8; SLOT];
/// b.recv(&mut slot, Duration::ZERO, Instant::now() + Duration::from_secs(1)).unwrap();
/// assert_eq!(&slot[..4], b"ping");
/// ```
pub struct Channel {
    seg: Arc<Segment>,
    side: Side,
    tx: Ring,
    rx: Ring,
    tx_wake: Wake,
    rx_wake: Wake,
    /// This end's request for room in `tx`, and the peer's for room in `rx`.
    tx_room: usize,
    rx_room: usize,
    mine: Pool,
    theirs: Pool,
}

struct Layout {
    ring_ab: usize,
    ring_ba: usize,
    pool_a: usize,
    pool_b: usize,
    total: usize,
}

fn layout(cfg: &ChannelConfig) -> Result<Layout, ShmError> {
    if cfg.page_size < 4096
        || cfg.page_size > Pool::MAX_PAGE
        || !cfg.page_size.is_power_of_two()
        || cfg.pages == 0
        || cfg.ring_slots == 0
    {
        return Err(ShmError::OutOfBounds(format!("bad channel sizes {cfg:?}")));
    }
    // The sizes may come from a peer's header: every step is checked.
    let bad = || ShmError::OutOfBounds(format!("channel sizes {cfg:?} overflow"));
    let ring = Ring::bytes_needed(cfg.ring_slots)
        .ok_or_else(bad)?
        .div_ceil(64)
        * 64;
    let ring_ab = HEADER;
    let ring_ba = ring_ab.checked_add(ring).ok_or_else(bad)?;
    let pool_a = ring_ba
        .checked_add(ring)
        .ok_or_else(bad)?
        .div_ceil(cfg.page_size)
        .checked_mul(cfg.page_size)
        .ok_or_else(bad)?;
    let pool = Pool::bytes_needed(cfg.pages, cfg.page_size).ok_or_else(bad)?;
    let pool_b = pool_a.checked_add(pool).ok_or_else(bad)?;
    Ok(Layout {
        ring_ab,
        ring_ba,
        pool_a,
        pool_b,
        total: pool_b.checked_add(pool).ok_or_else(bad)?,
    })
}

impl Channel {
    /// Creates a channel (side A); pass [`Channel::segment`]'s descriptor to the peer.
    pub fn create(name: &str, cfg: ChannelConfig) -> Result<Channel, ShmError> {
        let l = layout(&cfg)?;
        let seg = Segment::create(name, l.total)?;
        let words = [
            MAGIC,
            VERSION,
            cfg.ring_slots,
            cfg.page_size as u64,
            cfg.pages as u64,
        ];
        for (i, w) in words.iter().enumerate() {
            seg.write(i * 8, &w.to_le_bytes())?;
        }
        Channel::open(Arc::new(seg), Side::A)
    }

    /// Attaches to a channel created by the peer (side B), checking its header.
    pub fn attach(seg: Segment) -> Result<Channel, ShmError> {
        Channel::open(Arc::new(seg), Side::B)
    }

    fn open(seg: Arc<Segment>, side: Side) -> Result<Channel, ShmError> {
        let mut w = [0u64; 5];
        for (i, v) in w.iter_mut().enumerate() {
            let mut b = [0u8; 8];
            seg.read(i * 8, &mut b)?;
            *v = u64::from_le_bytes(b);
        }
        if w[0] != MAGIC || w[1] != VERSION {
            return Err(ShmError::Corrupt(
                "not a kvstore channel (magic or version)".into(),
            ));
        }
        let cfg = ChannelConfig {
            ring_slots: w[2],
            page_size: usize::try_from(w[3]).map_err(|_| ShmError::Corrupt("page size".into()))?,
            pages: usize::try_from(w[4]).map_err(|_| ShmError::Corrupt("pages".into()))?,
        };
        let l = layout(&cfg)?;
        if l.total > seg.len() {
            return Err(ShmError::Corrupt(format!(
                "header says {} bytes, segment has {}",
                l.total,
                seg.len()
            )));
        }
        let ab = Ring::new(seg.clone(), l.ring_ab, cfg.ring_slots)?;
        let ba = Ring::new(seg.clone(), l.ring_ba, cfg.ring_slots)?;
        let pa = Pool::new(seg.clone(), l.pool_a, cfg.pages, cfg.page_size)?;
        let pb = Pool::new(seg.clone(), l.pool_b, cfg.pages, cfg.page_size)?;
        seg.atomic_u32(ROOM_AB)?;
        seg.atomic_u32(ROOM_BA)?;
        let wab = Wake::new(seg.clone(), WAKE_AB)?;
        let wba = Wake::new(seg.clone(), WAKE_BA)?;
        Ok(match side {
            Side::A => Channel {
                seg,
                side,
                tx: ab,
                rx: ba,
                tx_wake: wab,
                rx_wake: wba,
                tx_room: ROOM_AB,
                rx_room: ROOM_BA,
                mine: pa,
                theirs: pb,
            },
            Side::B => Channel {
                seg,
                side,
                tx: ba,
                rx: ab,
                tx_wake: wba,
                rx_wake: wab,
                tx_room: ROOM_BA,
                rx_room: ROOM_AB,
                mine: pb,
                theirs: pa,
            },
        })
    }

    /// The segment (its descriptor goes to the peer; data is read and written through it).
    pub fn segment(&self) -> &Arc<Segment> {
        &self.seg
    }

    /// This end's side.
    pub fn side(&self) -> Side {
        self.side
    }

    /// The pool this end allocates from.
    pub fn my_pool(&self) -> &Pool {
        &self.mine
    }

    /// The pool the peer allocates from (this end may check, read and free its regions).
    pub fn peer_pool(&self) -> &Pool {
        &self.theirs
    }

    /// Posts a descriptor (at most [`SLOT`] bytes) to the peer, waiting while the ring is full.
    pub fn send(&self, slot: &[u8], deadline: Instant) -> Result<(), ShmError> {
        loop {
            if self.tx.try_push(slot)? {
                return self.tx_wake.notify();
            }
            if Instant::now() >= deadline {
                return Err(ShmError::Timeout);
            }
            std::thread::yield_now();
        }
    }

    /// Posts a descriptor if the ring has room (`Ok(false)` if it is full), waking the peer.
    pub fn try_send(&self, slot: &[u8]) -> Result<bool, ShmError> {
        if self.tx.try_push(slot)? {
            self.tx_wake.notify()?;
            return Ok(true);
        }
        Ok(false)
    }

    /// Posts a descriptor if the ring has room (`Ok(false)` if it is full) without waking the
    /// peer: a chain of posts is followed by one [`Channel::wake_peer`].
    pub fn try_post(&self, slot: &[u8]) -> Result<bool, ShmError> {
        self.tx.try_push(slot)
    }

    /// Whether the ring to the peer is full (a post would be refused until the peer takes one).
    pub fn tx_full(&self) -> bool {
        self.tx.is_full()
    }

    /// Before this end sleeps with the ring to the peer full (a post refused): asks the peer to
    /// wake it when it next takes descriptors ([`Channel::took`]). Returns whether the ring has
    /// room already, in which case no wake-up may come: post now instead of sleeping.
    pub fn want_room(&self) -> Result<bool, ShmError> {
        let room = self.seg.atomic_u32(self.tx_room)?;
        room.store(1, Ordering::Relaxed);
        // Pairs with the fence in `took`: either this sees the slot the peer freed, or the
        // peer sees the request.
        fence(Ordering::SeqCst);
        if self.tx.is_full() {
            return Ok(false);
        }
        // Room already, and nobody sleeps on the request: withdrawn, so no ring comes for it.
        room.store(0, Ordering::Relaxed);
        Ok(true)
    }

    /// After taking descriptors off the ring from the peer: wakes the peer if it asked for
    /// room ([`Channel::want_room`]), since the slots it waits for are free now.
    pub fn took(&self) -> Result<(), ShmError> {
        fence(Ordering::SeqCst);
        let w = self.seg.atomic_u32(self.rx_room)?;
        if w.load(Ordering::Relaxed) != 0 && w.swap(0, Ordering::Relaxed) != 0 {
            self.tx_wake.ring()?;
        }
        Ok(())
    }

    /// Wakes the peer if it sleeps (after [`Channel::try_post`]).
    pub fn wake_peer(&self) -> Result<(), ShmError> {
        self.tx_wake.notify()
    }

    /// Whether a descriptor is waiting.
    pub fn rx_pending(&self) -> bool {
        !self.rx.is_empty()
    }

    /// Takes the next descriptor if there is one.
    pub fn try_recv(&self, slot: &mut [u8; SLOT]) -> Result<bool, ShmError> {
        self.rx.try_pop(slot)
    }

    /// Rings `doorbell` too (the ringing end of the peer's [`crate::doorbell`]) when the peer
    /// sleeps after this end sends (it waits on the other end in its poll loop).
    pub fn set_tx_doorbell(&mut self, doorbell: std::os::fd::OwnedFd) {
        self.tx_wake.set_doorbell(doorbell);
    }

    /// Before sleeping elsewhere (on a doorbell): marks this end asleep. Returns `false` (and
    /// stays awake) if a descriptor is already waiting.
    pub fn arm_rx(&self) -> Result<bool, ShmError> {
        self.rx_wake.arm()?;
        if !self.rx.is_empty() {
            self.rx_wake.disarm()?;
            return Ok(false);
        }
        Ok(true)
    }

    /// Awake again after [`Channel::arm_rx`].
    pub fn disarm_rx(&self) -> Result<(), ShmError> {
        self.rx_wake.disarm()
    }

    /// Waits for the next descriptor: spins for `spin`, then sleeps, until `deadline`.
    pub fn recv(
        &self,
        slot: &mut [u8; SLOT],
        spin: Duration,
        deadline: Instant,
    ) -> Result<(), ShmError> {
        loop {
            if self.rx.try_pop(slot)? {
                return Ok(());
            }
            self.rx_wake.wait(|| !self.rx.is_empty(), spin, deadline)?;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair() -> (Channel, Channel) {
        let cfg = ChannelConfig {
            ring_slots: 16,
            page_size: 4096,
            pages: 32,
        };
        let a = Channel::create("chan", cfg).unwrap();
        let fd = a.segment().fd().try_clone_to_owned().unwrap();
        let b = Channel::attach(Segment::from_fd(fd).unwrap()).unwrap();
        (a, b)
    }

    /// A header whose sizes overflow when multiplied (2^34 pages of 1 GiB is 2^64 bytes, which
    /// wraps to 0) is refused, never mapped as an empty or wrapped layout.
    #[test]
    fn a_header_whose_sizes_overflow_is_refused() {
        let (a, _) = pair();
        for (slots, page, pages) in [
            (16u64, 1u64 << 30, 1u64 << 34),
            (1 << 56, 4096, 32),
            (16, 1 << 62, 2),
            (16, 4096, u64::MAX),
        ] {
            for (i, w) in [slots, page, pages].iter().enumerate() {
                a.segment().write((2 + i) * 8, &w.to_le_bytes()).unwrap();
            }
            let fd = a.segment().fd().try_clone_to_owned().unwrap();
            let r = Channel::attach(Segment::from_fd(fd).unwrap());
            assert!(
                r.is_err(),
                "slots {slots}, page {page}, pages {pages} was taken"
            );
        }
        assert!(Pool::bytes_needed(1 << 34, 1 << 30).is_none());
    }

    #[test]
    fn both_directions_and_both_pools() {
        let (a, b) = pair();
        let deadline = Instant::now() + Duration::from_secs(5);
        let r = a.my_pool().alloc(5000).unwrap();
        a.segment().write(r.offset, &[7u8; 5000]).unwrap();
        let mut d = [0u8; 16];
        d[..8].copy_from_slice(&(r.offset as u64).to_le_bytes());
        d[8..].copy_from_slice(&(r.len as u64).to_le_bytes());
        a.send(&d, deadline).unwrap();
        let mut slot = [0u8; SLOT];
        b.recv(&mut slot, Duration::from_micros(50), deadline)
            .unwrap();
        let got = crate::Region {
            offset: u64::from_le_bytes(slot[..8].try_into().unwrap()) as usize,
            len: u64::from_le_bytes(slot[8..16].try_into().unwrap()) as usize,
        };
        b.peer_pool().check(got).unwrap();
        let mut data = vec![0u8; got.len];
        b.segment().read(got.offset, &mut data).unwrap();
        assert!(data.iter().all(|&x| x == 7));
        b.peer_pool().free(got).unwrap();
        assert!(
            b.peer_pool().check(got).is_err(),
            "a freed region is refused"
        );
        assert_eq!(a.my_pool().free_pages(), 32);
        b.send(b"back", deadline).unwrap();
        a.recv(&mut slot, Duration::ZERO, deadline).unwrap();
        assert_eq!(&slot[..4], b"back");
        assert!(!a.try_recv(&mut slot).unwrap());
    }

    /// A producer that found the ring full and asked for room is rung (on its doorbell) once
    /// the consumer takes a descriptor; one that did not ask is not.
    #[test]
    fn a_producer_that_asked_for_room_is_rung_when_a_slot_frees() {
        let (a, mut b) = pair();
        let (bell, ring) = crate::doorbell().unwrap();
        b.set_tx_doorbell(ring);
        let rung = || {
            let mut c = [0u8; 8];
            let got = rustix::net::recv(&bell, &mut c, rustix::net::RecvFlags::DONTWAIT).is_ok();
            crate::drain_doorbell(&bell);
            got
        };
        let mut slot = [0u8; SLOT];
        while a.try_post(b"x").unwrap() {}
        assert!(b.try_recv(&mut slot).unwrap() && a.try_post(b"x").unwrap());
        b.took().unwrap();
        assert!(!rung(), "nobody asked");
        assert!(!a.want_room().unwrap(), "a full ring");
        assert!(!rung());
        assert!(b.try_recv(&mut slot).unwrap());
        b.took().unwrap();
        assert!(rung(), "a freed slot rings the producer that asked");
        b.took().unwrap();
        assert!(!rung(), "a request rings once");
        assert!(a.want_room().unwrap(), "room now");
    }

    #[test]
    fn a_foreign_segment_is_refused() {
        let seg = Segment::create("junk", 1 << 20).unwrap();
        assert!(matches!(Channel::attach(seg), Err(ShmError::Corrupt(_))));
    }
}
