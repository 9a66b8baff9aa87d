//! The registrations of memory this backend sends from or lends: cached by the storage's
//! identity, dropped once the storage is gone.

use std::sync::Arc;

use super::verbs::{Mr, LOCAL, REMOTE_READ};
use super::RdmaBackend;
use crate::{Region, TransportError};

impl RdmaBackend {
    /// The registration of `r`'s storage: cached by the storage's identity (a live `Arc`
    /// with the same address and length), registered anew when the cached one is stale.
    pub(super) fn mr_of(&mut self, r: &Region) -> Result<Arc<Mr>, TransportError> {
        r.check_owner(self.id)?;
        let key = (r.mem.ptr() as usize, r.len());
        if let Some((w, mr)) = self.cache.get(&key) {
            if w.upgrade()
                .is_some_and(|m| Arc::as_ptr(&m).cast::<u8>() == Arc::as_ptr(&r.mem).cast::<u8>())
            {
                return Ok(mr.clone());
            }
        }
        self.registrations += 1;
        self.sweep_registrations();
        let mr = Arc::new(Mr::new_unheld(
            &self.pd,
            &r.mem,
            0,
            r.len(),
            LOCAL | REMOTE_READ,
        )?);
        self.count_dmabuf(r, &mr);
        self.cache.insert(key, (Arc::downgrade(&r.mem), mr.clone()));
        Ok(mr)
    }

    /// Drops the cached registrations of storage that is gone: their pages are unpinned (a
    /// registration pins them, and counts them against the locked-memory limit), and memory
    /// the allocator hands out again is not left readable through an old key. Done at every
    /// new registration and now and then as the backend progresses.
    pub(super) fn sweep_registrations(&mut self) {
        self.cache.retain(|_, (w, _)| w.strong_count() > 0);
    }

    /// Counts a registration of storage that names a dma-buf.
    pub(super) fn count_dmabuf(&mut self, r: &Region, mr: &Mr) {
        if r.mem.dmabuf().is_some() {
            self.dmabuf.0 += 1;
            self.dmabuf.1 += u64::from(mr.on_device);
            if let Some(why) = &mr.dmabuf_refused {
                self.dmabuf.2 = Some(why.clone());
            }
        }
    }

    /// Registrations of storage that names a dma-buf ([`crate::Storage::dmabuf`]): how many
    /// were tried, how many the device took (the rest registered the host bytes), and why it
    /// refused the last one it refused.
    pub fn dmabuf_registrations(&self) -> (u64, u64, Option<&str>) {
        (self.dmabuf.0, self.dmabuf.1, self.dmabuf.2.as_deref())
    }

    /// Registrations made so far (a cache hit makes none): for tests of the cache.
    pub fn registrations(&self) -> u64 {
        self.registrations
    }

    /// Registrations held in the cache now (those of storage that is gone are dropped at the
    /// next registration, or within milliseconds of progress): for tests of the cache.
    pub fn cached_registrations(&self) -> usize {
        self.cache.len()
    }
}
