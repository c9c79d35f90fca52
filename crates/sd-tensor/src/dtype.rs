//! Element types: the dtypes that model files hold and that ggml computes with.

use std::fmt;

use ggml_sys as sys;

/// An element type of a tensor, on the host or in ggml.
///
/// The plain types map one to one to ggml types; the quantized ones are ggml's block formats
/// (a row of `n` elements takes [`DType::row_size`] bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    /// 32-bit IEEE float.
    F32,
    /// 16-bit IEEE float (half).
    F16,
    /// bfloat16: the top 16 bits of an f32.
    BF16,
    /// 64-bit IEEE float.
    F64,
    /// Signed 8-bit integer.
    I8,
    /// Signed 16-bit integer.
    I16,
    /// Signed 32-bit integer.
    I32,
    /// Signed 64-bit integer.
    I64,
    /// ggml 4-bit blocks of 32 with one f16 scale.
    Q4_0,
    /// ggml 4-bit blocks of 32 with an f16 scale and minimum.
    Q4_1,
    /// ggml 5-bit blocks of 32 with one f16 scale.
    Q5_0,
    /// ggml 5-bit blocks of 32 with an f16 scale and minimum.
    Q5_1,
    /// ggml 8-bit blocks of 32 with one f16 scale.
    Q8_0,
    /// ggml k-quant, 2 bits (super-blocks of 256).
    Q2K,
    /// ggml k-quant, 3 bits (super-blocks of 256).
    Q3K,
    /// ggml k-quant, 4 bits (super-blocks of 256).
    Q4K,
    /// ggml k-quant, 5 bits (super-blocks of 256).
    Q5K,
    /// ggml k-quant, 6 bits (super-blocks of 256).
    Q6K,
}

/// All dtypes, in declaration order.
pub const ALL_DTYPES: [DType; 18] = [
    DType::F32,
    DType::F16,
    DType::BF16,
    DType::F64,
    DType::I8,
    DType::I16,
    DType::I32,
    DType::I64,
    DType::Q4_0,
    DType::Q4_1,
    DType::Q5_0,
    DType::Q5_1,
    DType::Q8_0,
    DType::Q2K,
    DType::Q3K,
    DType::Q4K,
    DType::Q5K,
    DType::Q6K,
];

impl DType {
    /// The ggml type with the same layout.
    pub fn to_ggml(self) -> sys::ggml_type {
        match self {
            DType::F32 => sys::GGML_TYPE_F32,
            DType::F16 => sys::GGML_TYPE_F16,
            DType::BF16 => sys::GGML_TYPE_BF16,
            DType::F64 => sys::GGML_TYPE_F64,
            DType::I8 => sys::GGML_TYPE_I8,
            DType::I16 => sys::GGML_TYPE_I16,
            DType::I32 => sys::GGML_TYPE_I32,
            DType::I64 => sys::GGML_TYPE_I64,
            DType::Q4_0 => sys::GGML_TYPE_Q4_0,
            DType::Q4_1 => sys::GGML_TYPE_Q4_1,
            DType::Q5_0 => sys::GGML_TYPE_Q5_0,
            DType::Q5_1 => sys::GGML_TYPE_Q5_1,
            DType::Q8_0 => sys::GGML_TYPE_Q8_0,
            DType::Q2K => sys::GGML_TYPE_Q2_K,
            DType::Q3K => sys::GGML_TYPE_Q3_K,
            DType::Q4K => sys::GGML_TYPE_Q4_K,
            DType::Q5K => sys::GGML_TYPE_Q5_K,
            DType::Q6K => sys::GGML_TYPE_Q6_K,
        }
    }

    /// The dtype for a ggml type, if sd-rs knows it.
    pub fn from_ggml(t: sys::ggml_type) -> Option<DType> {
        ALL_DTYPES.iter().copied().find(|d| d.to_ggml() == t)
    }

    /// Elements per block (1 for plain types).
    pub fn block_size(self) -> usize {
        match self {
            DType::Q4_0 | DType::Q4_1 | DType::Q5_0 | DType::Q5_1 | DType::Q8_0 => 32,
            DType::Q2K | DType::Q3K | DType::Q4K | DType::Q5K | DType::Q6K => 256,
            _ => 1,
        }
    }

    /// Bytes per block (the element size for plain types).
    pub fn type_size(self) -> usize {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 | DType::I16 => 2,
            DType::I8 => 1,
            DType::Q4_0 => 18,
            DType::Q4_1 => 20,
            DType::Q5_0 => 22,
            DType::Q5_1 => 24,
            DType::Q8_0 => 34,
            DType::Q2K => 84,
            DType::Q3K => 110,
            DType::Q4K => 144,
            DType::Q5K => 176,
            DType::Q6K => 210,
        }
    }

    /// Whether this is one of ggml's quantized block formats.
    pub fn is_quantized(self) -> bool {
        self.block_size() > 1
    }

    /// Whether this is a floating point type that [`crate::convert`] converts without ggml.
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F16 | DType::BF16 | DType::F64)
    }

    /// Bytes taken by a row of `n` elements, or `None` when `n` is not a whole number of
    /// blocks or the size overflows.
    pub fn row_size(self, n: usize) -> Option<usize> {
        if !n.is_multiple_of(self.block_size()) {
            return None;
        }
        (n / self.block_size()).checked_mul(self.type_size())
    }

    /// Bytes taken by `n` elements stored contiguously (rows of whole blocks).
    pub fn bytes_for(self, n: usize) -> Option<usize> {
        self.row_size(n)
    }

    /// The lower-case name ggml uses (`f32`, `q8_0`, `q4_K`, ...).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::F64 => "f64",
            DType::I8 => "i8",
            DType::I16 => "i16",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::Q4_0 => "q4_0",
            DType::Q4_1 => "q4_1",
            DType::Q5_0 => "q5_0",
            DType::Q5_1 => "q5_1",
            DType::Q8_0 => "q8_0",
            DType::Q2K => "q2_K",
            DType::Q3K => "q3_K",
            DType::Q4K => "q4_K",
            DType::Q5K => "q5_K",
            DType::Q6K => "q6_K",
        }
    }

    /// Parses a name as written by users (`--type q8_0`, case-insensitive).
    pub fn parse(s: &str) -> Option<DType> {
        let l = s.to_ascii_lowercase();
        ALL_DTYPES
            .iter()
            .copied()
            .find(|d| d.name().to_ascii_lowercase() == l)
    }

    /// Parses a type weights can be converted to when loaded (`sd --type`, `sd-bench
    /// --type`): f32, f16, bf16 or one of ggml's quantized formats; `None` for anything else
    /// (integers, f64, unknown names).
    pub fn parse_weight_type(s: &str) -> Option<DType> {
        DType::parse(s).filter(|d| (d.is_float() && *d != DType::F64) || d.is_quantized())
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_agree_with_ggml() {
        for d in ALL_DTYPES {
            let t = d.to_ggml();
            // SAFETY: pure functions of a valid ggml type.
            let (bs, ts) = unsafe { (sys::ggml_blck_size(t) as usize, sys::ggml_type_size(t)) };
            assert_eq!(bs, d.block_size(), "{d}");
            assert_eq!(ts, d.type_size(), "{d}");
            let name = unsafe { std::ffi::CStr::from_ptr(sys::ggml_type_name(t)) };
            assert_eq!(name.to_str().unwrap(), d.name());
            assert_eq!(DType::from_ggml(t), Some(d));
            assert_eq!(DType::parse(&d.name().to_uppercase()), Some(d));
        }
    }

    #[test]
    fn weight_types_are_floats_and_block_formats() {
        assert_eq!(DType::parse_weight_type("BF16"), Some(DType::BF16));
        assert_eq!(DType::parse_weight_type("q4_k"), Some(DType::Q4K));
        assert_eq!(DType::parse_weight_type("f32"), Some(DType::F32));
        for no in ["f64", "i8", "i32", "q9_0", ""] {
            assert_eq!(DType::parse_weight_type(no), None, "{no}");
        }
    }

    #[test]
    fn row_size_rejects_partial_blocks() {
        assert_eq!(DType::Q8_0.row_size(64), Some(68));
        assert_eq!(DType::Q8_0.row_size(33), None);
        assert_eq!(DType::F16.row_size(3), Some(6));
        assert_eq!(DType::F32.row_size(usize::MAX), None);
    }
}
