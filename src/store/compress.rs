//! `set_gradient_compression`.

use super::{Inner, KVStore};
use crate::{Compression, Result};

impl KVStore {
    /// MXNet's `set_gradient_compression`: pushes of float32 values send 2 bits an element,
    /// `+t`, `-t` or `0` ([`Compression`]), and what they do not send is kept, per key, by
    /// the pushing side and sent once it passes the threshold. Pulls and inits stay whole.
    ///
    /// - `device` stores compress each pushed value (each device's, in a list) before the sum,
    ///   with a residual per key and place in the list, as MXNet's does between GPUs (here on
    ///   the host).
    /// - `dist_sync` and `dist_async` stores compress each key's value (a list summed first)
    ///   on the worker, which keeps the residual, and the servers unpack it before the sum and
    ///   the updater: the pushes carry a sixteenth of the bytes. Call it before the first
    ///   `init`. Unlike MXNet's, `pushpull` compresses its push too.
    /// - `local` stores refuse it, as MXNet's do.
    ///
    /// A push of a key of another dtype is then refused. A second call replaces the threshold
    /// (`device` stores; residuals are kept).
    ///
    /// ```
    /// use kvstore::{create, Compression, NDArray};
    /// let mut kv = create("device").unwrap();
    /// kv.set_gradient_compression(Compression::two_bit(0.5).unwrap()).unwrap();
    /// kv.init(0, &NDArray::zeros(&[2])).unwrap();
    /// let mut w = NDArray::zeros(&[2]);
    /// for _ in 0..2 {
    ///     kv.push(0, &NDArray::full(&[2], 0.3)).unwrap();
    ///     kv.pull(0, &mut w).unwrap();
    /// }
    /// // 0.3 sends 0 (0.3 kept), then 0.6 sends 0.5 (0.1 kept).
    /// assert_eq!(w.to_vec::<f32>().unwrap(), [0.5, 0.5]);
    /// assert!(create("local").unwrap().set_gradient_compression(Compression::two_bit(0.5).unwrap()).is_err());
    /// ```
    pub fn set_gradient_compression(&mut self, c: Compression) -> Result<()> {
        match &mut self.inner {
            Inner::Local(s) => s.set_compression(c),
            Inner::Dist(d) => d.set_compression(c),
        }
    }
}
