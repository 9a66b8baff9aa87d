//! MXNet's `row_sparse_pull`, into dense outputs.

use super::{Inner, KVStore};
use crate::{Key, NDArray, Result};

impl KVStore {
    /// Pulls only the rows `row_ids` of `key`'s value (rows along its first dimension) into
    /// `out`, an array of the value's shape in host memory: those rows get the stored rows,
    /// the others zero. This is what MXNet's `row_sparse_pull` returns in a row-sparse array,
    /// made dense. The ids may come in any order and repeat; an id past the last row is an
    /// error, and nothing is pulled then. In a distributed store only those rows' bytes
    /// travel: one request per run of consecutive rows and server holding part of it.
    ///
    /// ```
    /// use kvstore::NDArray;
    /// let mut kv = kvstore::create("local").unwrap();
    /// let w = NDArray::from_vec(&[3, 2], vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap();
    /// kv.init(7, &w).unwrap();
    /// let mut out = NDArray::zeros(&[3, 2]);
    /// kv.row_sparse_pull(7, &mut out, &[2, 0]).unwrap();
    /// assert_eq!(out.to_vec::<f32>().unwrap(), [1.0, 2.0, 0.0, 0.0, 5.0, 6.0]);
    /// ```
    pub fn row_sparse_pull(
        &mut self,
        key: impl Into<Key>,
        out: &mut NDArray,
        row_ids: &[u64],
    ) -> Result<()> {
        let key = key.into();
        self.check_keys(std::iter::once(&key))?;
        match &mut self.inner {
            Inner::Local(s) => s.row_sparse_pull(&key, out, row_ids),
            Inner::Dist(d) => d.row_sparse_pull(&key, out, row_ids),
        }
    }
}
