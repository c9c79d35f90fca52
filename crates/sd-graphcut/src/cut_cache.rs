//! The cut cache: cut outputs (and final outputs) kept between segments.
//!
//! Each entry is a tensor with exactly the layout (type, dimensions, strides) of the cut it
//! holds, in its own context and its own buffer of the cache's buffer type. Later segments
//! read it directly as a source, so a strided cut (a transposed view, say) keeps the layout
//! the consuming ops expect.
//!
//! Spares: with a spare limit ([`CutCache::set_spare_limit`]), an entry that is removed
//! keeps its buffer as a spare while the cache's bytes stay within the limit, and a new
//! entry of the same layout takes a spare instead of allocating (the one that held the same
//! cut last, else the one at the lowest address), so that a run repeating the same cuts
//! gets the same entries every time: no device allocation or free inside a step, and the
//! same addresses for graphs kept from the step before (which ggml's CUDA backend needs to
//! replay them as CUDA graphs).

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
    /// Buffers of removed entries kept for reuse (see the module documentation).
    spares: Vec<Entry>,
    /// Where each cut's entry was last (a cut takes that spare back first).
    last: HashMap<CutName, usize>,
    /// Buffers of each size (in bytes) a run needs at once (see
    /// [`set_spare_quota`](CutCache::set_spare_quota)).
    quota: HashMap<usize, usize>,
    /// The most bytes entries and spares may hold together for spares to be kept (`0`:
    /// none kept).
    spare_limit: u64,
    /// Whether removed entries are all kept as spares, whatever the limit (see
    /// [`CutCache::hold_frees`]).
    holding: bool,
}

impl std::fmt::Debug for CutCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut names: Vec<String> = self.entries.keys().map(|k| k.to_string()).collect();
        names.sort();
        f.debug_struct("CutCache")
            .field("buffer_type", &self.buft.name())
            .field("entries", &names)
            .field("spares", &self.spares.len())
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
            spares: Vec::new(),
            last: HashMap::new(),
            quota: HashMap::new(),
            spare_limit: 0,
            holding: false,
        }
    }

    /// While on, the cache frees no buffer: removed entries become spares even past the
    /// spare limit (a graph still queued on the device may read them, and freeing device
    /// memory under queued work waits for it on some backends); turning it off frees the
    /// spares past the limit. Clearing the cache frees everything either way.
    pub fn hold_frees(&mut self, on: bool) {
        self.holding = on;
        if !on {
            self.trim_spares(0);
        }
    }

    /// Keeps the buffers of removed entries as spares while the cache (entries and spares)
    /// holds at most `bytes` (`None` or 0: no spares; the ones held are freed).
    pub fn set_spare_limit(&mut self, bytes: Option<u64>) {
        self.spare_limit = bytes.unwrap_or(0);
        self.trim_spares(0);
    }

    /// Sets how many buffers of each size (tensor bytes) a run of the same plan holds at
    /// once: spares are then freed from the sizes held beyond their quota first, so that
    /// a run repeating the same cuts keeps the buffers it needs of every size (with a
    /// spare limit of at least the quota's bytes, none is freed or allocated from one run
    /// to the next). Empty: no quota (the largest spares go first).
    pub fn set_spare_quota(&mut self, quota: HashMap<usize, usize>) {
        self.quota = quota;
    }

    /// Buffers held (entries and spares) by tensor size.
    fn held_by_size(&self) -> HashMap<usize, usize> {
        let mut held: HashMap<usize, usize> = HashMap::new();
        for e in self.entries.values().chain(&self.spares) {
            *held.entry(e.tensor.nbytes()).or_default() += 1;
        }
        held
    }

    /// The order in which to free the spares `candidates` (indices): those of sizes held
    /// beyond their quota first, then the largest first.
    fn drop_order(&self, mut candidates: Vec<usize>) -> Vec<usize> {
        let held = self.held_by_size();
        let over = |i: usize| {
            let size = self.spares[i].tensor.nbytes();
            held.get(&size).copied().unwrap_or(0) > self.quota.get(&size).copied().unwrap_or(0)
        };
        candidates.sort_by_key(|&i| {
            (
                !over(i),
                std::cmp::Reverse(self.spares[i].buffer.footprint()),
            )
        });
        candidates
    }

    /// Frees spares (see [`drop_order`](Self::drop_order)) until `extra` more bytes keep
    /// the cache within its spare limit (all of them without a limit).
    fn trim_spares(&mut self, extra: u64) {
        if self.holding {
            return;
        }
        if self.spare_limit == 0 {
            self.spares.clear();
            return;
        }
        while !self.spares.is_empty() && self.bytes() as u64 + extra > self.spare_limit {
            let first = self.drop_order((0..self.spares.len()).collect())[0];
            self.spares.swap_remove(first);
        }
    }

    /// Moves removed entries to the spares (or frees them, see [`trim_spares`](Self::trim_spares)).
    fn keep_spares(&mut self, removed: impl IntoIterator<Item = Entry>) {
        if self.spare_limit == 0 && !self.holding {
            return;
        }
        self.spares.extend(removed);
        self.trim_spares(0);
    }

    /// Bytes of new buffers that entries shaped like `likes` (outputs about to be stored
    /// or bound, none of them cached yet) would allocate: those no spare of the same
    /// layout would hold, at their footprint in this cache's buffer type. Frees spares
    /// first so that the cache with those new buffers stays within its spare limit
    /// (keeping the ones that would be reused).
    pub fn room_for(&mut self, likes: &[&GTensor]) -> u64 {
        // Match each to a distinct spare, as `entry_like` would take them.
        let mut taken = vec![false; self.spares.len()];
        let mut new_bytes = 0u64;
        for &like in likes {
            let hit = (0..self.spares.len())
                .filter(|&i| !taken[i])
                .filter(|&i| {
                    let t = &self.spares[i].tensor;
                    t.type_code() == like.type_code() && t.ne() == like.ne() && t.nb() == like.nb()
                })
                .min_by_key(|&i| self.spares[i].tensor.data_addr());
            match hit {
                Some(i) => taken[i] = true,
                None => {
                    new_bytes += self.buft.footprint(self.buft.alloc_size(like) as u64);
                }
            }
        }
        if self.spare_limit == 0 || self.holding {
            return new_bytes;
        }
        // Free unmatched spares while over the limit (see `drop_order`).
        let unmatched = self.drop_order((0..self.spares.len()).filter(|&i| !taken[i]).collect());
        let mut bytes = self.bytes() as u64 + new_bytes;
        let mut drop: Vec<usize> = Vec::new();
        for i in unmatched {
            if bytes <= self.spare_limit {
                break;
            }
            bytes -= self.spares[i].buffer.footprint();
            drop.push(i);
        }
        drop.sort_unstable_by(|a, b| b.cmp(a));
        for i in drop {
            self.spares.swap_remove(i);
        }
        new_bytes
    }

    /// Takes a spare with `like`'s type and shape (and strides, unless `contiguous`), if
    /// any: the one that held cut `name` last, else the one at the lowest address.
    fn take_spare(&mut self, name: &CutName, like: &GTensor, contiguous: bool) -> Option<Entry> {
        let i = (0..self.spares.len())
            .filter(|&i| {
                let t = &self.spares[i].tensor;
                t.type_code() == like.type_code()
                    && t.ne() == like.ne()
                    && (if contiguous {
                        t.is_contiguous()
                    } else {
                        t.nb() == like.nb()
                    })
            })
            .min_by_key(|&i| {
                let at = self.spares[i].tensor.data_addr();
                (self.last.get(name) != Some(&at), at)
            })?;
        Some(self.spares.swap_remove(i))
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
            if let Some(old) = self.entries.remove(name) {
                self.keep_spares([old]);
            }
            if let Some(spare) = self.take_spare(name, like, contiguous) {
                spare.tensor.set_name(&like.name());
                self.last.insert(name.clone(), spare.tensor.data_addr());
                self.entries.insert(name.clone(), spare);
                return Ok(&self.entries[name]);
            }
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
            self.trim_spares(self.buft.footprint(self.buft.alloc_size(&tensor) as u64));
            let buffer = self
                .buft
                .alloc_context_tensors(&ctx)
                .map_err(ggml(format!("allocating cut cache entry '{name}'")))?;
            self.last.insert(name.clone(), tensor.data_addr());
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

    /// [`bind_output`](Self::bind_output) for an output of a graph kept from an earlier
    /// execution, which already has memory: in the entry for `name` when it still holds
    /// it, else in the spare that holds it (which becomes the entry, so that the graphs
    /// reading this cut find the same entry as before), else moved into the entry as
    /// [`bind_output`](Self::bind_output) would make it. Returns `false` when it cannot be
    /// placed (a view, another layout, or memory that is not this cache's), doing nothing
    /// to `t`.
    pub fn rebind_output(&mut self, name: &CutName, t: &GTensor) -> Result<bool> {
        if t.view_src().is_some() {
            return Ok(false);
        }
        let layout = |e: &Entry| {
            e.tensor.type_code() == t.type_code()
                && e.tensor.ne() == t.ne()
                && e.tensor.nb() == t.nb()
        };
        if self
            .entries
            .get(name)
            .is_some_and(|e| layout(e) && e.tensor.same_data(t))
        {
            return Ok(true);
        }
        if let Some(i) = self
            .spares
            .iter()
            .position(|e| layout(e) && e.tensor.same_data(t))
        {
            let spare = self.spares.swap_remove(i);
            if let Some(old) = self.entries.remove(name) {
                self.keep_spares([old]);
            }
            spare.tensor.set_name(&t.name());
            self.entries.insert(name.clone(), spare);
            return Ok(true);
        }
        // Its memory is elsewhere in this cache (a buffer another cut took) or gone.
        if t.is_allocated()
            && !self
                .entries
                .values()
                .chain(&self.spares)
                .any(|e| e.buffer.unplace(t))
        {
            return Ok(false);
        }
        self.bind_output(name, t)
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

    /// Bytes of all entry buffers, spares included.
    pub fn bytes(&self) -> usize {
        self.entries
            .values()
            .chain(&self.spares)
            .map(|e| e.buffer.footprint() as usize)
            .sum()
    }

    /// Bytes of the entries' buffers, spares not included.
    pub fn entry_bytes(&self) -> usize {
        self.entries
            .values()
            .map(|e| e.buffer.footprint() as usize)
            .sum()
    }

    /// The device bytes of the entry for `name` (its buffer's footprint), if any.
    pub fn entry_footprint(&self, name: &CutName) -> Option<u64> {
        self.entries.get(name).map(|e| e.buffer.footprint())
    }

    /// Spare buffers held (see the module documentation).
    pub fn spares(&self) -> usize {
        self.spares.len()
    }

    /// Keeps only the entries `keep` accepts (the others' buffers are freed, or kept as
    /// spares).
    pub fn retain(&mut self, mut keep: impl FnMut(&CutName) -> bool) {
        let gone: Vec<CutName> = self.entries.keys().filter(|k| !keep(k)).cloned().collect();
        let removed: Vec<Entry> = gone.iter().filter_map(|k| self.entries.remove(k)).collect();
        self.keep_spares(removed);
    }

    /// Removes an entry (its buffer is freed, or kept as a spare).
    pub fn remove(&mut self, name: &CutName) {
        if let Some(e) = self.entries.remove(name) {
            self.keep_spares([e]);
        }
    }

    /// Drops every entry and every spare.
    pub fn clear(&mut self) {
        self.entries.clear();
        self.spares.clear();
        self.last.clear();
        self.quota.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sd_tensor::DType;

    fn like(ctx: &Context, n: usize) -> GTensor {
        ctx.new_tensor(DType::F32, &[n, 2]).unwrap()
    }

    #[test]
    fn held_frees_keep_every_removed_buffer_until_released() {
        let ctx = Context::new_descriptors(8, 8, 0).unwrap();
        let (a, b) = (like(&ctx, 64), like(&ctx, 32));
        let name = |s: &str| CutName::new("g", s).unwrap();
        let mut cache = CutCache::host();
        cache.store_bytes(&name("a"), &a, &[1; 512]).unwrap();
        cache.store_bytes(&name("b"), &b, &[2; 256]).unwrap();
        let total = cache.bytes();
        // No limit: removed entries would be freed, but not while frees are held (a
        // graph in flight may read them), nor to make room for new buffers.
        cache.hold_frees(true);
        cache.retain(|_| false);
        assert_eq!((cache.spares(), cache.bytes()), (2, total));
        let big = like(&ctx, 96);
        assert!(cache.room_for(&[&big]) > 0);
        assert_eq!(cache.spares(), 2, "room_for freed a spare while held");
        // Released: freed down to the limit (none).
        cache.hold_frees(false);
        assert_eq!((cache.spares(), cache.bytes()), (0, 0));
    }

    #[test]
    fn a_kept_output_goes_back_into_the_spare_that_held_it_or_moves() {
        let ctx = Context::new_descriptors(8, 8, 0).unwrap();
        let name = |s: &str| CutName::new("g", s).unwrap();
        let (a, b) = (like(&ctx, 64), like(&ctx, 64));
        let mut cache = CutCache::host();
        cache.set_spare_limit(Some(1 << 20));
        assert!(cache.bind_output(&name("a"), &a).unwrap());
        let entry = cache.get(&name("a")).unwrap().id();
        // The step ends: the entry becomes a spare, the output keeps its memory there.
        cache.retain(|_| false);
        assert!(a.is_allocated());
        assert!(cache.rebind_output(&name("a"), &a).unwrap());
        assert_eq!(cache.get(&name("a")).unwrap().id(), entry, "the same entry");
        assert!(cache.get(&name("a")).unwrap().same_data(&a));
        assert_eq!(cache.spares(), 0);
        // The spare goes to another cut first: the kept output moves to an entry of its
        // own, and the other cut keeps its memory.
        cache.retain(|_| false);
        assert!(cache.bind_output(&name("b"), &b).unwrap());
        assert!(b.same_data(&a), "b took the spare a was in");
        assert!(cache.rebind_output(&name("a"), &a).unwrap());
        assert!(cache.get(&name("a")).unwrap().same_data(&a));
        assert!(cache.get(&name("b")).unwrap().same_data(&b));
        assert!(!a.same_data(&b));
        // A view is never placed.
        let v = ctx.reshape(&a, &[128]).unwrap();
        assert!(!cache.rebind_output(&name("v"), &v).unwrap());
    }

    #[test]
    fn removed_entries_become_spares_that_the_same_layout_takes_back() {
        let ctx = Context::new_descriptors(8, 8, 0).unwrap();
        let (a, b) = (like(&ctx, 64), like(&ctx, 32));
        let name = |s: &str| CutName::new("g", s).unwrap();
        let mut cache = CutCache::host();
        let bytes_ab = {
            let mut probe = CutCache::host();
            probe.store_bytes(&name("a"), &a, &[0; 512]).unwrap();
            probe.store_bytes(&name("b"), &b, &[0; 256]).unwrap();
            probe.bytes() as u64
        };
        // Without a limit nothing is kept.
        cache.store_bytes(&name("a"), &a, &[1; 512]).unwrap();
        cache.remove(&name("a"));
        assert_eq!((cache.spares(), cache.bytes()), (0, 0));
        // With room for both, removed entries stay as spares and a new cut of the same
        // layout takes one back (the same memory), counting nothing new.
        cache.set_spare_limit(Some(bytes_ab));
        cache.store_bytes(&name("a"), &a, &[1; 512]).unwrap();
        cache.store_bytes(&name("b"), &b, &[2; 256]).unwrap();
        let addr = cache.get(&name("a")).unwrap().data_addr();
        cache.retain(|_| false);
        assert_eq!(cache.spares(), 2);
        assert_eq!(cache.bytes() as u64, bytes_ab);
        assert_eq!(cache.room_for(&[&a]), 0, "a spare holds it");
        cache.store_bytes(&name("c"), &a, &[3; 512]).unwrap();
        assert_eq!(cache.get(&name("c")).unwrap().data_addr(), addr);
        assert_eq!(cache.spares(), 1);
        // A layout no spare has needs a new buffer; the unmatched spare goes to keep the
        // cache within the limit.
        let big = like(&ctx, 96);
        assert!(cache.room_for(&[&big]) > 0);
        assert_eq!(cache.spares(), 0);
        cache.store_bytes(&name("d"), &big, &[4; 768]).unwrap();
        assert_eq!(cache.len(), 2);
        // Clearing drops spares too.
        cache.retain(|_| false);
        cache.clear();
        assert_eq!((cache.spares(), cache.bytes()), (0, 0));
    }

    #[test]
    fn cuts_take_back_their_buffers_and_the_quota_keeps_each_size() {
        let ctx = Context::new_descriptors(16, 16, 0).unwrap();
        let name = |s: &str| CutName::new("g", s).unwrap();
        let (big, small, tiny) = (like(&ctx, 64), like(&ctx, 32), like(&ctx, 8));
        let footprint = |t: &GTensor, bytes: usize| {
            let mut probe = CutCache::host();
            probe.store_bytes(&name("p"), t, &vec![0; bytes]).unwrap();
            probe.bytes() as u64
        };
        let (fb, fs, ft) = (
            footprint(&big, 512),
            footprint(&small, 256),
            footprint(&tiny, 64),
        );
        let mut cache = CutCache::host();
        cache.set_spare_limit(Some(2 * fb + fs));
        cache.store_bytes(&name("a"), &big, &[1; 512]).unwrap();
        cache.store_bytes(&name("b"), &big, &[2; 512]).unwrap();
        let at = |c: &CutCache, n: &str| c.get(&name(n)).unwrap().data_addr();
        let (a, b) = (at(&cache, "a"), at(&cache, "b"));
        cache.retain(|_| false);
        // The cut whose buffer is at the higher address comes first this time: it still
        // gets its own (by address alone it would take the lower one), and so does the
        // other.
        let (first, second) = if a > b { ("a", "b") } else { ("b", "a") };
        cache.store_bytes(&name(first), &big, &[3; 512]).unwrap();
        cache.store_bytes(&name(second), &big, &[4; 512]).unwrap();
        assert_eq!((at(&cache, "a"), at(&cache, "b")), (a, b));
        cache.store_bytes(&name("s"), &small, &[5; 256]).unwrap();
        cache.retain(|_| false);
        assert_eq!(cache.spares(), 3);
        // Over the limit, spares of a size held beyond its quota go first: with a quota
        // of two big buffers and no small one, a new tiny entry frees the small spare
        // (largest first would free a big one).
        let mut quota = HashMap::new();
        quota.insert(big.nbytes(), 2);
        cache.set_spare_quota(quota);
        cache.set_spare_limit(Some(2 * fb + fs + ft - 1));
        cache.store_bytes(&name("t"), &tiny, &[6; 64]).unwrap();
        assert_eq!(cache.spares(), 2);
        assert_eq!(cache.room_for(&[&big, &big]), 0, "both big spares kept");
        cache.store_bytes(&name("a"), &big, &[7; 512]).unwrap();
        cache.store_bytes(&name("b"), &big, &[8; 512]).unwrap();
        assert_eq!((at(&cache, "a"), at(&cache, "b")), (a, b));
        // Without a quota the largest goes first.
        cache.retain(|_| false);
        cache.set_spare_quota(HashMap::new());
        cache.store_bytes(&name("s"), &small, &[9; 256]).unwrap();
        assert_eq!(cache.spares(), 2, "a tiny and a big spare left");
        assert!(
            cache.room_for(&[&big, &big]) > 0,
            "one big buffer was freed"
        );
    }
}
