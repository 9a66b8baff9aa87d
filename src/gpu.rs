//! The GPUs this process can use: none without the `cuda` feature, and none where the CUDA
//! driver library is absent or finds no device. cudarc loads the driver at run time and
//! panics on the first call where it is missing, so the library is looked for first, and
//! absence is "0 GPUs", never a crash.

#[cfg(feature = "cuda")]
pub(crate) mod device;
#[cfg(feature = "cuda")]
pub(crate) mod optim;
#[cfg(feature = "cuda")]
mod reduce;

use crate::{Device, KvError, Result};

/// How many GPUs this process can use (0 without the `cuda` feature or a CUDA driver).
pub fn gpu_count() -> usize {
    imp::count()
}

/// Whether the build has GPU support (the `cuda` feature), whether or not a GPU is present.
pub const CUDA_BUILT: bool = cfg!(feature = "cuda");

/// `Ok` for a device this process has; for a GPU it does not have, why not.
pub(crate) fn check(device: Device) -> Result<()> {
    let Device::Gpu(i) = device else {
        return Ok(());
    };
    let n = gpu_count();
    if (i as usize) < n {
        return Ok(());
    }
    Err(KvError::Device(if !CUDA_BUILT {
        format!("{device}: this build has no GPU support (build with --features cuda)")
    } else if n == 0 {
        format!(
            "{device}: this machine has no GPU that CUDA can use ({})",
            imp::why_none()
        )
    } else {
        format!("{device}: there are {n} GPUs, gpu(0) to gpu({})", n - 1)
    }))
}

/// `dst = sum(values)` on `dst`'s GPU (two values or more: one is a copy, `local::sum_into`),
/// when `dst` and every value are GPU arrays of a dtype the kernels sum (values on other GPUs
/// are copied over first); `false`, with nothing done, otherwise.
#[cfg(feature = "cuda")]
pub(crate) fn sum_on_gpu(dst: &mut crate::NDArray, values: &[&crate::NDArray]) -> Result<bool> {
    let dtype = dst.dtype();
    let all_gpu = dst.device_buf().is_some() && values.iter().all(|v| v.device_buf().is_some());
    if values.is_empty() || !all_gpu || !reduce::on_gpu(dtype) {
        return Ok(false);
    }
    let n = dst.size();
    let Some(ordinal) = dst.device_buf().map(device::DeviceBuf::ordinal) else {
        return Ok(false);
    };
    // The kernels before any write: where they cannot be had (no NVRTC, a driver older than
    // the program), the host sums, through the arrays' mirrors.
    if reduce::ready(ordinal).is_err() {
        return Ok(false);
    }
    // Values on other GPUs are copied here first (every value is on a GPU: checked above).
    let moved = values
        .iter()
        .map(|v| match v.device_buf() {
            Some(src) if src.ordinal() != ordinal => src.copy_to(ordinal).map(Some),
            _ => Ok(None),
        })
        .collect::<Result<Vec<_>>>()?;
    let srcs: Vec<&device::DeviceBuf> = values
        .iter()
        .zip(&moved)
        .filter_map(|(v, m)| m.as_ref().or(v.device_buf()))
        .collect();
    // Every value's host writes go to the device before the first launch writes `dst`: a
    // failure then leaves `dst` as it was, where past the first launch a sum of more than
    // FUSED values would be left half done.
    for s in &srcs {
        s.device()?;
    }
    // Then `dst`'s memory, its own (the first launch writes it whole).
    let Some(d) = dst.device_buf_mut(false)? else {
        return Ok(false);
    };
    // One pass over up to FUSED values; more are added to the result, FUSED at a time.
    for (i, chunk) in srcs.chunks(reduce::FUSED).enumerate() {
        reduce::sum(d, i > 0, chunk, dtype, n)?;
    }
    Ok(true)
}

#[cfg(feature = "cuda")]
mod imp {
    use std::sync::OnceLock;

    /// The oldest driver the bindings work with: CUDA 13.0 (Cargo.toml's `cuda-13000`).
    const NEEDED: i32 = 13_000;

    /// The probe's answer: the device count, or why there is none.
    fn probe() -> &'static Result<usize, String> {
        static ANSWER: OnceLock<Result<usize, String>> = OnceLock::new();
        ANSWER.get_or_init(|| {
            // SAFETY: only looks for the library by name (dlopen); no CUDA function is called.
            if !unsafe { cudarc::driver::sys::is_culib_present() } {
                return Err("the CUDA driver library, libcuda, is not installed".into());
            }
            // The bindings are CUDA 13.0's (Cargo.toml): an older driver lacks some of the
            // symbols they name, and cudarc panics on the first call of one. Such a driver,
            // too, is a machine without a usable GPU.
            let mut version = 0;
            // SAFETY: writes one int; CUDA needs no initialisation for it.
            let asked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| unsafe {
                cudarc::driver::sys::cuDriverGetVersion(&mut version)
            }));
            match asked {
                Ok(cudarc::driver::sys::CUresult::CUDA_SUCCESS) if version >= NEEDED => {}
                Ok(cudarc::driver::sys::CUresult::CUDA_SUCCESS) => {
                    return Err(format!(
                        "the CUDA driver is CUDA {}.{}, older than the {}.{} of this build's \
                         bindings",
                        version / 1000,
                        version % 1000 / 10,
                        NEEDED / 1000,
                        NEEDED % 1000 / 10
                    ))
                }
                _ => return Err("the CUDA driver does not say its version".into()),
            }
            match std::panic::catch_unwind(cudarc::driver::CudaContext::device_count) {
                Ok(Ok(n)) if n > 0 => Ok(n as usize),
                Ok(Ok(_)) => Err("the CUDA driver sees no device".into()),
                Ok(Err(e)) => Err(format!("the CUDA driver failed to start: {e}")),
                Err(_) => Err("the CUDA driver lacks a function this build calls".into()),
            }
        })
    }

    pub(super) fn count() -> usize {
        probe().as_ref().copied().unwrap_or(0)
    }

    pub(super) fn why_none() -> String {
        match probe() {
            Ok(_) => "it has some".into(),
            Err(e) => e.clone(),
        }
    }
}

#[cfg(not(feature = "cuda"))]
mod imp {
    pub(super) fn count() -> usize {
        0
    }

    pub(super) fn why_none() -> String {
        "built without the cuda feature".into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{cpu, gpu};

    #[test]
    fn cpus_are_always_there_and_gpus_past_the_count_are_typed_errors() {
        assert!(check(cpu(3)).is_ok());
        let n = gpu_count() as u32;
        match check(gpu(n)) {
            Err(KvError::Device(m)) => assert!(m.starts_with(&format!("gpu({n}): ")), "{m}"),
            other => panic!("gpu({n}) of {n}: {other:?}"),
        }
        for i in 0..n {
            assert!(check(gpu(i)).is_ok());
        }
        if !CUDA_BUILT {
            assert_eq!(n, 0);
        }
    }

    /// A sum of GPU arrays runs the kernels, for every dtype they take (a GPU that cannot have
    /// them sums on the host, through the mirrors, with the same results: the tests of values
    /// alone would not see it).
    #[cfg(feature = "cuda")]
    #[test]
    #[ignore = "needs a GPU"]
    fn sums_of_gpu_arrays_run_the_kernels() {
        use crate::{DType, NDArray};
        assert!(gpu_count() > 0, "this test needs a GPU");
        assert!(reduce::ready(0).is_ok(), "{:?}", reduce::ready(0).err());
        for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
            let on = |v: f64| NDArray::full_dtype(&[1001], v, dtype).on(gpu(0)).unwrap();
            let (a, b, c) = (on(1.5), on(2.0), on(-0.25));
            let mut d = on(0.0);
            assert!(sum_on_gpu(&mut d, &[&a, &b, &c]).unwrap(), "{dtype}");
            assert_eq!(d.to_f64_vec(), vec![3.25; 1001], "{dtype}");
        }
    }
}
