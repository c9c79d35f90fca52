//! The cut cache: cut outputs (and final outputs) kept between segments.
//!
//! Each entry is a tensor with exactly the layout (type, dimensions, strides) of the cut it
//! holds, in its own context and its own buffer of the cache's buffer type. Later segments
//! read it directly as a source, so a strided cut (a transposed view, say) keeps the layout
//! the consuming ops expect.

use std::collections::HashMap;

use sd_tensor::ggml::{Backend, Buffer, BufferType, Context, GTensor};

use crate::error::{ggml, GraphCutError, Result};
use crate::marks::CutName;

struct Entry {
    tensor: GTensor,
    buffer: Buffer,
}

/// Cut outputs by cut name, each in its own buffer.
pub struct CutCache {
    buft: BufferType,
    entries: HashMap<CutName, Entry>,
}

impl std::fmt::Debug for CutCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut names: Vec<String> = self.entries.keys().map(|k| k.to_string()).collect();
        names.sort();
        f.debug_struct("CutCache")
            .field("buffer_type", &self.buft.name())
            .field("entries", &names)
            .field("bytes", &self.bytes())
            .finish()
    }
}

impl CutCache {
    /// An empty cache allocating from `buft` (a backend's buffer type, or host memory).
    pub fn new(buft: BufferType) -> CutCache {
        CutCache {
            buft,
            entries: HashMap::new(),
        }
    }

    /// An empty cache in host memory.
    pub fn host() -> CutCache {
        CutCache::new(BufferType::cpu())
    }

    /// The buffer type entries are allocated from.
    pub fn buffer_type(&self) -> BufferType {
        self.buft
    }

    /// The entry for `name` with `like`'s type and shape, allocated unless one with that
    /// layout exists: `like`'s strides too, or (`contiguous`) a contiguous tensor.
    fn entry_like(&mut self, name: &CutName, like: &GTensor, contiguous: bool) -> Result<&Entry> {
        let reusable = self.entries.get(name).is_some_and(|e| {
            e.tensor.type_code() == like.type_code()
                && e.tensor.ne() == like.ne()
                && (contiguous || e.tensor.nb() == like.nb())
        });
        if !reusable {
            self.entries.remove(name);
            let ctx = Context::new_descriptors(1, 1, 0)
                .map_err(ggml(format!("cut cache entry '{name}'")))?;
            let tensor = if contiguous {
                let dtype = like.dtype().ok_or_else(|| GraphCutError::InvalidGraph {
                    node: format!("cache entry '{name}'"),
                    detail: format!("unsupported tensor type {}", like.type_code()),
                })?;
                let t = ctx.new_tensor(dtype, &like.ne());
                t.inspect(|t| {
                    t.set_name(&like.name());
                })
            } else {
                ctx.new_tensor_like(like)
            }
            .map_err(ggml(format!("cut cache entry '{name}'")))?;
            let buffer = self
                .buft
                .alloc_context_tensors(&ctx)
                .map_err(ggml(format!("allocating cut cache entry '{name}'")))?;
            self.entries.insert(name.clone(), Entry { tensor, buffer });
        }
        Ok(&self.entries[name])
    }

    /// Stores a copy of `src`'s data under `name`, with `src`'s layout. An entry of the same
    /// name and layout is overwritten in place; otherwise a new buffer is allocated.
    pub fn store(&mut self, name: &CutName, src: &GTensor) -> Result<()> {
        let _span =
            tracing::trace_span!("cut_cache_store", cut = %name, bytes = src.nbytes()).entered();
        let e = self.entry_like(name, src, false)?;
        Backend::copy_tensor(src, &e.tensor)
            .map_err(ggml(format!("copying cut '{name}' into the cut cache")))
    }

    /// Makes `t` (a segment graph's output, not yet allocated) live in the entry for `name`
    /// (allocated, or reused when the layout matches), so that computing the graph writes the
    /// cut straight into the cache and no copy is needed afterwards. Returns `false`, doing
    /// nothing, when `t` cannot be placed (a view, or a tensor that already has memory); the
    /// caller then [`store`](Self::store)s a copy after computing.
    pub fn bind_output(&mut self, name: &CutName, t: &GTensor) -> Result<bool> {
        if t.view_src().is_some() || t.is_allocated() {
            return Ok(false);
        }
        let e = self.entry_like(name, t, false)?;
        if e.tensor.nb() != t.nb() || e.buffer.alloc_size(t) > e.buffer.size() {
            return Ok(false);
        }
        e.buffer
            .place(t, 0)
            .map_err(ggml(format!("placing cut '{name}' in the cut cache")))?;
        Ok(true)
    }

    /// Whether `t` (a segment graph's output placed by [`bind_output`](Self::bind_output)
    /// in an earlier execution) still lives in the entry for `name`.
    pub fn holds_output(&self, name: &CutName, t: &GTensor) -> bool {
        self.entries.get(name).is_some_and(|e| {
            e.tensor.same_data(t)
                && e.tensor.type_code() == t.type_code()
                && e.tensor.ne() == t.ne()
                && e.tensor.nb() == t.nb()
        })
    }

    /// Stores host `bytes` (exactly `like.nbytes()`, in its layout) under `name`, in an
    /// entry with `like`'s type and shape (reused when the layout matches).
    pub fn store_bytes(&mut self, name: &CutName, like: &GTensor, bytes: &[u8]) -> Result<()> {
        if bytes.len() != like.nbytes() {
            return Err(GraphCutError::InvalidGraph {
                node: format!("cache entry '{name}'"),
                detail: format!(
                    "{} host bytes for a tensor of {} bytes",
                    bytes.len(),
                    like.nbytes()
                ),
            });
        }
        self.entry_like(name, like, true)?
            .tensor
            .write_bytes(0, bytes)
            .map_err(ggml(format!("writing cache entry '{name}'")))
    }

    /// The cached tensor of a cut.
    pub fn get(&self, name: &CutName) -> Option<&GTensor> {
        self.entries.get(name).map(|e| &e.tensor)
    }

    /// Whether a cut is cached.
    pub fn contains(&self, name: &CutName) -> bool {
        self.entries.contains_key(name)
    }

    /// The cached cut names (unordered).
    pub fn names(&self) -> impl Iterator<Item = &CutName> + '_ {
        self.entries.keys()
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether the cache is empty.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Bytes of all entry buffers.
    pub fn bytes(&self) -> usize {
        self.entries
            .values()
            .map(|e| e.buffer.footprint() as usize)
            .sum()
    }

    /// Keeps only the entries `keep` accepts (their buffers are freed).
    pub fn retain(&mut self, mut keep: impl FnMut(&CutName) -> bool) {
        self.entries.retain(|k, _| keep(k));
    }

    /// Removes an entry.
    pub fn remove(&mut self, name: &CutName) {
        self.entries.remove(name);
    }

    /// Drops every entry.
    pub fn clear(&mut self) {
        self.entries.clear();
    }
}
