//! safetensors: an 8-byte little-endian header length, a JSON header, then the data section.
//!
//! Each header entry is `name: {"dtype": "F16", "shape": [..], "data_offsets": [begin, end]}`
//! with offsets relative to the data section; `__metadata__` holds string pairs. Absolute
//! offsets are `8 + header_len + begin`.

use std::collections::BTreeMap;
use std::fmt;

use sd_tensor::DType;
use serde::de::{Deserialize, Deserializer, MapAccess, Visitor};
use serde_json::Value;

use super::error::{Ctx, FileError};
use super::layout::{byte_size, check_bounds, check_overlaps, Span};
use super::source::{Cursor, Source};
use crate::{FileId, TensorStorage};

/// Largest header accepted (the reference implementation's limit).
pub const MAX_HEADER_LEN: u64 = 100_000_000;

/// What a safetensors file holds.
#[derive(Clone, Debug, Default)]
pub struct SafetensorsFile {
    /// Tensors in header order.
    pub tensors: Vec<TensorStorage>,
    /// The `__metadata__` pairs (non-string values are kept as their JSON text).
    pub metadata: BTreeMap<String, String>,
}

/// Maps a safetensors dtype name (`F16`, ...) to a [`DType`]; `None` for names sd-rs does not
/// read (`U8`, `BOOL`, `F8_E4M3`, ...) and unknown names.
pub fn dtype_from_name(name: &str) -> Option<DType> {
    Some(match name {
        "F32" => DType::F32,
        "F16" => DType::F16,
        "BF16" => DType::BF16,
        "F64" => DType::F64,
        "I8" => DType::I8,
        "I16" => DType::I16,
        "I32" => DType::I32,
        "I64" => DType::I64,
        _ => return None,
    })
}

/// JSON object entries in file order, keeping duplicates (so they can be rejected).
struct Entries(Vec<(String, Value)>);

impl<'de> Deserialize<'de> for Entries {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Entries;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<Entries, A::Error> {
                let mut v = Vec::new();
                while let Some((k, val)) = m.next_entry::<String, Value>()? {
                    v.push((k, val));
                }
                Ok(Entries(v))
            }
        }
        d.deserialize_map(V)
    }
}

/// Reads the header of a safetensors file.
pub(crate) fn read(src: &dyn Source, ctx: Ctx, file: FileId) -> Result<SafetensorsFile, FileError> {
    let len = src.len();
    let mut cur = Cursor::new(src, ctx, 0, len);
    let header_len = cur.u64()?;
    if header_len > MAX_HEADER_LEN {
        return Err(FileError::HeaderTooLarge {
            path: ctx.p(),
            len: header_len,
            limit: MAX_HEADER_LEN,
        });
    }
    let header = cur.read_vec(header_len)?;
    let data_start = cur.pos();
    let data_len = len - data_start;
    let Entries(entries) = serde_json::from_slice(&header)
        .map_err(|e| ctx.malformed(format!("safetensors JSON header: {e}")))?;

    let mut out = SafetensorsFile::default();
    let mut seen = std::collections::HashSet::new();
    let mut spans = Vec::with_capacity(entries.len());
    for (name, value) in entries {
        if !seen.insert(name.clone()) {
            return Err(ctx.duplicate(&name));
        }
        if name == "__metadata__" {
            out.metadata = metadata(&ctx, value)?;
            continue;
        }
        let t = tensor(&ctx, &name, &value, file, data_start, data_len)?;
        spans.push(Span {
            start: t.offset,
            end: t.offset + t.size,
            name: name.clone(),
        });
        out.tensors.push(t);
    }
    check_overlaps(&ctx, spans)?;
    Ok(out)
}

fn metadata(ctx: &Ctx, value: Value) -> Result<BTreeMap<String, String>, FileError> {
    let Value::Object(map) = value else {
        return Err(ctx.malformed("`__metadata__` is not a JSON object"));
    };
    Ok(map
        .into_iter()
        .map(|(k, v)| match v {
            Value::String(s) => (k, s),
            other => (k, other.to_string()),
        })
        .collect())
}

fn tensor(
    ctx: &Ctx,
    name: &str,
    value: &Value,
    file: FileId,
    data_start: u64,
    data_len: u64,
) -> Result<TensorStorage, FileError> {
    let obj = value
        .as_object()
        .ok_or_else(|| ctx.bad_tensor(name, "header entry is not a JSON object"))?;
    let dtype_name = obj
        .get("dtype")
        .and_then(Value::as_str)
        .ok_or_else(|| ctx.bad_tensor(name, "missing or non-string `dtype`"))?;
    let shape = obj
        .get("shape")
        .and_then(Value::as_array)
        .ok_or_else(|| ctx.bad_tensor(name, "missing or non-array `shape`"))?
        .iter()
        .map(|d| {
            d.as_u64().ok_or_else(|| {
                ctx.bad_tensor(name, format!("dimension {d} is not a non-negative integer"))
            })
        })
        .collect::<Result<Vec<u64>, _>>()?;
    let offsets = obj
        .get("data_offsets")
        .and_then(Value::as_array)
        .ok_or_else(|| ctx.bad_tensor(name, "missing or non-array `data_offsets`"))?;
    let (begin, end) = match offsets.as_slice() {
        [b, e] => match (b.as_u64(), e.as_u64()) {
            (Some(b), Some(e)) if b <= e => (b, e),
            _ => return Err(ctx.bad_tensor(name, format!("invalid `data_offsets` {offsets:?}"))),
        },
        _ => return Err(ctx.bad_tensor(name, "`data_offsets` must have two entries")),
    };
    let dtype =
        dtype_from_name(dtype_name).ok_or_else(|| ctx.unsupported_dtype(name, dtype_name))?;
    let expected = byte_size(ctx, name, dtype, &shape)?;
    let size = end - begin;
    if size != expected {
        return Err(FileError::SizeMismatch {
            path: ctx.p(),
            tensor: name.to_string(),
            dtype,
            shape,
            expected,
            actual: size,
        });
    }
    check_bounds(ctx, name, begin, size, data_len)?;
    Ok(TensorStorage {
        name: name.to_string(),
        dtype,
        shape,
        file,
        offset: data_start + begin,
        size,
    })
}
