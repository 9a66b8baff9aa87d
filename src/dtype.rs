//! Element types and devices.

use std::fmt;

use half::{bf16, f16};

/// The element type of an [`NDArray`](crate::NDArray).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// 32-bit float (MXNet's default).
    F32,
    /// 64-bit float.
    F64,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    BF16,
    /// 32-bit signed integer.
    I32,
    /// 64-bit signed integer.
    I64,
    /// Unsigned byte.
    U8,
}

impl DType {
    /// Every dtype, in wire-code order.
    pub const ALL: [DType; 7] = [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I32,
        DType::I64,
        DType::U8,
    ];

    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F64 | DType::I64 => 8,
            DType::F16 | DType::BF16 => 2,
            DType::U8 => 1,
        }
    }

    /// numpy's name for the type.
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "float32",
            DType::F64 => "float64",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::U8 => "uint8",
        }
    }

    /// Whether the type is a floating-point type.
    pub const fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
    }

    /// The code of the type on the wire.
    pub const fn code(self) -> u8 {
        match self {
            DType::F32 => 0,
            DType::F64 => 1,
            DType::F16 => 2,
            DType::BF16 => 3,
            DType::I32 => 4,
            DType::I64 => 5,
            DType::U8 => 6,
        }
    }

    /// The type with a wire code, if the code is valid.
    pub fn from_code(code: u8) -> Option<DType> {
        DType::ALL.get(code as usize).copied()
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Where an array lives. MXNet's `cpu(i)` and `gpu(i)` contexts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Device {
    /// Host memory, logical device `i` (the index only names a device, as in MXNet).
    Cpu(u32),
    /// GPU `i`: device memory, with the `cuda` feature and a GPU of that index
    /// ([`crate::gpu_count`]); otherwise an array cannot be put there ([`crate::KvError::Device`]).
    Gpu(u32),
}

impl Default for Device {
    fn default() -> Self {
        Device::Cpu(0)
    }
}

impl Device {
    /// Whether the memory is host memory.
    pub fn is_cpu(self) -> bool {
        !matches!(self, Device::Gpu(_))
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu(i) => write!(f, "cpu({i})"),
            Device::Gpu(i) => write!(f, "gpu({i})"),
        }
    }
}

/// MXNet's `mx.cpu(i)`.
pub fn cpu(i: u32) -> Device {
    Device::Cpu(i)
}

/// MXNet's `mx.gpu(i)`.
pub fn gpu(i: u32) -> Device {
    Device::Gpu(i)
}

/// What only this crate's element types are: the store reads and writes an element's bytes
/// as its dtype's size, which a type of another size would not hold (sealed, so that no
/// other type can claim a dtype).
mod sealed {
    pub trait Sealed {}
}

/// A Rust type that is the element type of a [`DType`]: f32, f64, f16, bf16, i32, i64 and u8
/// (sealed).
///
/// No other type can claim a dtype (here a 2-byte type claiming float32, whose pulls would
/// write 4 bytes an element):
/// ```compile_fail
/// #[repr(transparent)]
/// #[derive(Clone, Copy, Debug, PartialEq)]
/// struct H(u16);
/// // SAFETY: a u16, every bit pattern valid.
/// unsafe impl bytemuck::Zeroable for H {}
/// // SAFETY: as above.
/// unsafe impl bytemuck::Pod for H {}
/// impl kvstore::Element for H {
///     const DTYPE: kvstore::DType = kvstore::DType::F32;
///     fn add(self, o: Self) -> Self { H(self.0.wrapping_add(o.0)) }
///     fn axpy(self, _: f64, x: Self) -> Self { self.add(x) }
///     fn scale(self, _: f64) -> Self { self }
///     fn to_f64(self) -> f64 { self.0 as f64 }
///     fn from_f64(v: f64) -> Self { H(v as u16) }
/// }
/// ```
pub trait Element:
    sealed::Sealed + bytemuck::Pod + Send + Sync + fmt::Debug + PartialEq + 'static
{
    /// The dtype of this element type.
    const DTYPE: DType;
    /// Addition (wrapping for integers, so no overflow panics).
    fn add(self, other: Self) -> Self;
    /// `self + alpha * x`: MXNet's `self += x * alpha`, the product as [`Element::scale`].
    fn axpy(self, alpha: f64, x: Self) -> Self;
    /// `self * alpha`, as MXNet's scalar ops compute in the element type.
    fn scale(self, alpha: f64) -> Self;
    /// Conversion for printing and for generic code.
    fn to_f64(self) -> f64;
    /// Conversion from f64 (saturating for integers).
    fn from_f64(v: f64) -> Self;
}

macro_rules! float_elem {
    ($t:ty, $dt:expr) => {
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DType = $dt;
            #[inline(always)]
            fn add(self, o: Self) -> Self {
                self + o
            }
            #[inline(always)]
            fn axpy(self, alpha: f64, x: Self) -> Self {
                self + (alpha as $t) * x
            }
            #[inline(always)]
            fn scale(self, alpha: f64) -> Self {
                self * (alpha as $t)
            }
            #[inline(always)]
            fn to_f64(self) -> f64 {
                self as f64
            }
            #[inline(always)]
            fn from_f64(v: f64) -> Self {
                v as $t
            }
        }
    };
}
float_elem!(f32, DType::F32);
float_elem!(f64, DType::F64);

macro_rules! half_elem {
    ($t:ty, $dt:expr) => {
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DType = $dt;
            #[inline(always)]
            fn add(self, o: Self) -> Self {
                <$t>::from_f32(self.to_f32() + o.to_f32())
            }
            /// As MXNet's `s += x * alpha`: the scalar in the half type, the product rounded
            /// to it, then the sum.
            #[inline(always)]
            fn axpy(self, alpha: f64, x: Self) -> Self {
                self.add(x.scale(alpha))
            }
            /// As MXNet's scalar ops compute: by `alpha` in the half type (`half(1.0004)` is
            /// 1), the product rounded to it.
            #[inline(always)]
            fn scale(self, alpha: f64) -> Self {
                <$t>::from_f32(self.to_f32() * <$t>::from_f64(alpha).to_f32())
            }
            #[inline(always)]
            fn to_f64(self) -> f64 {
                self.to_f64()
            }
            /// Through f32 (rounded to f32, then to the half type, each to nearest even):
            /// the same on every CPU (the `half` crate's own conversion from f64 rounds once
            /// where the CPU lacks F16C and twice where it has it) and on a GPU, which
            /// converts the same way.
            #[inline(always)]
            fn from_f64(v: f64) -> Self {
                <$t>::from_f32(v as f32)
            }
        }
    };
}
half_elem!(f16, DType::F16);
half_elem!(bf16, DType::BF16);

macro_rules! int_elem {
    ($t:ty, $dt:expr) => {
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DType = $dt;
            #[inline(always)]
            fn add(self, o: Self) -> Self {
                self.wrapping_add(o)
            }
            /// As MXNet's `s += x * alpha`, in the integer type as [`Element::scale`] (exact
            /// for any i64, wrapping: uint8's 200 + 100 is 44).
            #[inline(always)]
            fn axpy(self, alpha: f64, x: Self) -> Self {
                self.wrapping_add(x.scale(alpha))
            }
            /// In the integer type, as MXNet's scalar ops compute: by `alpha` cast to it
            /// (toward zero, and saturating where it is out of the type's range, where C++'s
            /// cast is undefined), wrapping (uint8's 200 * 2 is 144; no f64 rounds an i64).
            #[inline(always)]
            fn scale(self, alpha: f64) -> Self {
                self.wrapping_mul(alpha as $t)
            }
            #[inline(always)]
            fn to_f64(self) -> f64 {
                self as f64
            }
            #[inline(always)]
            fn from_f64(v: f64) -> Self {
                v as $t
            }
        }
    };
}
int_elem!(i32, DType::I32);
int_elem!(i64, DType::I64);
int_elem!(u8, DType::U8);

/// Runs `$body` with `$T` bound to the Rust element type of `$dt`.
macro_rules! with_dtype {
    ($dt:expr, $T:ident => $body:expr) => {
        match $dt {
            $crate::DType::F32 => {
                type $T = f32;
                $body
            }
            $crate::DType::F64 => {
                type $T = f64;
                $body
            }
            $crate::DType::F16 => {
                type $T = half::f16;
                $body
            }
            $crate::DType::BF16 => {
                type $T = half::bf16;
                $body
            }
            $crate::DType::I32 => {
                type $T = i32;
                $body
            }
            $crate::DType::I64 => {
                type $T = i64;
                $body
            }
            $crate::DType::U8 => {
                type $T = u8;
                $body
            }
        }
    };
}
pub(crate) use with_dtype;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip() {
        for dt in DType::ALL {
            assert_eq!(DType::from_code(dt.code()), Some(dt));
        }
        assert_eq!(DType::from_code(7), None);
        assert_eq!(DType::from_code(255), None);
    }

    #[test]
    fn integer_add_wraps_instead_of_panicking() {
        assert_eq!(Element::add(u8::MAX, 1u8), 0);
        assert_eq!(Element::add(i32::MAX, 1i32), i32::MIN);
    }

    #[test]
    fn devices_print_like_mxnet() {
        assert_eq!(cpu(0).to_string(), "cpu(0)");
        assert_eq!(cpu(3).to_string(), "cpu(3)");
        assert_eq!(gpu(1).to_string(), "gpu(1)");
        assert_eq!(cpu(0), Device::default());
    }
}
