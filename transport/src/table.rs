//! Peers by number: a backend numbers its peers 0, 1, 2, ... and never reuses a number, so a
//! vector indexed by number finds one without hashing on the hot path.

/// A map from peer numbers to `T`.
pub(crate) struct PeerTable<T> {
    slots: Vec<Option<Box<T>>>,
}

impl<T> PeerTable<T> {
    pub fn new() -> Self {
        PeerTable { slots: Vec::new() }
    }

    pub fn is_empty(&self) -> bool {
        self.slots.iter().all(Option::is_none)
    }

    pub fn get(&self, id: &u32) -> Option<&T> {
        self.slots.get(*id as usize)?.as_deref()
    }

    pub fn get_mut(&mut self, id: &u32) -> Option<&mut T> {
        self.slots.get_mut(*id as usize)?.as_deref_mut()
    }

    pub fn insert(&mut self, id: u32, v: T) {
        let i = id as usize;
        if self.slots.len() <= i {
            self.slots.resize_with(i + 1, || None);
        }
        self.slots[i] = Some(Box::new(v));
    }

    pub fn remove(&mut self, id: &u32) -> Option<T> {
        self.slots.get_mut(*id as usize)?.take().map(|v| *v)
    }

    pub fn iter(&self) -> impl Iterator<Item = (u32, &T)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.as_deref().map(|p| (i as u32, p)))
    }

    pub fn iter_mut(&mut self) -> impl Iterator<Item = (u32, &mut T)> {
        self.slots
            .iter_mut()
            .enumerate()
            .filter_map(|(i, s)| s.as_deref_mut().map(|p| (i as u32, p)))
    }

    pub fn values(&self) -> impl Iterator<Item = &T> {
        self.slots.iter().filter_map(|s| s.as_deref())
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
    }
}
