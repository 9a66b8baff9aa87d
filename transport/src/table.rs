//! Peers by number: a backend numbers its peers 0, 1, 2, ... and never reuses a number. The
//! live ones are kept dense and in order of number, so what every loop turn walks (all peers,
//! or whether there is one) costs the live peers alone, however many came and went (a stranger
//! that connects and leaves a million times leaves nothing behind), and a lookup is a binary
//! search over them, no hashing on the hot path.

/// A map from peer numbers to `T`.
pub(crate) struct PeerTable<T> {
    /// By number, ascending.
    live: Vec<(u32, Box<T>)>,
}

impl<T> PeerTable<T> {
    pub fn new() -> Self {
        PeerTable { live: Vec::new() }
    }

    pub fn is_empty(&self) -> bool {
        self.live.is_empty()
    }

    fn find(&self, id: u32) -> Result<usize, usize> {
        // Numbers are given in order, so the newest peer is the likeliest last one.
        match self.live.last() {
            Some(&(last, _)) if last == id => Ok(self.live.len() - 1),
            Some(&(last, _)) if last < id => Err(self.live.len()),
            _ => self.live.binary_search_by_key(&id, |(i, _)| *i),
        }
    }

    pub fn get(&self, id: &u32) -> Option<&T> {
        let i = self.find(*id).ok()?;
        Some(&self.live[i].1)
    }

    pub fn get_mut(&mut self, id: &u32) -> Option<&mut T> {
        let i = self.find(*id).ok()?;
        Some(&mut self.live[i].1)
    }

    pub fn insert(&mut self, id: u32, v: T) {
        match self.find(id) {
            Ok(i) => *self.live[i].1 = v,
            Err(i) => self.live.insert(i, (id, Box::new(v))),
        }
    }

    pub fn remove(&mut self, id: &u32) -> Option<T> {
        let i = self.find(*id).ok()?;
        let (_, v) = self.live.remove(i);
        if self.live.capacity() > 64 && self.live.len() < self.live.capacity() / 4 {
            self.live.shrink_to(self.live.len() * 2);
        }
        Some(*v)
    }

    pub fn iter(&self) -> impl Iterator<Item = (u32, &T)> {
        self.live.iter().map(|(i, p)| (*i, &**p))
    }

    pub fn iter_mut(&mut self) -> impl Iterator<Item = (u32, &mut T)> {
        self.live.iter_mut().map(|(i, p)| (*i, &mut **p))
    }

    pub fn values(&self) -> impl Iterator<Item = &T> {
        self.live.iter().map(|(_, p)| &**p)
    }

    pub fn keys(&self) -> impl Iterator<Item = u32> + '_ {
        self.iter().map(|(i, _)| i)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn insert_get_remove_and_iterate() {
        let mut t = PeerTable::new();
        t.insert(0, "a");
        t.insert(3, "d");
        assert_eq!(t.values().count(), 2);
        assert_eq!(t.get(&3), Some(&"d"));
        assert_eq!(t.get(&1), None);
        assert_eq!(t.get(&99), None);
        assert_eq!(t.keys().collect::<Vec<_>>(), vec![0, 3]);
        assert_eq!(t.remove(&0), Some("a"));
        assert_eq!(t.remove(&0), None);
        assert_eq!(t.values().count(), 1);
        *t.get_mut(&3).unwrap() = "e";
        assert_eq!(t.values().collect::<Vec<_>>(), vec![&"e"]);
        // Out of order, and a number given again replaces its value.
        t.insert(1, "b");
        t.insert(1, "c");
        assert_eq!(t.iter().collect::<Vec<_>>(), vec![(1, &"c"), (3, &"e")]);
    }

    #[test]
    fn peers_that_came_and_went_leave_nothing_behind() {
        let mut t = PeerTable::new();
        t.insert(0, 0u32);
        for id in 1..100_000 {
            t.insert(id, id);
            assert_eq!(t.get(&id), Some(&id));
            assert_eq!(t.remove(&id), Some(id));
        }
        // What a loop turn walks is the one live peer.
        assert_eq!(t.keys().collect::<Vec<_>>(), vec![0]);
        // A thousand at once, then all but one gone: the memory goes back.
        for id in 100_000..101_000 {
            t.insert(id, id);
        }
        assert!(t.live.capacity() >= 1001);
        for id in 100_000..101_000 {
            assert_eq!(t.remove(&id), Some(id));
        }
        assert!(t.live.capacity() <= 64, "{}", t.live.capacity());
        assert!(!t.is_empty());
        assert_eq!(t.remove(&0), Some(0));
        assert!(t.is_empty());
    }
}
