//! Sharded safetensors: a `*.safetensors.index.json` whose `weight_map` maps each tensor name
//! to the shard file (in the same directory) that holds it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::error::{Ctx, FileError};

/// Largest index file read.
pub const MAX_INDEX_LEN: u64 = 100_000_000;

/// A parsed shard index.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ShardIndex {
    /// Tensor name -> shard file name.
    pub weight_map: BTreeMap<String, String>,
    /// The `metadata` object, if any.
    pub metadata: BTreeMap<String, Value>,
}

impl ShardIndex {
    /// Distinct shard file names, sorted.
    pub fn shards(&self) -> Vec<&str> {
        let mut v: Vec<&str> = self.weight_map.values().map(String::as_str).collect();
        v.sort_unstable();
        v.dedup();
        v
    }
}

/// Whether `path` names a shard index (`*.index.json`).
pub fn is_index_path(path: &Path) -> bool {
    path.file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.ends_with(".index.json"))
}

/// Parses an index from its bytes; `path` is used in messages.
pub fn parse_index(bytes: &[u8], path: &Path) -> Result<ShardIndex, FileError> {
    let ctx = Ctx::new(path);
    let v: Value = serde_json::from_slice(bytes)
        .map_err(|e| ctx.malformed(format!("shard index JSON: {e}")))?;
    let obj = v
        .as_object()
        .ok_or_else(|| ctx.malformed("shard index is not a JSON object"))?;
    let map = obj
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or_else(|| ctx.malformed("shard index has no `weight_map` object"))?;
    let mut weight_map = BTreeMap::new();
    for (name, shard) in map {
        let shard = shard
            .as_str()
            .ok_or_else(|| ctx.bad_tensor(name, "shard file name is not a string"))?;
        let plain = !shard.is_empty()
            && !shard.contains(['/', '\\'])
            && shard != "."
            && shard != ".."
            && !shard.contains('\0');
        if !plain {
            return Err(ctx.bad_tensor(name, format!("shard `{shard}` is not a plain file name")));
        }
        weight_map.insert(name.clone(), shard.to_string());
    }
    let metadata = obj
        .get("metadata")
        .and_then(Value::as_object)
        .map(|m| m.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
        .unwrap_or_default();
    Ok(ShardIndex {
        weight_map,
        metadata,
    })
}

/// Reads an index file.
pub fn read_index(path: &Path) -> Result<ShardIndex, FileError> {
    let ctx = Ctx::new(path);
    let len = std::fs::metadata(path).map_err(|e| ctx.io(e))?.len();
    if len > MAX_INDEX_LEN {
        return Err(FileError::HeaderTooLarge {
            path: path.to_path_buf(),
            len,
            limit: MAX_INDEX_LEN,
        });
    }
    let bytes = std::fs::read(path).map_err(|e| ctx.io(e))?;
    parse_index(&bytes, path)
}

/// The path of a shard named in the index at `index_path`.
pub fn shard_path(index_path: &Path, shard: &str) -> PathBuf {
    index_path
        .parent()
        .unwrap_or_else(|| Path::new(""))
        .join(shard)
}
