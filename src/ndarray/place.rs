//! Where an array's bytes live: on a device ([`NDArray::on`], copies between devices and the
//! host), in memory a transport allocated or registered (`KVStore::alloc`, `alloc_on`), and
//! page-locked for GPUs' copies.

use std::sync::Arc;

use super::{checked_bytes, NDArray};
use crate::storage::{AlignedBuf, Storage};
use crate::{DType, Device, Result};

impl NDArray {
    /// Zeros on `device` for a transport to move (`KVStore::alloc_on`): in `region` (a
    /// transport's zeroed pages of the array's size) where given, else in memory of the
    /// array's own; page-locked for GPUs' copies where CUDA can. On a GPU, that memory is the
    /// array's host copy.
    pub(crate) fn zeros_staged(
        shape: &[usize],
        dtype: DType,
        region: Option<kvstore_transport::Region>,
        device: Device,
    ) -> Result<NDArray> {
        let bytes = checked_bytes(shape, dtype)?;
        crate::gpu::check(device)?;
        let host = match region {
            Some(region) => Storage::pinned_region(region),
            None => Storage::Heap(
                AlignedBuf::try_zeroed_pinned(bytes)
                    .ok_or_else(|| super::too_large(shape, dtype))?,
            ),
        };
        let storage = match device {
            Device::Cpu(_) => host,
            #[cfg(feature = "cuda")]
            Device::Gpu(i) => Storage::Device(crate::gpu::device::DeviceBuf::with_mirror(i, host)?),
            #[cfg(not(feature = "cuda"))]
            Device::Gpu(_) => unreachable!("no GPU passes the check without cuda"),
        };
        Ok(NDArray {
            shape: super::Shape::from_slice(shape),
            dtype,
            device,
            buf: Arc::new(storage),
        })
    }

    /// The array on `device` (MXNet's `ctx=` and `as_in_context`): copied to a GPU's memory,
    /// or back to the host; between CPUs, the same memory under the other name. A GPU that
    /// this process does not have (any GPU without the `cuda` feature) is
    /// [`crate::KvError::Device`].
    pub fn on(mut self, device: Device) -> Result<NDArray> {
        crate::gpu::check(device)?;
        self.buf = match (device, &*self.buf) {
            #[cfg(feature = "cuda")]
            (Device::Gpu(i), Storage::Device(d)) if d.ordinal() == i => self.buf,
            #[cfg(feature = "cuda")]
            (Device::Gpu(i), Storage::Device(d)) => Arc::new(Storage::Device(d.copy_to(i)?)),
            #[cfg(feature = "cuda")]
            (Device::Gpu(i), _) => Arc::new(Storage::Device(
                crate::gpu::device::DeviceBuf::from_host(i, self.as_bytes())?,
            )),
            #[cfg(not(feature = "cuda"))]
            (Device::Gpu(_), _) => unreachable!("no GPU passes the check without cuda"),
            #[cfg(feature = "cuda")]
            // Page-locked host memory (where CUDA can), as it will likely go back and forth.
            (Device::Cpu(_), Storage::Device(d)) => {
                let mut b = AlignedBuf::zeroed_pinned(d.len());
                d.read_to_host(b.bytes_mut())?;
                Arc::new(Storage::Heap(b))
            }
            (Device::Cpu(_), _) => self.buf,
        };
        self.device = device;
        Ok(self)
    }

    /// A copy of the array on `device` (MXNet's `copyto`), whatever device it is on.
    pub fn copy_to(&self, device: Device) -> Result<NDArray> {
        let mut c = self.clone();
        let same_memory = match (device, self.device) {
            (Device::Gpu(i), Device::Gpu(j)) => i == j,
            (to, from) => to.is_cpu() && from.is_cpu(),
        };
        if same_memory {
            // A clone shares the storage until written; a copy owns its own.
            c.buf = Arc::new(self.buf.try_clone()?);
        }
        c.on(device)
    }

    /// The GPU memory the array lives in, if it does.
    #[cfg(feature = "cuda")]
    pub(crate) fn device_buf(&self) -> Option<&crate::gpu::device::DeviceBuf> {
        match &*self.buf {
            Storage::Device(d) => Some(d),
            _ => None,
        }
    }

    /// The GPU memory the array lives in, for writing, if it does: copied first where it is
    /// shared (a copy on write; `keep`), or made afresh for an array about to be overwritten
    /// whole. A GPU that cannot give the memory is an error (`Arc::make_mut`'s clone, which
    /// cannot return one, would stop the process).
    #[cfg(feature = "cuda")]
    pub(crate) fn device_buf_mut(
        &mut self,
        keep: bool,
    ) -> Result<Option<&mut crate::gpu::device::DeviceBuf>> {
        if Arc::get_mut(&mut self.buf).is_none() {
            if let Storage::Device(d) = &*self.buf {
                let own = match keep {
                    true => d.copy_to(d.ordinal())?,
                    false => crate::gpu::device::DeviceBuf::zeroed(d.ordinal(), d.len())?,
                };
                self.buf = Arc::new(Storage::Device(own));
            }
        }
        Ok(match Arc::make_mut(&mut self.buf) {
            Storage::Device(d) => Some(d),
            _ => None,
        })
    }

    /// Readies arrays to be overwritten whole (a pull's destinations): as
    /// [`NDArray::as_bytes_mut`], except that a GPU array's host copy is not first brought up
    /// to date from the device (and a shared GPU array gets fresh memory, not a copy). A GPU
    /// that cannot give that memory is an error, and then no array has changed.
    pub(crate) fn prepare_overwrite(arrays: &mut [NDArray]) -> Result<()> {
        #[cfg(feature = "cuda")]
        {
            // Every GPU memory first, then the arrays changed.
            let mut fresh = Vec::with_capacity(arrays.len());
            for a in arrays.iter_mut() {
                let shared = Arc::get_mut(&mut a.buf).is_none();
                fresh.push(match &*a.buf {
                    Storage::Device(d) if shared => {
                        Some(crate::gpu::device::DeviceBuf::zeroed(d.ordinal(), d.len())?)
                    }
                    _ => None,
                });
            }
            for (a, f) in arrays.iter_mut().zip(fresh) {
                if let Some(f) = f {
                    a.buf = Arc::new(Storage::Device(f));
                }
            }
        }
        for a in arrays {
            #[cfg(feature = "cuda")]
            if let Some(d) = a.device_buf_mut(false)? {
                d.prepare_overwrite();
                continue;
            }
            Arc::make_mut(&mut a.buf).bytes_mut();
        }
        Ok(())
    }

    /// Copies `other`'s elements into this array (same shape and dtype): device to device
    /// where both are GPU arrays (queued on this array's device, as MXNet's `copyto`; see
    /// [`NDArray::wait_to_read`]), else through host views.
    pub fn copy_from(&mut self, other: &NDArray) -> Result<()> {
        self.check_same(other)?;
        if Arc::ptr_eq(&self.buf, &other.buf) {
            return Ok(());
        }
        #[cfg(feature = "cuda")]
        match (other.device_buf(), self.device_buf().is_some()) {
            (Some(s), true) => {
                if let Some(d) = self.device_buf_mut(false)? {
                    return d.copy_from(s);
                }
            }
            // Host to GPU and GPU to host: one copy, straight between the host memory and
            // the device, never through the GPU array's mirror.
            (None, true) => {
                if let Some(d) = self.device_buf_mut(false)? {
                    return d.write_from_host(other.as_bytes());
                }
            }
            (Some(s), false) => return s.read_to_host(self.as_bytes_mut()),
            (None, false) => {}
        }
        kvstore_transport::copy::copy(self.as_bytes_mut(), other.as_bytes());
        Ok(())
    }

    /// Waits until the work queued on this array's memory is done (MXNet's `wait_to_read`):
    /// for an array on a GPU, its device's stream; a host array has none. (Host views wait
    /// on their own; this is for timing GPU work.)
    pub fn wait_to_read(&self) -> Result<()> {
        #[cfg(feature = "cuda")]
        if let Some(d) = self.device_buf() {
            return d.synchronize();
        }
        Ok(())
    }

    /// An array over memory a transport allocated (the region must fill the shape).
    pub(crate) fn from_region(
        shape: &[usize],
        dtype: DType,
        r: kvstore_transport::Region,
    ) -> NDArray {
        NDArray {
            shape: super::Shape::from_slice(shape),
            dtype,
            device: Device::default(),
            buf: Arc::new(Storage::Region {
                pin: None,
                region: r,
            }),
        }
    }

    /// The transport region the bytes live in, if they do.
    pub(crate) fn region(&self) -> Option<&kvstore_transport::Region> {
        match &*self.buf {
            Storage::Region { region, .. } => Some(region),
            // A GPU array whose host mirror is the transport's (`KVStore::alloc_on`): the
            // mirror, brought up to date first.
            #[cfg(feature = "cuda")]
            Storage::Device(d) => d.region(),
            _ => None,
        }
    }

    /// The storage, for a transport to register (it holds it alive).
    pub(crate) fn storage(&self) -> Arc<dyn kvstore_transport::Storage> {
        self.buf.clone()
    }

    /// Gives the array fresh zeroed storage of its size; the old storage stays with whoever
    /// holds it (a transport that may still write it).
    pub(crate) fn replace_storage(&mut self) {
        self.buf = Arc::new(self.buf.fresh(self.nbytes()));
    }

    /// Whether no clone shares the storage, and no transport holds its pages (a send by
    /// reference still being read): a write goes in place, with no copy, and no reader sees it.
    pub(crate) fn is_unique(&mut self) -> bool {
        match Arc::get_mut(&mut self.buf) {
            None => false,
            Some(s) => !s.pages_held(),
        }
    }

    /// Whether the bytes live in memory a transport allocated (an array from `KVStore::alloc`
    /// on a host where a server shares memory with this process).
    pub fn is_shared_memory(&self) -> bool {
        match &*self.buf {
            Storage::Region { .. } => true,
            #[cfg(feature = "cuda")]
            Storage::Device(d) => d.has_shared_mirror(),
            _ => false,
        }
    }

    /// Whether the host bytes are page-locked for copies to and from GPUs (MXNet's
    /// `cpu_pinned` memory): a host copy of a GPU array ([`NDArray::on`] a CPU), and the host
    /// mirror of a GPU array once a host view made it, where CUDA can pin them. Always false
    /// without a GPU.
    pub fn is_pinned(&self) -> bool {
        self.buf.is_pinned()
    }
}
