//! Element types a host [`Tensor`](super::Tensor) can store.

use std::fmt;

use half::{bf16, f16};

use crate::dtype::DType;

/// A storage type of host tensors: `f32`, `f16`, `bf16` or `i32`.
///
/// Arithmetic is f32-centric: the conversions here are how generic code (casts,
/// interpolation) reads and writes elements. Integer conversion from f32 truncates toward zero
/// and saturates, as in [`crate::convert::from_f32`].
pub trait Element: Copy + Default + PartialEq + fmt::Debug + Send + Sync + 'static {
    /// The matching [`DType`].
    const DTYPE: DType;
    /// Bytes per element.
    const SIZE: usize;
    /// The value as f32.
    fn to_f32(self) -> f32;
    /// The element nearest to `v` (f16/bf16 round to nearest even, i32 truncates).
    fn from_f32(v: f32) -> Self;
    /// Appends the little-endian encoding of the value to `out`.
    fn write_le(self, out: &mut Vec<u8>);
    /// Decodes a value from exactly [`Element::SIZE`] little-endian bytes.
    fn read_le(bytes: &[u8]) -> Self;
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    const SIZE: usize = 4;
    #[inline]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline]
    fn from_f32(v: f32) -> Self {
        v
    }
    fn write_le(self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.to_le_bytes());
    }
    fn read_le(b: &[u8]) -> Self {
        f32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }
}

impl Element for f16 {
    const DTYPE: DType = DType::F16;
    const SIZE: usize = 2;
    #[inline]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline]
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
    fn write_le(self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.to_le_bytes());
    }
    fn read_le(b: &[u8]) -> Self {
        f16::from_le_bytes([b[0], b[1]])
    }
}

impl Element for bf16 {
    const DTYPE: DType = DType::BF16;
    const SIZE: usize = 2;
    #[inline]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    #[inline]
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
    fn write_le(self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.to_le_bytes());
    }
    fn read_le(b: &[u8]) -> Self {
        bf16::from_le_bytes([b[0], b[1]])
    }
}

impl Element for i32 {
    const DTYPE: DType = DType::I32;
    const SIZE: usize = 4;
    #[inline]
    fn to_f32(self) -> f32 {
        self as f32
    }
    #[inline]
    fn from_f32(v: f32) -> Self {
        v as i32
    }
    fn write_le(self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.to_le_bytes());
    }
    fn read_le(b: &[u8]) -> Self {
        i32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip<T: Element>(v: T) {
        let mut b = Vec::new();
        v.write_le(&mut b);
        assert_eq!(b.len(), T::SIZE);
        assert_eq!(T::SIZE, T::DTYPE.type_size());
        assert_eq!(T::read_le(&b), v);
    }

    #[test]
    fn bytes_round_trip() {
        round_trip(1.5f32);
        round_trip(f16::from_f32(-2.25));
        round_trip(bf16::from_f32(3.0e10));
        round_trip(-123456i32);
    }

    #[test]
    fn conversions() {
        assert_eq!(<f16 as Element>::from_f32(0.5).to_f32(), 0.5);
        assert_eq!(<bf16 as Element>::from_f32(-4.0).to_f32(), -4.0);
        assert_eq!(<i32 as Element>::from_f32(-2.7), -2);
        assert_eq!(<i32 as Element>::from_f32(f32::MAX), i32::MAX);
    }
}
