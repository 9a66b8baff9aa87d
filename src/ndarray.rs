//! `NDArray`: an n-dimensional, typed, contiguous tensor.

use std::fmt;
use std::ops::Mul;
use std::sync::Arc;

use crate::dtype::with_dtype;
use crate::storage::{AlignedBuf, Storage};
use crate::{DType, Device, Element, KvError, Result};

mod lent;
mod place;

/// An n-dimensional array with a shape, a dtype, a device and contiguous (row-major) storage.
///
/// Cloning is cheap (the storage is shared) and copy-on-write: writing through one clone never
/// changes another, so an array handed to a store is never aliased by it.
///
/// ```
/// use kvstore::NDArray;
/// let a = NDArray::ones(&[2, 3]) * 2.0;
/// assert_eq!(a.to_vec::<f32>().unwrap(), vec![2.0; 6]);
/// assert_eq!(a.to_string(), "[[2. 2. 2.]\n [2. 2. 2.]]");
/// ```
pub struct NDArray {
    shape: Shape,
    dtype: DType,
    device: Device,
    buf: Arc<Storage>,
}

impl Clone for NDArray {
    /// Another handle on the same storage (a write through either copies it first).
    fn clone(&self) -> NDArray {
        NDArray {
            // A copy of the dimensions as plain memory (`SmallVec`'s own clone goes element
            // by element).
            shape: Shape::from_slice(&self.shape),
            dtype: self.dtype,
            device: self.device,
            buf: self.buf.clone(),
        }
    }
}

/// An array's shape: up to four dimensions held inline, so that making or cloning an array
/// (which every call does) allocates nothing for it.
pub(crate) type Shape = smallvec::SmallVec<[usize; 4]>;

/// The elements of `shape`, saturating where the product overflows (no array has such a
/// shape: every constructor checks its bytes first).
fn elems(shape: &[usize]) -> usize {
    shape
        .iter()
        .try_fold(1usize, |acc, &n| acc.checked_mul(n))
        .unwrap_or(usize::MAX)
}

/// The bytes of `shape` of `dtype`, or [`KvError::TooLarge`] where they overflow the address
/// range.
pub(crate) fn checked_bytes(shape: &[usize], dtype: DType) -> Result<usize> {
    shape
        .iter()
        .try_fold(dtype.size(), |acc, &n| acc.checked_mul(n))
        .filter(|&b| b <= isize::MAX as usize)
        .ok_or_else(|| too_large(shape, dtype))
}

#[cold]
#[inline(never)]
fn too_large(shape: &[usize], dtype: DType) -> KvError {
    KvError::TooLarge {
        shape: shape.to_vec(),
        dtype,
    }
}

impl NDArray {
    /// An array of zeros of the given dtype.
    ///
    /// # Panics
    /// Where the shape's size in bytes overflows the address range, or cannot be allocated,
    /// in every build ([`NDArray::try_zeros_dtype`] returns the error instead).
    pub fn zeros_dtype(shape: &[usize], dtype: DType) -> NDArray {
        match NDArray::try_zeros_dtype(shape, dtype) {
            Ok(a) => a,
            Err(e) => panic!("{e}"),
        }
    }

    /// An empty array (shape `[0]`): a stand-in for an array taken out of its place for a
    /// while, or state not made yet. Every one shares one empty storage, so making it
    /// allocates nothing (a write to it makes its own).
    pub(crate) fn placeholder(dtype: DType) -> NDArray {
        static EMPTY: std::sync::OnceLock<Arc<Storage>> = std::sync::OnceLock::new();
        let buf = EMPTY.get_or_init(|| Arc::new(Storage::Heap(AlignedBuf::zeroed(0))));
        NDArray {
            shape: Shape::from_slice(&[0]),
            dtype,
            device: Device::default(),
            buf: buf.clone(),
        }
    }

    /// An array of zeros, or [`KvError::TooLarge`] where the shape's size in bytes overflows
    /// (`zeros_dtype` panics there, as `vec!` does).
    pub fn try_zeros_dtype(shape: &[usize], dtype: DType) -> Result<NDArray> {
        let bytes = checked_bytes(shape, dtype)?;
        let buf = AlignedBuf::try_zeroed(bytes).ok_or_else(|| too_large(shape, dtype))?;
        Ok(NDArray {
            shape: Shape::from_slice(shape),
            dtype,
            device: Device::default(),
            buf: Arc::new(Storage::Heap(buf)),
        })
    }

    /// An f32 array of zeros, or an error where the size overflows.
    pub fn try_zeros(shape: &[usize]) -> Result<NDArray> {
        NDArray::try_zeros_dtype(shape, DType::F32)
    }

    /// An f32 array of zeros (MXNet's `nd.zeros`).
    pub fn zeros(shape: &[usize]) -> NDArray {
        NDArray::zeros_dtype(shape, DType::F32)
    }

    /// An f32 array of ones (MXNet's `nd.ones`).
    pub fn ones(shape: &[usize]) -> NDArray {
        NDArray::full(shape, 1.0)
    }

    /// An f32 array filled with `value`.
    pub fn full(shape: &[usize], value: f64) -> NDArray {
        NDArray::full_dtype(shape, value, DType::F32)
    }

    /// An array of the given dtype filled with `value` (converted to the dtype).
    pub fn full_dtype(shape: &[usize], value: f64, dtype: DType) -> NDArray {
        let mut a = NDArray::zeros_dtype(shape, dtype);
        a.fill(value);
        a
    }

    /// An array holding `data` in row-major order; the length must fill the shape.
    pub fn from_vec<T: Element>(shape: &[usize], data: Vec<T>) -> Result<NDArray> {
        NDArray::from_slice(shape, &data)
    }

    /// An array holding a copy of `data` in row-major order; the length must fill the shape.
    pub fn from_slice<T: Element>(shape: &[usize], data: &[T]) -> Result<NDArray> {
        checked_bytes(shape, T::DTYPE)?;
        if elems(shape) != data.len() {
            return Err(KvError::BadShape {
                shape: shape.to_vec(),
                len: data.len(),
            });
        }
        let mut a = NDArray::try_zeros_dtype(shape, T::DTYPE)?;
        kvstore_transport::copy::copy(a.as_bytes_mut(), bytemuck::cast_slice(data));
        Ok(a)
    }

    /// A 1-D array of the given dtype made from raw little-endian bytes.
    pub fn from_bytes(shape: &[usize], dtype: DType, bytes: &[u8]) -> Result<NDArray> {
        if checked_bytes(shape, dtype)? != bytes.len() {
            return Err(KvError::BadShape {
                shape: shape.to_vec(),
                len: bytes.len() / dtype.size().max(1),
            });
        }
        let mut a = NDArray::try_zeros_dtype(shape, dtype)?;
        kvstore_transport::copy::copy(a.as_bytes_mut(), bytes);
        Ok(a)
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The device.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The number of elements.
    #[inline]
    pub fn size(&self) -> usize {
        elems(&self.shape)
    }

    /// The number of bytes of storage.
    #[inline]
    pub fn nbytes(&self) -> usize {
        self.size() * self.dtype.size()
    }

    /// The storage as bytes.
    pub fn as_bytes(&self) -> &[u8] {
        self.buf.bytes()
    }

    /// The storage as mutable bytes (copies first if the storage is shared with a clone).
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        Arc::make_mut(&mut self.buf).bytes_mut()
    }

    fn check_type<T: Element>(&self) -> Result<()> {
        if T::DTYPE == self.dtype {
            Ok(())
        } else {
            Err(KvError::WrongElementType {
                actual: self.dtype,
                asked: T::DTYPE,
            })
        }
    }

    /// The elements as a typed slice; `T` must be the array's element type.
    pub fn as_slice<T: Element>(&self) -> Result<&[T]> {
        self.check_type::<T>()?;
        Ok(bytemuck::cast_slice(self.as_bytes()))
    }

    /// The elements as a mutable typed slice; `T` must be the array's element type.
    pub fn as_mut_slice<T: Element>(&mut self) -> Result<&mut [T]> {
        self.check_type::<T>()?;
        Ok(bytemuck::cast_slice_mut(self.as_bytes_mut()))
    }

    /// A copy of the elements; `T` must be the array's element type.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        self.as_slice::<T>().map(<[T]>::to_vec)
    }

    /// The elements converted to f64, whatever the dtype.
    pub fn to_f64_vec(&self) -> Vec<f64> {
        with_dtype!(self.dtype, T => bytemuck::cast_slice::<u8, T>(self.as_bytes())
            .iter()
            .map(|v| v.to_f64())
            .collect())
    }

    /// The element at a multi-index, converted to f64.
    pub fn get(&self, index: &[usize]) -> Result<f64> {
        let oob = || KvError::OutOfBounds {
            index: index.to_vec(),
            shape: self.shape.to_vec(),
        };
        if index.len() != self.shape.len() {
            return Err(oob());
        }
        let mut flat = 0usize;
        for (&i, &n) in index.iter().zip(&self.shape) {
            if i >= n {
                return Err(oob());
            }
            flat = flat * n + i;
        }
        Ok(
            with_dtype!(self.dtype, T => bytemuck::cast_slice::<u8, T>(self.as_bytes())[flat].to_f64()),
        )
    }

    /// Sets every element to `value` (converted to the dtype).
    pub fn fill(&mut self, value: f64) {
        let dtype = self.dtype;
        with_dtype!(dtype, T => {
            // Element's conversion (through f32 for halves), not the `half` crate's inherent
            // one, which a concrete T here would otherwise call.
            let v = <T as crate::Element>::from_f64(value);
            bytemuck::cast_slice_mut::<u8, T>(self.as_bytes_mut()).fill(v);
        })
    }

    fn check_same(&self, other: &NDArray) -> Result<()> {
        if self.shape != other.shape || self.dtype != other.dtype {
            return Err(KvError::Incompatible(format!(
                "{:?} {} vs {:?} {}",
                self.shape, self.dtype, other.shape, other.dtype
            )));
        }
        Ok(())
    }

    /// `self += other`, element-wise (same shape and dtype).
    pub fn add_assign(&mut self, other: &NDArray) -> Result<()> {
        self.check_same(other)?;
        let dtype = self.dtype;
        let src = other.buf.clone();
        with_dtype!(dtype, T => crate::ops::add_into::<T>(
            bytemuck::cast_slice_mut(self.as_bytes_mut()),
            bytemuck::cast_slice(src.bytes()),
        ));
        Ok(())
    }

    /// `self += alpha * x`, element-wise, in place (same shape and dtype): MXNet's
    /// `self += x * alpha`, the product in the element type as [`NDArray::scale_inplace`]
    /// computes it (an integer array's exactly and wrapping, uint8's 200 + 100 * 1 is 44).
    pub fn axpy(&mut self, alpha: f64, x: &NDArray) -> Result<()> {
        self.check_same(x)?;
        let dtype = self.dtype;
        let src = x.buf.clone();
        with_dtype!(dtype, T => crate::ops::axpy_into::<T>(
            bytemuck::cast_slice_mut(self.as_bytes_mut()),
            alpha,
            bytemuck::cast_slice(src.bytes()),
        ));
        Ok(())
    }

    /// `self *= alpha`, in place. An integer array multiplies in its own type, as MXNet's
    /// scalar ops do: by `alpha` cast to it (toward zero, saturating), wrapping (uint8's
    /// 200 * 2 is 144); a float16 or bfloat16 one by `alpha` rounded to its type.
    pub fn scale_inplace(&mut self, alpha: f64) {
        let dtype = self.dtype;
        with_dtype!(dtype, T => {
            for v in bytemuck::cast_slice_mut::<u8, T>(self.as_bytes_mut()) {
                *v = v.scale(alpha);
            }
        })
    }

    /// A new array `self * alpha`.
    pub fn scaled(&self, alpha: f64) -> NDArray {
        let mut out = self.clone();
        out.scale_inplace(alpha);
        out
    }

    /// Turns this array into a receive buffer of `shape` and `dtype`, keeping its allocation
    /// when it is big enough and not shared. Its contents are unspecified afterwards.
    pub(crate) fn reset_as(&mut self, shape: &[usize], dtype: DType) {
        let len = elems(shape).saturating_mul(dtype.size());
        match Arc::get_mut(&mut self.buf) {
            Some(b) => b.set_len(len),
            None => self.buf = Arc::new(self.buf.fresh(len)),
        }
        self.shape.clear();
        self.shape.extend_from_slice(shape);
        self.dtype = dtype;
    }

    /// Whether the bytes are memory the caller lent ([`NDArray::from_raw_parts`]).
    pub(crate) fn is_external(&self) -> bool {
        matches!(&*self.buf, Storage::External(_))
    }

    /// Whether storage is shared with another clone (for tests of copy counts).
    pub fn shares_storage_with(&self, other: &NDArray) -> bool {
        Arc::ptr_eq(&self.buf, &other.buf)
    }
}

/// `array * alpha` for any scalar that converts to f64 without loss (f32, f64, integers up to
/// 32 bits), as MXNet's `nd * 2`.
impl<S: Into<f64>> Mul<S> for &NDArray {
    type Output = NDArray;
    fn mul(self, alpha: S) -> NDArray {
        self.scaled(alpha.into())
    }
}

impl<S: Into<f64>> Mul<S> for NDArray {
    type Output = NDArray;
    fn mul(mut self, alpha: S) -> NDArray {
        self.scale_inplace(alpha.into());
        self
    }
}

impl PartialEq for NDArray {
    fn eq(&self, other: &NDArray) -> bool {
        self.shape == other.shape
            && self.dtype == other.dtype
            && self.as_bytes() == other.as_bytes()
    }
}

impl fmt::Debug for NDArray {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "NDArray(shape={:?}, dtype={}, device={},\n{})",
            self.shape, self.dtype, self.device, self
        )
    }
}

impl fmt::Display for NDArray {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&crate::format::format_array(self))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};

    #[test]
    fn halves_are_filled_through_float32() {
        // Just past halfway between two bfloat16s as a float32 (0xbf9a8006): the `half`
        // crate's bf16::from_f64 rounded it down, from the f64's top 32 bits only.
        let x = f64::from(f32::from_bits(0xbf9a_8006));
        let b = NDArray::full_dtype(&[2], x, DType::BF16);
        assert_eq!(b.as_slice::<bf16>().unwrap()[1].to_bits(), 0xbf9b);
        // Just past halfway between 1 and the next float16, but halfway once in float32: one
        // rounding gives 0x3c01, two (through f32, as everywhere here and on a GPU) 0x3c00.
        let y = 1.0 + 2f64.powi(-11) + 2f64.powi(-30);
        let h = NDArray::full_dtype(&[2], y, DType::F16);
        assert_eq!(h.as_slice::<f16>().unwrap()[0].to_bits(), 0x3c00);
    }

    #[test]
    fn constructors() {
        let z = NDArray::zeros(&[2, 3]);
        assert_eq!(z.shape(), &[2, 3]);
        assert_eq!(z.dtype(), DType::F32);
        assert_eq!(z.to_vec::<f32>().unwrap(), vec![0.0; 6]);
        assert_eq!(NDArray::ones(&[4]).to_vec::<f32>().unwrap(), vec![1.0; 4]);
        assert_eq!(
            NDArray::full_dtype(&[2], 7.0, DType::I64)
                .to_vec::<i64>()
                .unwrap(),
            vec![7, 7]
        );
        let v = NDArray::from_vec(&[2, 2], vec![1.0f64, 2.0, 3.0, 4.0]).unwrap();
        assert_eq!(v.dtype(), DType::F64);
        assert_eq!(v.get(&[1, 0]).unwrap(), 3.0);
        assert!(v.get(&[2, 0]).is_err());
        assert!(v.get(&[0]).is_err());
        assert!(matches!(
            NDArray::from_vec(&[3], vec![1i32, 2]),
            Err(KvError::BadShape { .. })
        ));
        assert!(matches!(
            v.to_vec::<f32>(),
            Err(KvError::WrongElementType { .. })
        ));
    }

    #[test]
    fn every_dtype_does_arithmetic() {
        for dt in DType::ALL {
            let mut a = NDArray::full_dtype(&[3], 2.0, dt);
            let b = NDArray::full_dtype(&[3], 3.0, dt);
            a.add_assign(&b).unwrap();
            assert_eq!(a.to_f64_vec(), vec![5.0; 3], "{dt}");
            a.axpy(2.0, &b).unwrap();
            assert_eq!(a.to_f64_vec(), vec![11.0; 3], "{dt}");
            assert_eq!(a.scaled(2.0).to_f64_vec(), vec![22.0; 3], "{dt}");
        }
        let h = NDArray::from_vec(&[1], vec![f16::from_f32(1.5)]).unwrap();
        assert_eq!(h.dtype(), DType::F16);
        let b = NDArray::from_vec(&[1], vec![bf16::from_f32(-2.0)]).unwrap();
        assert_eq!(b.dtype(), DType::BF16);
        // Integers multiply in their own type, as MXNet's scalar ops: exactly, wrapping, by
        // the scalar cast to the type (before, through f64: rounded and saturated).
        let big = NDArray::from_vec(&[1], vec![9_007_199_254_740_993i64]).unwrap() * 1;
        assert_eq!(big.to_vec::<i64>().unwrap(), [9_007_199_254_740_993]);
        let u = NDArray::full_dtype(&[1], 200.0, DType::U8) * 2;
        assert_eq!(u.to_vec::<u8>().unwrap(), [144]);
        let i = NDArray::full_dtype(&[1], 7.0, DType::I32) * 1.9;
        assert_eq!(i.to_vec::<i32>().unwrap(), [7]);
        // axpy (`s += x * a`) by the same rules (before, through f64: an i64 rounded, a
        // uint8 saturated, 7 + 1.5 * 3 was 11).
        let mut big = NDArray::from_vec(&[1], vec![9_007_199_254_740_993i64]).unwrap();
        big.axpy(1.0, &NDArray::from_vec(&[1], vec![0i64]).unwrap())
            .unwrap();
        assert_eq!(big.to_vec::<i64>().unwrap(), [9_007_199_254_740_993]);
        let mut u = NDArray::full_dtype(&[1], 200.0, DType::U8);
        u.axpy(1.0, &NDArray::full_dtype(&[1], 100.0, DType::U8))
            .unwrap();
        assert_eq!(u.to_vec::<u8>().unwrap(), [44]);
        let mut i = NDArray::full_dtype(&[1], 7.0, DType::I32);
        i.axpy(1.5, &NDArray::full_dtype(&[1], 3.0, DType::I32))
            .unwrap();
        assert_eq!(i.to_vec::<i32>().unwrap(), [10]);
        // A half array by the scalar rounded to its type: half(1.0004) is 1.
        let h = NDArray::full_dtype(&[1], 1000.0, DType::F16) * 1.0004;
        assert_eq!(h.to_f64_vec(), [1000.0]);
        let mut h = NDArray::full_dtype(&[1], 1000.0, DType::F16);
        h.axpy(1.0004, &NDArray::full_dtype(&[1], 1.0, DType::F16))
            .unwrap();
        assert_eq!(h.to_f64_vec(), [1001.0]);
    }

    #[test]
    fn clones_are_copy_on_write() {
        let a = NDArray::ones(&[4]);
        let mut b = a.clone();
        assert!(a.shares_storage_with(&b));
        b.fill(5.0);
        assert!(!a.shares_storage_with(&b));
        assert_eq!(a.to_vec::<f32>().unwrap(), vec![1.0; 4]);
        assert_eq!(b.to_vec::<f32>().unwrap(), vec![5.0; 4]);
    }

    #[test]
    fn mismatched_operands_are_errors() {
        let mut a = NDArray::ones(&[2, 3]);
        assert!(a.add_assign(&NDArray::ones(&[3, 2])).is_err());
        assert!(a
            .add_assign(&NDArray::full_dtype(&[2, 3], 1.0, DType::F64))
            .is_err());
        assert!(a.copy_from(&NDArray::ones(&[6])).is_err());
        assert_eq!(a.to_vec::<f32>().unwrap(), vec![1.0; 6]);
    }

    #[test]
    fn self_add_through_a_clone() {
        let mut a = NDArray::ones(&[3]);
        let b = a.clone();
        a.add_assign(&b).unwrap();
        assert_eq!(a.to_vec::<f32>().unwrap(), vec![2.0; 3]);
        assert_eq!(b.to_vec::<f32>().unwrap(), vec![1.0; 3]);
    }
}
