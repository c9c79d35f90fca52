//! Conversion between element types.
//!
//! Float types (f32, f16, bf16, f64) convert in Rust through `half`; quantized types go
//! through ggml (`ggml_quantize_chunk` to quantize, the type traits' `to_float` to
//! dequantize). Every function checks sizes first and returns [`ConvertError`] instead of
//! letting ggml assert.

use half::{bf16, f16};
use thiserror::Error;

use crate::dtype::DType;
use ggml_sys as sys;

/// Why a conversion could not be done.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum ConvertError {
    /// The byte count is not a whole number of elements or blocks of the dtype.
    #[error("{bytes} bytes are not a whole number of {dtype} elements")]
    RaggedBytes {
        /// The dtype.
        dtype: DType,
        /// The byte count.
        bytes: usize,
    },
    /// A row length that is not a multiple of the target's block size.
    #[error("rows of {row} elements cannot be stored as {dtype} (block size {block})")]
    RaggedRow {
        /// The target dtype.
        dtype: DType,
        /// The row length in elements.
        row: usize,
        /// The dtype's block size.
        block: usize,
    },
    /// The element count is not a multiple of the row length.
    #[error("{elements} elements do not split into rows of {row}")]
    RaggedRows {
        /// The element count.
        elements: usize,
        /// The row length.
        row: usize,
    },
    /// No conversion exists between these types (for example integer to quantized).
    #[error("no conversion from {from} to {to}")]
    Unsupported {
        /// The source dtype.
        from: DType,
        /// The target dtype.
        to: DType,
    },
}

/// Number of elements held by `bytes` bytes of `dtype`.
pub fn element_count(dtype: DType, bytes: usize) -> Result<usize, ConvertError> {
    let ts = dtype.type_size();
    if !bytes.is_multiple_of(ts) {
        return Err(ConvertError::RaggedBytes { dtype, bytes });
    }
    Ok(bytes / ts * dtype.block_size())
}

/// Decodes `bytes` of `dtype` (little endian) to f32.
pub fn to_f32(dtype: DType, bytes: &[u8]) -> Result<Vec<f32>, ConvertError> {
    let n = element_count(dtype, bytes.len())?;
    let mut out = vec![0f32; n];
    to_f32_into(dtype, bytes, &mut out)?;
    Ok(out)
}

/// Decodes `bytes` of `dtype` into `out`, which must hold exactly the element count.
pub fn to_f32_into(dtype: DType, bytes: &[u8], out: &mut [f32]) -> Result<(), ConvertError> {
    let n = element_count(dtype, bytes.len())?;
    if n != out.len() {
        return Err(ConvertError::RaggedRows {
            elements: n,
            row: out.len(),
        });
    }
    match dtype {
        DType::F32 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        DType::F16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        DType::BF16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = bf16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        DType::F64 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(8)) {
                *o = f64::from_le_bytes(c.try_into().unwrap()) as f32;
            }
        }
        DType::I8 => {
            for (o, &b) in out.iter_mut().zip(bytes) {
                *o = b as i8 as f32;
            }
        }
        DType::I16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = i16::from_le_bytes([c[0], c[1]]) as f32;
            }
        }
        DType::I32 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f32;
            }
        }
        DType::I64 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(8)) {
                *o = i64::from_le_bytes(c.try_into().unwrap()) as f32;
            }
        }
        q => {
            // SAFETY: `q` is a valid quantized ggml type; its traits have `to_float`, and the
            // sizes were checked above (bytes hold exactly n / block_size blocks).
            unsafe {
                let traits = sys::ggml_get_type_traits(q.to_ggml());
                let f = (*traits).to_float.ok_or(ConvertError::Unsupported {
                    from: q,
                    to: DType::F32,
                })?;
                f(bytes.as_ptr().cast(), out.as_mut_ptr(), n as i64);
            }
        }
    }
    Ok(())
}

/// Encodes f32 values as `dtype`, with rows of `row` elements (quantized types need rows
/// that are whole blocks). Integer targets round toward zero with saturation.
pub fn from_f32(dtype: DType, values: &[f32], row: usize) -> Result<Vec<u8>, ConvertError> {
    if row == 0 || !values.len().is_multiple_of(row) {
        return Err(ConvertError::RaggedRows {
            elements: values.len(),
            row,
        });
    }
    let mut out = Vec::with_capacity(values.len() * dtype.type_size() / dtype.block_size());
    match dtype {
        DType::F32 => values
            .iter()
            .for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
        DType::F16 => values
            .iter()
            .for_each(|v| out.extend_from_slice(&f16::from_f32(*v).to_le_bytes())),
        DType::BF16 => values
            .iter()
            .for_each(|v| out.extend_from_slice(&bf16::from_f32(*v).to_le_bytes())),
        DType::F64 => values
            .iter()
            .for_each(|v| out.extend_from_slice(&(*v as f64).to_le_bytes())),
        DType::I8 => values.iter().for_each(|v| out.push(*v as i8 as u8)),
        DType::I16 => values
            .iter()
            .for_each(|v| out.extend_from_slice(&(*v as i16).to_le_bytes())),
        DType::I32 => values
            .iter()
            .for_each(|v| out.extend_from_slice(&(*v as i32).to_le_bytes())),
        DType::I64 => values
            .iter()
            .for_each(|v| out.extend_from_slice(&(*v as i64).to_le_bytes())),
        q => return quantize(q, values, row),
    }
    Ok(out)
}

/// Quantizes `values` (rows of `row` elements) to a ggml block type.
pub fn quantize(dtype: DType, values: &[f32], row: usize) -> Result<Vec<u8>, ConvertError> {
    if !dtype.is_quantized() {
        return from_f32(dtype, values, row);
    }
    if row == 0 || !values.len().is_multiple_of(row) {
        return Err(ConvertError::RaggedRows {
            elements: values.len(),
            row,
        });
    }
    let row_bytes = dtype.row_size(row).ok_or(ConvertError::RaggedRow {
        dtype,
        row,
        block: dtype.block_size(),
    })?;
    let nrows = values.len() / row;
    let mut out = vec![0u8; row_bytes * nrows];
    if nrows == 0 {
        return Ok(out);
    }
    // SAFETY: sizes checked: `values` holds nrows * row floats and `out` nrows * row_bytes
    // bytes; a null importance matrix is allowed for every type used here.
    let written = unsafe {
        sys::ggml_quantize_chunk(
            dtype.to_ggml(),
            values.as_ptr(),
            out.as_mut_ptr().cast(),
            0,
            nrows as i64,
            row as i64,
            std::ptr::null(),
        )
    };
    debug_assert_eq!(written, out.len());
    Ok(out)
}

/// Converts `bytes` of `from` to `to`, with rows of `row` elements. The identity conversion
/// copies; float-to-float conversions stay in Rust; anything involving a quantized type goes
/// through f32.
pub fn convert(from: DType, bytes: &[u8], to: DType, row: usize) -> Result<Vec<u8>, ConvertError> {
    if from == to {
        element_count(from, bytes.len())?;
        return Ok(bytes.to_vec());
    }
    let is_int = |d: DType| matches!(d, DType::I8 | DType::I16 | DType::I32 | DType::I64);
    if (is_int(from) && to.is_quantized()) || (from.is_quantized() && is_int(to)) {
        return Err(ConvertError::Unsupported { from, to });
    }
    let values = to_f32(from, bytes)?;
    from_f32(to, &values, row)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ramp(n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0)
            .collect()
    }

    #[test]
    fn float_round_trips() {
        let v = ramp(512);
        for (d, tol) in [
            (DType::F32, 0.0),
            (DType::F16, 1e-3),
            (DType::BF16, 8e-3),
            (DType::F64, 0.0),
        ] {
            let b = from_f32(d, &v, 512).unwrap();
            let back = to_f32(d, &b).unwrap();
            let err = v
                .iter()
                .zip(&back)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(err <= tol, "{d}: {err}");
        }
    }

    #[test]
    fn quantized_round_trips_within_bounds() {
        let v = ramp(4 * 256);
        for (d, tol) in [
            (DType::Q8_0, 1e-2),
            (DType::Q5_0, 0.07),
            (DType::Q4_0, 0.13),
            (DType::Q4K, 0.1),
            (DType::Q6K, 0.03),
        ] {
            let b = quantize(d, &v, 256).unwrap();
            assert_eq!(b.len(), 4 * d.row_size(256).unwrap());
            let back = to_f32(d, &b).unwrap();
            let err = v
                .iter()
                .zip(&back)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(err <= tol, "{d}: {err}");
        }
    }

    #[test]
    fn ragged_input_is_an_error() {
        assert!(matches!(
            to_f32(DType::F32, &[0; 7]),
            Err(ConvertError::RaggedBytes { .. })
        ));
        assert!(matches!(
            quantize(DType::Q8_0, &[0.0; 48], 48),
            Err(ConvertError::RaggedRow { .. })
        ));
        assert!(matches!(
            from_f32(DType::F16, &[0.0; 5], 2),
            Err(ConvertError::RaggedRows { .. })
        ));
        assert!(convert(DType::I32, &[0; 4], DType::Q8_0, 1).is_err());
    }
}
