//! The GPU's side of `kvperf pushpull --gpu` (a no-op for host arrays, so that a build
//! without the feature `cuda` runs the same loop).

use std::time::Instant;

use kvstore::{gpu, KvError, NDArray};

fn err(e: KvError) -> String {
    e.to_string()
}

/// The GPU's side of `kvperf pushpull --gpu`: a push of a GPU array must first bring its
/// bytes from the device, and a pull into one must bring them to the device. A benchmark
/// that pushed the same unchanged arrays, and never used what it pulled on the GPU, would
/// time neither (an array's host copy is brought up to date only where the device has newer
/// bytes, and a pull's bytes go to the device only before the device next reads them). So
/// before each push the values are written on the GPU (a device copy), and after each pull
/// each output is read there (a device copy, waited for); the device copies' own cost,
/// measured alone before the timed loop ([`Staging::calibrate`]), is taken off the time.
/// With `on` false (host arrays) nothing is done.
pub struct Staging {
    /// Copies of the values on the GPU, written into them before each push.
    fresh: Vec<NDArray>,
    /// GPU arrays each output is copied into after each pull.
    scratch: Vec<NDArray>,
    /// Seconds per iteration that the device copies alone take ([`Staging::calibrate`]).
    per_iter: f64,
}

impl Staging {
    /// The staging of `vals` and `outs` (GPU arrays where `on`).
    pub fn new(on: bool, vals: &[NDArray], outs: &[NDArray]) -> Result<Staging, String> {
        if !on {
            return Ok(Staging {
                fresh: Vec::new(),
                scratch: Vec::new(),
                per_iter: 0.0,
            });
        }
        let fresh = vals
            .iter()
            .map(|v| v.copy_to(gpu(0)))
            .collect::<Result<_, _>>()
            .map_err(err)?;
        let scratch = outs
            .iter()
            .map(|o| NDArray::zeros_dtype(o.shape(), o.dtype()).on(gpu(0)))
            .collect::<Result<_, _>>()
            .map_err(err)?;
        Ok(Staging {
            fresh,
            scratch,
            per_iter: 0.0,
        })
    }

    /// Writes the values on the GPU, so that the next push brings them from there.
    pub fn before_push(&self, vals: &mut [NDArray]) -> Result<(), String> {
        for (v, f) in vals.iter_mut().zip(&self.fresh) {
            v.copy_from(f).map_err(err)?;
        }
        Ok(())
    }

    /// Reads the outputs on the GPU, so that the pull's bytes reach the device.
    pub fn after_pull(&mut self, outs: &[NDArray]) -> Result<(), String> {
        for (s, o) in self.scratch.iter_mut().zip(outs) {
            s.copy_from(o).map_err(err)?;
            s.wait_to_read().map_err(err)?;
        }
        Ok(())
    }

    /// Measures the seconds per iteration that the device copies alone take (nothing to
    /// bring to or from the host: the outputs' last pull is already on the device).
    pub fn calibrate(
        &mut self,
        vals: &mut [NDArray],
        outs: &[NDArray],
        push: bool,
        pull: bool,
    ) -> Result<(), String> {
        if self.fresh.is_empty() {
            return Ok(());
        }
        self.after_pull(outs)?;
        let reps = 20;
        let t = Instant::now();
        for _ in 0..reps {
            if push {
                self.before_push(vals)?;
                // (In the timed loop the push waits for these copies before it reads.)
                for v in vals.iter() {
                    v.wait_to_read().map_err(err)?;
                }
            }
            if pull {
                self.after_pull(outs)?;
            }
        }
        self.per_iter = t.elapsed().as_secs_f64() / reps as f64;
        Ok(())
    }

    /// The seconds `iters` iterations of `size` bytes took (`took` in all), less the device
    /// copies' own time; said to be uncertain where those were half of it or more.
    pub fn seconds(&self, took: f64, iters: usize, size: usize) -> f64 {
        let copies = self.per_iter * iters as f64;
        if copies > took / 2.0 {
            eprintln!(
                "kvperf: at {size} bytes the GPU's device copies took half the time or more: \
                 the staging figure is uncertain"
            );
        }
        (took - copies).max(took * 0.01)
    }

    /// What the outputs hold in the GPU's memory (with `on` false: on the host), as f32.
    pub fn values(&mut self, outs: &[NDArray]) -> Result<Vec<Vec<f32>>, String> {
        if self.fresh.is_empty() {
            return outs
                .iter()
                .map(|o| o.to_vec::<f32>().map_err(err))
                .collect();
        }
        self.after_pull(outs)?;
        self.scratch
            .iter()
            .map(|s| s.to_vec::<f32>().map_err(err))
            .collect()
    }
}
