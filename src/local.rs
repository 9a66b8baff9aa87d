//! The `local` and `device` stores: one process, aggregation where the values live.

use rustc_hash::FxHashMap;

use crate::args::List;
use crate::dtype::with_dtype;
use crate::ops;
use crate::{Compression, Key, KvError, NDArray, Result, Updater};

/// Checks that `v` has the stored value's shape and dtype.
pub(crate) fn check_like(key: &Key, stored: &NDArray, v: &NDArray) -> Result<()> {
    if v.shape() != stored.shape() {
        return Err(KvError::ShapeMismatch {
            key: key.clone(),
            expected: stored.shape().to_vec(),
            got: v.shape().to_vec(),
        });
    }
    if v.dtype() != stored.dtype() {
        return Err(KvError::DTypeMismatch {
            key: key.clone(),
            expected: stored.dtype(),
            got: v.dtype(),
        });
    }
    Ok(())
}

/// `dst = sum(values)`; all have `dst`'s shape and dtype (checked by the caller). In the
/// order of MXNet's CPU reduce where `grouped` (its `local` and `dist_sync` stores', which
/// sum each next four values among themselves first), on the host; else left to right (its
/// `device` stores'), on a GPU where `dst` and every value are GPU arrays of a dtype it sums,
/// else on the host.
pub(crate) fn sum_into(dst: &mut NDArray, values: &[&NDArray], grouped: bool) -> Result<()> {
    // One value is a copy: between a GPU and the host, one copy straight between them.
    if let [only] = values {
        return dst.copy_from(only);
    }
    let dtype = dst.dtype();
    if let Some(v) = values
        .iter()
        .find(|v| v.dtype() != dtype || v.nbytes() != dst.nbytes())
    {
        // The callers check; the kernels, the host's and the GPU's, take lengths on trust.
        return Err(KvError::Incompatible(format!(
            "a sum into {:?} {dtype} of {:?} {}",
            dst.shape(),
            v.shape(),
            v.dtype()
        )));
    }
    // The GPU's kernels sum left to right; MXNet's CPU order (a `local` store whose stored
    // value an updater moved to a GPU) is the host's, through the arrays' mirrors.
    #[cfg(feature = "cuda")]
    if !grouped && crate::gpu::sum_on_gpu(dst, values)? {
        return Ok(());
    }
    let srcs: Vec<&[u8]> = values.iter().map(|v| v.as_bytes()).collect();
    with_dtype!(dtype, T => ops::sum_bytes_into::<T>(dst.as_bytes_mut(), &srcs, grouped));
    Ok(())
}

/// Checks that an updater left the stored value's shape and dtype as they were.
pub(crate) fn check_updater_kept_shape(
    key: &Key,
    stored: &NDArray,
    shape: &[usize],
    dtype: crate::DType,
) -> Result<()> {
    if stored.shape() != shape || stored.dtype() != dtype {
        return Err(KvError::Updater {
            key: key.clone(),
            reason: format!(
                "the updater replaced the stored {shape:?} {dtype} with {:?} {}",
                stored.shape(),
                stored.dtype()
            ),
        });
    }
    Ok(())
}

/// A single-process store.
pub(crate) struct LocalStore {
    store: FxHashMap<Key, NDArray>,
    /// Each str key's number: its place in the order of inits (MXNet's `str_key_dict_`).
    numbers: FxHashMap<Key, i64>,
    /// Per-key buffers where a list of pushed values is summed before the updater runs.
    merge: FxHashMap<Key, NDArray>,
    updater: Option<Updater>,
    /// `device` (values stay, and are summed, on the device they were initialised from) or
    /// `local` (values live in host memory).
    on_devices: bool,
    /// The built-in optimizer the updater runs, if it is one (its state can be saved).
    optimizer: Option<std::sync::Arc<std::sync::Mutex<crate::OptimizerUpdater>>>,
    /// Gradient compression (`device` stores), and what each (key, value's place in the list
    /// pushed) has not sent yet, as MXNet keeps a residual per key and device.
    compression: Option<Compression>,
    residuals: FxHashMap<(Key, usize), Vec<f32>>,
    /// Keys whose value an updater replaced with one of another shape or dtype, and what it
    /// was replaced with: the value is lost, so every call of the key fails saying so, until
    /// the key is initialised again.
    lost: FxHashMap<Key, String>,
}

impl LocalStore {
    pub(crate) fn new(on_devices: bool) -> Self {
        LocalStore {
            store: FxHashMap::default(),
            numbers: FxHashMap::default(),
            merge: FxHashMap::default(),
            updater: None,
            on_devices,
            optimizer: None,
            compression: None,
            residuals: FxHashMap::default(),
            lost: FxHashMap::default(),
        }
    }

    /// Compresses every push from now on (a `device` store; residuals are kept).
    pub(crate) fn set_compression(&mut self, c: Compression) -> Result<()> {
        if !self.on_devices {
            return Err(KvError::Unsupported(
                "gradient compression is not supported for a local store (as in MXNet): \
                 create a device, dist_sync or dist_async store"
                    .into(),
            ));
        }
        self.compression = Some(c);
        Ok(())
    }

    /// The sum of what each of `vs` (host arrays) sends under compression `c`: each value is
    /// added to its residual, packed, and unpacked, as MXNet's device store sends it between
    /// devices; the sum lies on `device`.
    fn compressed_sum(
        &mut self,
        c: Compression,
        k: &Key,
        vs: &[NDArray],
        device: crate::Device,
    ) -> Result<NDArray> {
        let n = vs[0].size();
        let mut sum = vec![0.0f32; n];
        let mut packed = vec![0u8; Compression::packed_bytes(n as u64) as usize];
        for (i, v) in vs.iter().enumerate() {
            let r = self
                .residuals
                .entry((k.clone(), i))
                .or_insert_with(|| vec![0.0; n]);
            c.quantize(v.as_slice::<f32>()?, r, &mut packed)?;
            c.dequantize_add(&packed, &mut sum)?;
        }
        NDArray::from_vec(vs[0].shape(), sum)?.on(device)
    }

    pub(crate) fn set_updater(&mut self, u: Updater) {
        self.updater = Some(u);
        self.optimizer = None;
    }

    /// Runs a built-in optimizer as the updater.
    pub(crate) fn set_optimizer(&mut self, opt: crate::Multiplied) {
        let shared = std::sync::Arc::new(std::sync::Mutex::new(crate::OptimizerUpdater::new(opt)));
        let u = shared.clone();
        self.updater = Some(Box::new(move |k, g, w| match u.lock() {
            Ok(mut u) => u.update(k, g, w),
            Err(_) => Err(KvError::Updater {
                key: k.clone(),
                reason: "the optimizer failed in an earlier update".into(),
            }),
        }));
        self.optimizer = Some(shared);
    }

    /// The optimizer's state, or an error when the updater is not a built-in optimizer.
    pub(crate) fn optimizer(&self) -> Result<std::sync::MutexGuard<'_, crate::OptimizerUpdater>> {
        let o = self.optimizer.as_ref().ok_or_else(|| {
            KvError::Unsupported(
                "optimizer states exist only while a built-in optimizer is the updater \
                 (set_optimizer)"
                    .into(),
            )
        })?;
        o.lock()
            .map_err(|_| KvError::Unsupported("the optimizer failed in an earlier update".into()))
    }

    /// The stored value's shape and dtype.
    pub(crate) fn meta(&self, k: &Key) -> Result<(Vec<usize>, crate::DType)> {
        let v = self.stored(k)?;
        Ok((v.shape().to_vec(), v.dtype()))
    }

    pub(crate) fn init(&mut self, pairs: &[(Key, List<&NDArray>)]) -> Result<()> {
        for (i, (k, vs)) in pairs.iter().enumerate() {
            if self.store.contains_key(k) || vs.len() > 1 || pairs[..i].iter().any(|(p, _)| p == k)
            {
                return Err(KvError::DoubleInit(k.clone()));
            }
        }
        for (k, vs) in pairs {
            // A fresh copy: the store never aliases the caller's array.
            let device = if self.on_devices {
                vs[0].device()
            } else {
                crate::Device::default()
            };
            let v = vs[0].copy_to(device)?;
            self.lost.remove(k);
            self.store.insert(k.clone(), v);
            if let Key::Str(_) = k {
                // A key initialised again (its value lost to an updater) keeps its number.
                let n = self.numbers.len() as i64;
                self.numbers.entry(k.clone()).or_insert(n);
            }
        }
        Ok(())
    }

    /// The order in which a call's keys are updated: by their numbers, as MXNet's local store
    /// groups a call's keys sorted (an int key is its number; a str key's is its place in the
    /// order of inits), each key's values together. It shows where updates share a state
    /// (Nadam's schedule) or print.
    fn update_order(&self, pairs: &[(Key, List<&NDArray>)]) -> Vec<usize> {
        let number = |k: &Key| match k {
            Key::Int(n) => *n,
            k => self.numbers.get(k).copied().unwrap_or(i64::MAX),
        };
        let mut order: Vec<usize> = (0..pairs.len()).collect();
        order.sort_by_key(|&i| number(&pairs[i].0));
        order
    }

    fn stored(&self, k: &Key) -> Result<&NDArray> {
        self.store.get(k).ok_or_else(|| self.missing(k))
    }

    /// The error for a key that has no value: unknown, or lost to an updater.
    #[cold]
    fn missing(&self, k: &Key) -> KvError {
        match self.lost.get(k) {
            Some(why) => KvError::Updater {
                key: k.clone(),
                reason: format!("{why}, so its value is lost: init the key again"),
            },
            None => KvError::UnknownKey(k.clone()),
        }
    }

    pub(crate) fn push(&mut self, pairs: &[(Key, List<&NDArray>)]) -> Result<()> {
        // Validate everything first, so a refused call changes nothing.
        for (k, vs) in pairs {
            let stored = self.stored(k)?;
            for v in vs {
                check_like(k, stored, v)?;
            }
            if self.compression.is_some() {
                Compression::check_dtype(k, stored.dtype())?;
            }
            if self.optimizer.is_some() {
                // What the optimizer would refuse, refused before any key of the call is
                // updated.
                crate::optimizer::check_float(k, stored.dtype())?;
            }
        }
        let Some(c) = self.compression else {
            if let [(k, vs)] = pairs {
                // One key (the common call): nothing to order.
                return self.update(k, vs);
            }
            for i in self.update_order(pairs) {
                let (k, vs) = &pairs[i];
                self.update(k, vs)?;
            }
            return Ok(());
        };
        let order = self.update_order(pairs);
        // Every value on the host before any residual changes.
        let hosts = pairs
            .iter()
            .map(|(_, vs)| {
                vs.iter()
                    .map(|v| (*v).clone().on(crate::Device::default()))
                    .collect()
            })
            .collect::<Result<Vec<Vec<NDArray>>>>()?;
        for &i in &order {
            let (k, vs) = (&pairs[i].0, &hosts[i]);
            let device = self.stored(k)?.device();
            let sent = self.compressed_sum(c, k, vs, device)?;
            self.update(k, &[&sent])?;
        }
        Ok(())
    }

    /// Merges the sum of `vs` into `k`'s stored value (checked to fit).
    fn update(&mut self, k: &Key, vs: &[&NDArray]) -> Result<()> {
        let Some(stored) = self.store.get_mut(k) else {
            return Err(self.missing(k));
        };
        match &mut self.updater {
            None => sum_into(stored, vs, !self.on_devices)?,
            Some(up) => {
                let (shape, dtype) = (stored.shape().to_vec(), stored.dtype());
                // An updater's own error names its key, as a server's does (an interrupt
                // stays one).
                let keyed = |e: KvError| match e {
                    e @ (KvError::Updater { .. } | KvError::Interrupted(_)) => e,
                    other => KvError::Updater {
                        key: k.clone(),
                        reason: other.to_string(),
                    },
                };
                // (The updater's error is said once the stored value is checked: one that
                // replaced it and then failed has lost it all the same.)
                let applied = if vs.len() == 1 {
                    up(k, vs[0], stored).map_err(keyed)
                } else {
                    if !self.merge.contains_key(k) {
                        let m = NDArray::zeros_dtype(&shape, dtype).on(stored.device())?;
                        self.merge.insert(k.clone(), m);
                    }
                    let Some(merged) = self.merge.get_mut(k) else {
                        return Err(KvError::UnknownKey(k.clone()));
                    };
                    sum_into(merged, vs, !self.on_devices)?;
                    up(k, merged, stored).map_err(keyed)
                };
                let kept = check_updater_kept_shape(k, stored, &shape, dtype);
                if let Err(e) = kept {
                    // The value it replaced is gone: the key is taken out, with its merge
                    // buffer (of the old shape), and says why from now on.
                    self.store.remove(k);
                    self.merge.remove(k);
                    self.residuals.retain(|(key, _), _| key != k);
                    if let KvError::Updater { reason, .. } = &e {
                        self.lost.insert(k.clone(), reason.clone());
                    }
                    return Err(e);
                }
                applied?;
            }
        }
        Ok(())
    }

    /// Copies the rows `runs` of `k`'s value (`row` elements each; `out` is checked to fit the
    /// value, [`crate::KVStore::row_sparse_pull`]) into `out`, zeroing the other rows.
    pub(crate) fn row_sparse_pull(
        &self,
        k: &Key,
        out: &mut NDArray,
        row: usize,
        runs: &[std::ops::Range<usize>],
    ) -> Result<()> {
        let stored = self.stored(k)?;
        crate::rows::check_host(k, stored)?;
        let rb = row * stored.dtype().size();
        let src = stored.as_bytes();
        let dst = out.as_bytes_mut();
        dst.fill(0);
        for r in runs {
            let bytes = r.start * rb..r.end * rb;
            kvstore_transport::copy::copy(&mut dst[bytes.clone()], &src[bytes]);
        }
        Ok(())
    }

    pub(crate) fn pull(&self, pairs: &mut [(Key, List<&mut NDArray>)]) -> Result<()> {
        for (k, outs) in pairs.iter() {
            let stored = self.stored(k)?;
            for o in outs {
                check_like(k, stored, o)?;
            }
        }
        for (k, outs) in pairs.iter_mut() {
            let stored = self.stored(k)?;
            for o in outs.iter_mut() {
                o.copy_from(stored)?;
            }
        }
        Ok(())
    }
}
