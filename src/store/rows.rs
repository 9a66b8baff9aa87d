//! MXNet's `row_sparse_pull`, into dense outputs.

use std::ops::Range;

use super::{Inner, KVStore};
use crate::{rows, Key, KvError, NDArray, Result};

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
        out.check_in_place()?;
        let (row, runs) = self.row_runs(&key, out, row_ids)?;
        match &mut self.inner {
            Inner::Local(s) => s.row_sparse_pull(&key, out, row, &runs),
            Inner::Dist(d) => d.row_sparse_pull(&key, out, row, &runs),
        }
    }

    /// What [`KVStore::row_sparse_pull`] would refuse, checked with nothing written: an
    /// unknown key, an output of another shape or dtype or outside host memory, a row id past
    /// the last row. A caller pulling into several outputs checks them all first.
    pub fn check_rows(&self, key: impl Into<Key>, out: &NDArray, row_ids: &[u64]) -> Result<()> {
        self.row_runs(&key.into(), out, row_ids).map(drop)
    }

    /// The elements in a row of `key`'s value, and the runs of rows `row_ids` names, once
    /// `out` is found to fit the value.
    fn row_runs(
        &self,
        key: &Key,
        out: &NDArray,
        row_ids: &[u64],
    ) -> Result<(usize, Vec<Range<usize>>)> {
        let (shape, dtype) = self.key_info(key.clone())?;
        if out.shape() != shape.as_slice() {
            return Err(KvError::ShapeMismatch {
                key: key.clone(),
                expected: shape,
                got: out.shape().to_vec(),
            });
        }
        if out.dtype() != dtype {
            return Err(KvError::DTypeMismatch {
                key: key.clone(),
                expected: dtype,
                got: out.dtype(),
            });
        }
        rows::check_host(key, out)?;
        let (n, row) = rows::row_shape(key, &shape)?;
        Ok((row, rows::runs(key, row_ids, n)?))
    }
}
