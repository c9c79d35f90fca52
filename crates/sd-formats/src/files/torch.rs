//! PyTorch checkpoints (`.ckpt`, `.pt`, `.pth`, `.bin`): the zip format of `torch.save` and
//! the legacy format of `_use_new_zipfile_serialization=False`.
//!
//! **Zip format**: `<top>/data.pkl` is the pickled object, whose persistent ids name storages
//! stored as `<top>/data/<key>`; `<top>` is whatever name the file was saved under. Storage
//! entries must be stored uncompressed so that tensor bytes are plain file ranges.
//!
//! **Legacy format**: five pickles in a row (magic number, protocol version 1001, system info,
//! the object, the list of storage keys), then for each key an element count (u64 little
//! endian) followed by the storage's bytes.
//!
//! # Tensor names
//! The pickled object is usually a dict (a state dict). Names are the dict keys along the
//! path to each tensor, joined with `.`, with these rules:
//! - if the top-level dict has a `state_dict` entry holding a dict (Lightning checkpoints),
//!   only that dict is read; otherwise, if it has `params_ema` (BasicSR/ESRGAN upscalers) or
//!   else `params`, only that one is read; otherwise the whole object is read;
//! - a key `state_dict` deeper down adds nothing to the path;
//! - list and tuple items use their index; non-string dict keys use their integer value, other
//!   keys are skipped; a key set twice keeps its later value;
//! - a container reachable twice (through the pickle memo) is read once, at its first path;
//! - two tensors ending up with the same name are an error.
//!
//! Only contiguous tensors are supported; tensors viewing the same storage may overlap.

use std::collections::{HashMap, HashSet};
use std::io::{BufReader, Read};

use sd_tensor::DType;
use zip::CompressionMethod;

use super::error::{Ctx, FileError};
use super::layout::{byte_size, check_overlaps, check_unique, numel, Span};
use super::pickle::{
    self, GlobalPolicy, ObjId, Object, PickleOptions, Pickled, StorageRef, TensorRef, Value,
};
use super::source::{Cursor, Source, SourceReader};
use crate::{FileId, TensorStorage};

/// The legacy format's magic number, the first pickle of the file.
pub const LEGACY_MAGIC: i128 = 0x1950a86a20f9469cfc6c;
/// The legacy format's protocol version, the second pickle.
pub const LEGACY_PROTOCOL: i128 = 1001;
/// Largest `data.pkl` read (it is read into memory).
pub const MAX_PICKLE_LEN: u64 = 1 << 30;
/// Deepest dict/list nesting searched for tensors.
const MAX_DEPTH: usize = 64;

/// One zip entry's location.
#[derive(Clone, Debug)]
struct Entry {
    index: usize,
    start: u64,
    size: u64,
    uncompressed: u64,
    method: CompressionMethod,
    encrypted: bool,
}

/// Where a storage's bytes are in the file.
#[derive(Clone, Copy, Debug)]
struct Placed {
    /// Offset of element 0.
    start: u64,
    /// Bytes available from `start`.
    bytes: u64,
}

fn zip_err(ctx: &Ctx, e: zip::result::ZipError) -> FileError {
    FileError::Zip {
        path: ctx.p(),
        detail: e.to_string(),
    }
}

/// Reads a zip-format PyTorch file.
pub(crate) fn read_zip(
    src: &dyn Source,
    ctx: Ctx,
    file: FileId,
    globals: GlobalPolicy,
) -> Result<Vec<TensorStorage>, FileError> {
    let len = src.len();
    let mut za = zip::ZipArchive::new(BufReader::new(SourceReader::new(src)))
        .map_err(|e| zip_err(&ctx, e))?;
    let mut entries: HashMap<String, Entry> = HashMap::with_capacity(za.len());
    for index in 0..za.len() {
        let f = za.by_index_raw(index).map_err(|e| zip_err(&ctx, e))?;
        let e = Entry {
            index,
            start: f.data_start(),
            size: f.compressed_size(),
            uncompressed: f.size(),
            method: f.compression(),
            encrypted: f.encrypted(),
        };
        entries.insert(f.name().to_string(), e);
    }
    let mut tops = entries
        .keys()
        .filter_map(|n| n.strip_suffix("/data.pkl"))
        .filter(|t| !t.is_empty() && !t.contains('/'));
    let top = match (tops.next(), tops.next()) {
        (Some(t), None) => t.to_string(),
        (None, _) => {
            return Err(
                ctx.malformed("zip has no `<name>/data.pkl` entry: not a PyTorch checkpoint")
            )
        }
        (Some(a), Some(b)) => {
            return Err(ctx.malformed(format!(
                "zip has two pickles, `{a}/data.pkl` and `{b}/data.pkl`"
            )))
        }
    };

    if let Some(e) = entries.get(&format!("{top}/byteorder")) {
        let b = read_entry(src, &ctx, &mut za, &format!("{top}/byteorder"), e, 64)?;
        if b.trim_ascii() != b"little" {
            return Err(ctx.unsupported(format!("byte order {:?}", String::from_utf8_lossy(&b))));
        }
    }
    let pkl_name = format!("{top}/data.pkl");
    let pkl = read_entry(
        src,
        &ctx,
        &mut za,
        &pkl_name,
        &entries[&pkl_name],
        MAX_PICKLE_LEN,
    )?;
    drop(za);

    let pctx = ctx;
    let mut cur = Cursor::new(&pkl, pctx, 0, pkl.len() as u64);
    let pickled = pickle::run(
        &mut cur,
        pctx,
        PickleOptions {
            globals,
            persistent: true,
        },
    )?;

    let found = flatten(&pickled, &ctx)?;
    let mut placed: HashMap<String, Placed> = HashMap::new();
    for (name, t) in &found {
        let s = storage_of(&pickled, t, &ctx, name)?;
        if placed.contains_key(&s.key) {
            continue;
        }
        let entry_name = format!("{top}/data/{}", s.key);
        let e = entries.get(&entry_name).ok_or_else(|| {
            ctx.bad_tensor(
                name,
                format!("storage `{}` has no zip entry `{entry_name}`", s.key),
            )
        })?;
        if e.encrypted || e.method != CompressionMethod::Stored {
            let method = if e.encrypted {
                "encrypted".to_string()
            } else {
                format!("compressed ({})", e.method)
            };
            return Err(FileError::CompressedEntry {
                path: ctx.p(),
                entry: entry_name,
                method,
            });
        }
        if e.size != e.uncompressed {
            return Err(ctx.malformed(format!(
                "stored entry `{entry_name}` has different sizes {} and {}",
                e.size, e.uncompressed
            )));
        }
        super::layout::check_bounds(&ctx, name, e.start, e.size, len)?;
        placed.insert(
            s.key.clone(),
            Placed {
                start: e.start,
                bytes: e.size,
            },
        );
    }
    place_all(&pickled, &found, &placed, &ctx, file)
}

/// Reads a small entry (stored or deflated) into memory, at most `limit` bytes.
fn read_entry<R: std::io::Read + std::io::Seek>(
    src: &dyn Source,
    ctx: &Ctx,
    za: &mut zip::ZipArchive<R>,
    name: &str,
    e: &Entry,
    limit: u64,
) -> Result<Vec<u8>, FileError> {
    if e.encrypted {
        return Err(FileError::CompressedEntry {
            path: ctx.p(),
            entry: name.to_string(),
            method: "encrypted".into(),
        });
    }
    match e.method {
        CompressionMethod::Stored => {
            if e.size > limit {
                return Err(FileError::HeaderTooLarge {
                    path: ctx.p(),
                    len: e.size,
                    limit,
                });
            }
            let end = e.start.checked_add(e.size).filter(|&end| end <= src.len());
            if end.is_none() {
                return Err(ctx.truncated(e.start, e.start.saturating_add(e.size), src.len()));
            }
            let mut v = vec![0u8; e.size as usize];
            src.read_at(e.start, &mut v).map_err(|err| ctx.io(err))?;
            Ok(v)
        }
        CompressionMethod::Deflated => {
            let f = za.by_index(e.index).map_err(|err| zip_err(ctx, err))?;
            let mut v = Vec::new();
            f.take(limit + 1)
                .read_to_end(&mut v)
                .map_err(|err| FileError::Zip {
                    path: ctx.p(),
                    detail: format!("`{name}`: {err}"),
                })?;
            if v.len() as u64 > limit {
                return Err(FileError::HeaderTooLarge {
                    path: ctx.p(),
                    len: v.len() as u64,
                    limit,
                });
            }
            Ok(v)
        }
        other => Err(FileError::CompressedEntry {
            path: ctx.p(),
            entry: name.to_string(),
            method: format!("compressed ({other})"),
        }),
    }
}

/// Reads a legacy-format PyTorch file.
pub(crate) fn read_legacy(
    src: &dyn Source,
    ctx: Ctx,
    file: FileId,
    globals: GlobalPolicy,
) -> Result<Vec<TensorStorage>, FileError> {
    let len = src.len();
    let mut cur = Cursor::new(src, ctx, 0, len);
    let plain = PickleOptions {
        globals: GlobalPolicy::Strict,
        persistent: false,
    };

    let magic = pickle::run(&mut cur, ctx, plain)?;
    if magic.root != Some(Value::Int(LEGACY_MAGIC)) {
        return Err(ctx.malformed("not a legacy PyTorch file: wrong magic number"));
    }
    let proto = pickle::run(&mut cur, ctx, plain)?;
    match proto.root {
        Some(Value::Int(LEGACY_PROTOCOL)) => {}
        other => return Err(ctx.unsupported(format!("legacy PyTorch protocol {other:?}"))),
    }
    let sys_info = pickle::run(&mut cur, ctx, plain)?;
    if let Some(Object::Dict(d)) = sys_info.root.as_ref().and_then(|r| sys_info.deref(r)) {
        let big = d.iter().any(|(k, v)| {
            matches!(k, Value::Str(s) if &**s == "little_endian") && *v == Value::Bool(false)
        });
        if big {
            return Err(ctx.unsupported("big-endian legacy PyTorch file"));
        }
    }
    let pickled = pickle::run(
        &mut cur,
        ctx,
        PickleOptions {
            globals,
            persistent: true,
        },
    )?;
    let keys = pickle::run(&mut cur, ctx, plain)?;
    let key_list = match keys.root.as_ref().and_then(|r| keys.deref(r)) {
        Some(Object::List(l)) | Some(Object::Tuple(l)) => l
            .iter()
            .map(|k| match k {
                Value::Str(s) => Ok(s.to_string()),
                _ => Err(ctx.malformed("legacy storage key is not a string")),
            })
            .collect::<Result<Vec<_>, _>>()?,
        _ => return Err(ctx.malformed("legacy storage key list is not a list")),
    };

    // Element sizes of the storages, from the persistent ids of the main pickle.
    let mut elsize: HashMap<&str, u64> = HashMap::new();
    for o in &pickled.objects {
        if let Object::Storage(s) = o {
            if let Some(prev) = elsize.insert(&s.key, s.kind.elsize) {
                if prev != s.kind.elsize {
                    return Err(ctx.malformed(format!("storage `{}` has two element types", s.key)));
                }
            }
        }
    }
    let mut placed: HashMap<String, Placed> = HashMap::new();
    for key in key_list {
        let count = cur.u64()?;
        let size = elsize
            .get(key.as_str())
            .ok_or_else(|| ctx.malformed(format!("storage `{key}` is listed but never used")))?;
        let bytes = count
            .checked_mul(*size)
            .ok_or_else(|| ctx.malformed(format!("storage `{key}` size overflows")))?;
        let start = cur.pos();
        cur.skip(bytes)?;
        if placed
            .insert(key.clone(), Placed { start, bytes })
            .is_some()
        {
            return Err(ctx.malformed(format!("storage `{key}` is listed twice")));
        }
    }
    let found = flatten(&pickled, &ctx)?;
    place_all(&pickled, &found, &placed, &ctx, file)
}

fn storage_of<'p>(
    p: &'p Pickled,
    t: &TensorRef,
    ctx: &Ctx,
    name: &str,
) -> Result<&'p StorageRef, FileError> {
    match p.obj(t.storage) {
        Some(Object::Storage(s)) => Ok(s),
        _ => Err(ctx.bad_tensor(name, "tensor without a storage")),
    }
}

/// Turns found tensors into storages with absolute offsets, checking every bound.
fn place_all(
    p: &Pickled,
    found: &[(String, &TensorRef)],
    placed: &HashMap<String, Placed>,
    ctx: &Ctx,
    file: FileId,
) -> Result<Vec<TensorStorage>, FileError> {
    check_unique(ctx, found.iter().map(|(n, _)| n.as_str()))?;
    let mut out = Vec::with_capacity(found.len());
    let mut spans: HashMap<&str, Span> = HashMap::new();
    for (name, t) in found {
        let s = storage_of(p, t, ctx, name)?;
        let pl = placed.get(&s.key).ok_or_else(|| {
            ctx.bad_tensor(name, format!("storage `{}` is not in the file", s.key))
        })?;
        out.push(place(ctx, name, t, s, *pl, file)?);
        spans.entry(&s.key).or_insert_with(|| Span {
            start: pl.start,
            end: pl.start + pl.bytes,
            name: name.clone(),
        });
    }
    check_overlaps(ctx, spans.into_values().collect())?;
    Ok(out)
}

/// Whether `stride` is the row-major stride of `shape` (size-1 dimensions may have any).
fn contiguous(shape: &[u64], stride: &[u64]) -> bool {
    if shape.contains(&0) {
        return true;
    }
    let mut expected = 1u64;
    for (&d, &s) in shape.iter().zip(stride).rev() {
        if d != 1 && s != expected {
            return false;
        }
        expected = expected.saturating_mul(d);
    }
    true
}

fn place(
    ctx: &Ctx,
    name: &str,
    t: &TensorRef,
    s: &StorageRef,
    pl: Placed,
    file: FileId,
) -> Result<TensorStorage, FileError> {
    let dtype: DType = s
        .kind
        .dtype
        .ok_or_else(|| ctx.unsupported_dtype(name, s.kind.name))?;
    if t.shape.len() != t.stride.len() {
        return Err(ctx.bad_tensor(
            name,
            format!(
                "shape {:?} and stride {:?} differ in length",
                t.shape, t.stride
            ),
        ));
    }
    let n = numel(ctx, name, &t.shape)?;
    if !contiguous(&t.shape, &t.stride) {
        return Err(FileError::NonContiguous {
            path: ctx.p(),
            tensor: name.to_string(),
            shape: t.shape.clone(),
            stride: t.stride.clone(),
        });
    }
    let elsize = s.kind.elsize;
    // Elements of the root storage present in the file.
    let root_numel = s.numel.min(pl.bytes / elsize);
    let (view_off, view_numel) = s.view.unwrap_or((0, s.numel));
    let outside = |what: String| ctx.bad_tensor(name, what);
    if view_off
        .checked_add(view_numel)
        .is_none_or(|e| e > root_numel)
    {
        return Err(outside(format!("storage view {view_off}+{view_numel} exceeds the {root_numel} elements of storage `{}`", s.key)));
    }
    if t.offset.checked_add(n).is_none_or(|e| e > view_numel) {
        return Err(outside(format!(
            "elements {}..{}+{n} exceed the {view_numel} elements of storage `{}`",
            t.offset, t.offset, s.key
        )));
    }
    let size = byte_size(ctx, name, dtype, &t.shape)?;
    // In range: (view_off + offset + n) * elsize <= pl.bytes, so none of this overflows.
    let offset = pl.start + (view_off + t.offset) * elsize;
    Ok(TensorStorage {
        name: name.to_string(),
        dtype,
        shape: t.shape.clone(),
        file,
        offset,
        size,
    })
}

/// The dict key as a name component.
fn key_str(k: &Value) -> Option<String> {
    match k {
        Value::Str(s) => Some(s.to_string()),
        Value::Int(i) => Some(i.to_string()),
        _ => None,
    }
}

/// The value of the last entry with string key `key` in a dict.
fn dict_get<'a>(d: &'a [(Value, Value)], key: &str) -> Option<&'a Value> {
    d.iter()
        .rev()
        .find(|(k, _)| matches!(k, Value::Str(s) if &**s == key))
        .map(|(_, v)| v)
}

/// Finds every tensor with its name (see the module docs for the rules).
fn flatten<'p>(p: &'p Pickled, ctx: &Ctx) -> Result<Vec<(String, &'p TensorRef)>, FileError> {
    let root = p
        .root
        .as_ref()
        .ok_or_else(|| ctx.malformed("empty pickle"))?;
    let mut start = root;
    if let Some(Object::Dict(d)) = p.deref(root) {
        for key in ["state_dict", "params_ema", "params"] {
            if let Some(v) = dict_get(d, key) {
                if matches!(p.deref(v), Some(Object::Dict(_))) {
                    start = v;
                    break;
                }
            }
        }
    }
    if matches!(p.deref(start), Some(Object::Tensor(_))) {
        return Err(ctx.malformed("the file holds a single tensor, not a dict of named tensors"));
    }
    let mut out = Vec::new();
    let mut seen = HashSet::new();
    walk(p, ctx, start, String::new(), 0, &mut seen, &mut out)?;
    Ok(out)
}

fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_string()
    } else {
        format!("{path}.{key}")
    }
}

fn walk<'p>(
    p: &'p Pickled,
    ctx: &Ctx,
    v: &'p Value,
    path: String,
    depth: usize,
    seen: &mut HashSet<ObjId>,
    out: &mut Vec<(String, &'p TensorRef)>,
) -> Result<(), FileError> {
    let Value::Obj(id) = v else { return Ok(()) };
    let Some(obj) = p.obj(*id) else { return Ok(()) };
    if let Object::Tensor(t) = obj {
        out.push((path, t));
        return Ok(());
    }
    if !matches!(obj, Object::Dict(_) | Object::List(_) | Object::Tuple(_)) || !seen.insert(*id) {
        return Ok(());
    }
    if depth >= MAX_DEPTH {
        return Err(ctx.malformed(format!(
            "objects nested deeper than {MAX_DEPTH} levels at `{path}`"
        )));
    }
    match obj {
        Object::Dict(d) => {
            let mut last: HashMap<String, usize> = HashMap::with_capacity(d.len());
            let keys: Vec<Option<String>> = d.iter().map(|(k, _)| key_str(k)).collect();
            for (i, k) in keys.iter().enumerate() {
                if let Some(k) = k {
                    last.insert(k.clone(), i);
                }
            }
            for (i, ((_, child), k)) in d.iter().zip(keys).enumerate() {
                let Some(k) = k else { continue };
                if last.get(&k) != Some(&i) {
                    continue;
                }
                let child_path = if k == "state_dict" {
                    path.clone()
                } else {
                    join(&path, &k)
                };
                walk(p, ctx, child, child_path, depth + 1, seen, out)?;
            }
        }
        Object::List(items) | Object::Tuple(items) => {
            for (i, child) in items.iter().enumerate() {
                walk(
                    p,
                    ctx,
                    child,
                    join(&path, &i.to_string()),
                    depth + 1,
                    seen,
                    out,
                )?;
            }
        }
        _ => {}
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contiguity() {
        assert!(contiguous(&[2, 3], &[3, 1]));
        assert!(!contiguous(&[2, 3], &[1, 2]));
        assert!(contiguous(&[1, 3], &[100, 1]));
        assert!(contiguous(&[0, 3], &[7, 7]));
        assert!(contiguous(&[], &[]));
    }
}
