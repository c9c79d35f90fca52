//! GGUF v2/v3, read by sd-rs itself (ggml's reader asserts on bad input).
//!
//! Layout: `"GGUF"`, version (u32), tensor count (u64), key-value count (u64), the key-value
//! pairs, the tensor infos (name, dimension count, `ne` innermost first, ggml type, offset
//! relative to the data section), padding to the alignment (`general.alignment`, default 32),
//! then the data section. All integers are little endian.

use std::collections::BTreeMap;

use sd_tensor::DType;

use super::error::{Ctx, FileError};
use super::layout::{byte_size, check_bounds, check_overlaps, check_unique, Span};
use super::source::{Cursor, Source};
use crate::{FileId, TensorStorage};

/// The four magic bytes.
pub const MAGIC: &[u8; 4] = b"GGUF";
/// Alignment of tensor data when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// Most dimensions a GGUF tensor has (ggml's `GGML_MAX_DIMS`).
pub const MAX_DIMS: u32 = 4;
/// Deepest nesting of arrays accepted in metadata.
const MAX_ARRAY_DEPTH: u32 = 8;

/// A metadata value type id.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgufType {
    /// 0
    U8,
    /// 1
    I8,
    /// 2
    U16,
    /// 3
    I16,
    /// 4
    U32,
    /// 5
    I32,
    /// 6
    F32,
    /// 7
    Bool,
    /// 8
    String,
    /// 9
    Array,
    /// 10
    U64,
    /// 11
    I64,
    /// 12
    F64,
}

impl GgufType {
    /// The type for an id, if valid.
    pub fn from_id(id: u32) -> Option<GgufType> {
        use GgufType::*;
        Some(match id {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    /// Smallest encoded size of one value (used to bound counts before allocating).
    fn min_size(self) -> u64 {
        use GgufType::*;
        match self {
            U8 | I8 | Bool => 1,
            U16 | I16 => 2,
            U32 | I32 | F32 => 4,
            U64 | I64 | F64 | String => 8,
            Array => 12,
        }
    }
}

/// One metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum GgufValue {
    /// uint8
    U8(u8),
    /// int8
    I8(i8),
    /// uint16
    U16(u16),
    /// int16
    I16(i16),
    /// uint32
    U32(u32),
    /// int32
    I32(i32),
    /// float32
    F32(f32),
    /// bool
    Bool(bool),
    /// UTF-8 string (invalid sequences replaced).
    String(String),
    /// A typed array.
    Array(GgufArray),
    /// uint64
    U64(u64),
    /// int64
    I64(i64),
    /// float64
    F64(f64),
}

/// A metadata array, stored compactly by element type.
#[derive(Clone, Debug, PartialEq)]
pub enum GgufArray {
    /// uint8 elements
    U8(Vec<u8>),
    /// int8 elements
    I8(Vec<i8>),
    /// uint16 elements
    U16(Vec<u16>),
    /// int16 elements
    I16(Vec<i16>),
    /// uint32 elements
    U32(Vec<u32>),
    /// int32 elements
    I32(Vec<i32>),
    /// float32 elements
    F32(Vec<f32>),
    /// bool elements
    Bool(Vec<bool>),
    /// string elements
    String(Vec<String>),
    /// nested arrays
    Array(Vec<GgufArray>),
    /// uint64 elements
    U64(Vec<u64>),
    /// int64 elements
    I64(Vec<i64>),
    /// float64 elements
    F64(Vec<f64>),
}

impl GgufArray {
    /// Number of elements.
    pub fn len(&self) -> usize {
        use GgufArray::*;
        match self {
            U8(v) => v.len(),
            I8(v) => v.len(),
            U16(v) => v.len(),
            I16(v) => v.len(),
            U32(v) => v.len(),
            I32(v) => v.len(),
            F32(v) => v.len(),
            Bool(v) => v.len(),
            String(v) => v.len(),
            Array(v) => v.len(),
            U64(v) => v.len(),
            I64(v) => v.len(),
            F64(v) => v.len(),
        }
    }

    /// Whether the array is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl GgufValue {
    /// The value as a string, if it is one.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }

    /// Any integer value that fits an `i64`.
    pub fn as_i64(&self) -> Option<i64> {
        Some(match *self {
            GgufValue::U8(v) => v.into(),
            GgufValue::I8(v) => v.into(),
            GgufValue::U16(v) => v.into(),
            GgufValue::I16(v) => v.into(),
            GgufValue::U32(v) => v.into(),
            GgufValue::I32(v) => v.into(),
            GgufValue::U64(v) => i64::try_from(v).ok()?,
            GgufValue::I64(v) => v,
            _ => return None,
        })
    }

    /// Any numeric value as `f64`.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            GgufValue::F32(v) => Some(v.into()),
            GgufValue::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    /// The value as a bool, if it is one.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            GgufValue::Bool(b) => Some(b),
            _ => None,
        }
    }
}

/// Everything in a GGUF file besides the tensor data.
#[derive(Clone, Debug, PartialEq)]
pub struct GgufHeader {
    /// Format version (2 or 3).
    pub version: u32,
    /// Alignment of tensor data in bytes.
    pub alignment: u64,
    /// Absolute offset of the data section.
    pub data_offset: u64,
    /// The key-value metadata.
    pub metadata: BTreeMap<String, GgufValue>,
}

/// What a GGUF file holds.
#[derive(Clone, Debug)]
pub struct GgufFile {
    /// Header and metadata.
    pub header: GgufHeader,
    /// Tensors in file order.
    pub tensors: Vec<TensorStorage>,
}

struct Reader<'a> {
    cur: Cursor<'a>,
    ctx: Ctx<'a>,
}

impl Reader<'_> {
    fn string_bytes(&mut self) -> Result<Vec<u8>, FileError> {
        let n = self.cur.u64()?;
        self.cur.read_vec(n)
    }

    fn string(&mut self) -> Result<String, FileError> {
        let b = self.string_bytes()?;
        Ok(String::from_utf8(b)
            .unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned()))
    }

    fn count(&mut self, elem: GgufType, what: &str) -> Result<usize, FileError> {
        let n = self.cur.u64()?;
        match n.checked_mul(elem.min_size()) {
            Some(b) if b <= self.cur.remaining() => Ok(n as usize),
            _ => Err(self.ctx.malformed(format!(
                "{what}: {n} elements of type {elem:?} cannot fit in the {} bytes left",
                self.cur.remaining()
            ))),
        }
    }

    fn value(&mut self, ty: GgufType, depth: u32) -> Result<GgufValue, FileError> {
        use GgufValue as V;
        let c = &mut self.cur;
        Ok(match ty {
            GgufType::U8 => V::U8(c.u8()?),
            GgufType::I8 => V::I8(c.u8()? as i8),
            GgufType::U16 => V::U16(c.u16()?),
            GgufType::I16 => V::I16(c.u16()? as i16),
            GgufType::U32 => V::U32(c.u32()?),
            GgufType::I32 => V::I32(c.u32()? as i32),
            GgufType::F32 => V::F32(f32::from_bits(c.u32()?)),
            GgufType::Bool => V::Bool(c.u8()? != 0),
            GgufType::U64 => V::U64(c.u64()?),
            GgufType::I64 => V::I64(c.u64()? as i64),
            GgufType::F64 => V::F64(f64::from_bits(c.u64()?)),
            GgufType::String => V::String(self.string()?),
            GgufType::Array => V::Array(self.array(depth)?),
        })
    }

    fn array(&mut self, depth: u32) -> Result<GgufArray, FileError> {
        if depth >= MAX_ARRAY_DEPTH {
            return Err(self.ctx.malformed(format!(
                "metadata arrays nested deeper than {MAX_ARRAY_DEPTH}"
            )));
        }
        let id = self.cur.u32()?;
        let ty = GgufType::from_id(id).ok_or_else(|| {
            self.ctx
                .malformed(format!("unknown array element type {id}"))
        })?;
        let n = self.count(ty, "metadata array")?;
        macro_rules! prim {
            ($variant:ident, $read:expr) => {{
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push($read(&mut self.cur)?);
                }
                GgufArray::$variant(v)
            }};
        }
        Ok(match ty {
            GgufType::U8 => GgufArray::U8(self.cur.read_vec(n as u64)?),
            GgufType::I8 => GgufArray::I8(
                self.cur
                    .read_vec(n as u64)?
                    .into_iter()
                    .map(|b| b as i8)
                    .collect(),
            ),
            GgufType::U16 => prim!(U16, |c: &mut Cursor| c.u16()),
            GgufType::I16 => prim!(I16, |c: &mut Cursor| c.u16().map(|v| v as i16)),
            GgufType::U32 => prim!(U32, |c: &mut Cursor| c.u32()),
            GgufType::I32 => prim!(I32, |c: &mut Cursor| c.u32().map(|v| v as i32)),
            GgufType::F32 => prim!(F32, |c: &mut Cursor| c.u32().map(f32::from_bits)),
            GgufType::Bool => GgufArray::Bool(
                self.cur
                    .read_vec(n as u64)?
                    .into_iter()
                    .map(|b| b != 0)
                    .collect(),
            ),
            GgufType::U64 => prim!(U64, |c: &mut Cursor| c.u64()),
            GgufType::I64 => prim!(I64, |c: &mut Cursor| c.u64().map(|v| v as i64)),
            GgufType::F64 => prim!(F64, |c: &mut Cursor| c.u64().map(f64::from_bits)),
            GgufType::String => {
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.string()?);
                }
                GgufArray::String(v)
            }
            GgufType::Array => {
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.array(depth + 1)?);
                }
                GgufArray::Array(v)
            }
        })
    }
}

/// A tensor info before the data offset is known.
struct Info {
    name: String,
    shape: Vec<u64>,
    type_id: u32,
    offset: u64,
}

/// Reads the header, metadata and tensor infos of a GGUF file.
pub(crate) fn read(src: &dyn Source, ctx: Ctx, file: FileId) -> Result<GgufFile, FileError> {
    let len = src.len();
    let mut r = Reader {
        cur: Cursor::new(src, ctx, 0, len),
        ctx,
    };
    if &r.cur.array::<4>()? != MAGIC {
        return Err(ctx.malformed("missing GGUF magic"));
    }
    let version = r.cur.u32()?;
    match version {
        2 | 3 => {}
        1 => return Err(ctx.unsupported("GGUF version 1")),
        v if (1..=3).contains(&v.swap_bytes()) => return Err(ctx.unsupported("big-endian GGUF")),
        v => return Err(ctx.unsupported(format!("GGUF version {v}"))),
    }
    // Each tensor info takes at least 24 bytes, each key-value pair at least 13.
    let n_tensors = r.cur.u64()?;
    let n_kv = r.cur.u64()?;
    let fits = |n: u64, min: u64, left: u64| n.checked_mul(min).is_some_and(|b| b <= left);
    if !fits(n_kv, 13, r.cur.remaining()) {
        return Err(ctx.malformed(format!("{n_kv} key-value pairs cannot fit in the file")));
    }
    if !fits(n_tensors, 24, r.cur.remaining()) {
        return Err(ctx.malformed(format!("{n_tensors} tensor infos cannot fit in the file")));
    }

    let mut metadata = BTreeMap::new();
    for _ in 0..n_kv {
        let key = r.string()?;
        let id = r.cur.u32()?;
        let ty = GgufType::from_id(id).ok_or_else(|| {
            ctx.malformed(format!("metadata key `{key}` has unknown value type {id}"))
        })?;
        let value = r.value(ty, 0)?;
        if metadata.insert(key.clone(), value).is_some() {
            return Err(ctx.malformed(format!("metadata key `{key}` appears twice")));
        }
    }
    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(GgufValue::U32(a)) if a.is_power_of_two() => u64::from(*a),
        Some(other) => {
            return Err(ctx.malformed(format!(
                "`general.alignment` must be a u32 power of two, not {other:?}"
            )))
        }
    };

    let mut infos = Vec::with_capacity(n_tensors as usize);
    for _ in 0..n_tensors {
        let name_bytes = r.string_bytes()?;
        let name = String::from_utf8(name_bytes).map_err(|e| {
            ctx.malformed(format!(
                "tensor name {:?} is not UTF-8",
                String::from_utf8_lossy(e.as_bytes())
            ))
        })?;
        let n_dims = r.cur.u32()?;
        if n_dims > MAX_DIMS {
            return Err(ctx.bad_tensor(&name, format!("{n_dims} dimensions (at most {MAX_DIMS})")));
        }
        let mut ne = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            let d = r.cur.u64()?;
            if d > i64::MAX as u64 {
                return Err(ctx.bad_tensor(&name, format!("negative dimension {}", d as i64)));
            }
            ne.push(d);
        }
        let type_id = r.cur.u32()?;
        let offset = r.cur.u64()?;
        ne.reverse();
        infos.push(Info {
            name,
            shape: ne,
            type_id,
            offset,
        });
    }
    check_unique(&ctx, infos.iter().map(|i| i.name.as_str()))?;

    let end_of_infos = r.cur.pos();
    let data_offset = end_of_infos
        .checked_next_multiple_of(alignment)
        .ok_or_else(|| ctx.malformed("data offset overflows"))?;
    let data_len = len.saturating_sub(data_offset);

    let mut tensors = Vec::with_capacity(infos.len());
    let mut spans = Vec::with_capacity(infos.len());
    for info in infos {
        let name = info.name;
        let dtype = DType::from_ggml(info.type_id as _).ok_or(FileError::UnknownGgmlType {
            path: ctx.p(),
            tensor: name.clone(),
            type_id: info.type_id,
        })?;
        if info.offset % alignment != 0 {
            return Err(ctx.bad_tensor(
                &name,
                format!(
                    "offset {} is not a multiple of the alignment {alignment}",
                    info.offset
                ),
            ));
        }
        let size = byte_size(&ctx, &name, dtype, &info.shape)?;
        check_bounds(&ctx, &name, info.offset, size, data_len)?;
        let offset = data_offset + info.offset;
        spans.push(Span {
            start: offset,
            end: offset + size,
            name: name.clone(),
        });
        tensors.push(TensorStorage {
            name,
            dtype,
            shape: info.shape,
            file,
            offset,
            size,
        });
    }
    check_overlaps(&ctx, spans)?;
    Ok(GgufFile {
        header: GgufHeader {
            version,
            alignment,
            data_offset,
            metadata,
        },
        tensors,
    })
}
