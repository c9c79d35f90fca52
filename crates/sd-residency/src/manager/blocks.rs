//! Residency blocks: params storage blocks and compute staging blocks, and the chunk
//! planner that lays tensors out in buffers.

use sd_tensor::ggml::Buffer;

use crate::residency::{BackendId, BlockId, OwnerId, ParamId, SourceId};
use sd_formats::FileId;

/// Largest device buffer the manager allocates for weights (upstream's
/// `MAX_RESIDENCY_BLOCK_BYTES`); a single larger tensor gets a buffer of its own.
pub const MAX_RESIDENCY_BLOCK_BYTES: u64 = 64 << 20;

/// One params-backend buffer holding the params copies of its members.
#[derive(Debug)]
pub(crate) struct StorageBlock {
    pub backend: BackendId,
    /// Dropping it clears every descriptor placed in it (storage descriptors and bound
    /// registered tensors).
    pub buffer: Buffer,
    pub members: Vec<ParamId>,
    /// The mapped file, for zero-copy blocks (the buffer spans the whole file).
    pub mapped: Option<(SourceId, FileId)>,
}

/// Where a staging block's memory is.
#[derive(Debug)]
pub(crate) enum StagingMem {
    /// A compute-backend buffer of its own (freed with the block).
    Own(Buffer),
    /// Regions `(offset, bytes)` of the compute backend's staging pool (see `super::pool`),
    /// one per member: its members are unplaced and the regions returned to the pool when
    /// the block is dropped.
    Pool {
        backend: BackendId,
        regions: Vec<(u64, u64)>,
    },
}

/// Compute-backend memory holding staging copies (the registered tensors themselves are
/// placed in it).
#[derive(Debug)]
pub(crate) struct StagingBlock {
    pub mem: StagingMem,
    pub members: Vec<ParamId>,
    /// The owner, while the block is a prefetch not yet activated.
    pub prefetch_owner: Option<OwnerId>,
}

impl StagingBlock {
    /// Bytes the block takes (its buffer, or its region of the pool).
    pub fn bytes(&self) -> u64 {
        match &self.mem {
            StagingMem::Own(b) => b.footprint(),
            StagingMem::Pool { regions, .. } => regions.iter().map(|r| r.1).sum(),
        }
    }
}

/// A block of either kind, for iteration.
pub(crate) enum AnyBlock<'a> {
    Storage(BlockId, &'a StorageBlock),
    Staging(BlockId, &'a StagingBlock),
}

impl<'a> AnyBlock<'a> {
    /// The buffer the block owns (`None` for a region of a staging pool).
    pub fn own_buffer(&self) -> Option<&'a Buffer> {
        match self {
            AnyBlock::Storage(_, b) => Some(&b.buffer),
            AnyBlock::Staging(_, b) => match &b.mem {
                StagingMem::Own(buf) => Some(buf),
                StagingMem::Pool { .. } => None,
            },
        }
    }

    /// Bytes the block takes.
    pub fn bytes(&self) -> u64 {
        match self {
            AnyBlock::Storage(_, b) => b.buffer.footprint(),
            AnyBlock::Staging(_, b) => b.bytes(),
        }
    }
}

/// Rounds `v` up to a multiple of `align` (saturating).
pub(crate) fn align_up(v: u64, align: u64) -> u64 {
    let a = align.max(1);
    v.div_ceil(a).saturating_mul(a)
}

/// Lays `items` (`(key, alloc size)`) out in chunks of at most `cap` bytes (an item larger
/// than `cap` gets a chunk of its own) at `align`-aligned offsets. Returns, per chunk, the
/// placements `(key, offset)` and the chunk size.
pub(crate) fn plan_chunks<K: Copy>(
    items: &[(K, u64)],
    align: u64,
    cap: u64,
) -> Vec<(Vec<(K, u64)>, u64)> {
    let mut out: Vec<(Vec<(K, u64)>, u64)> = Vec::new();
    let mut cur: Vec<(K, u64)> = Vec::new();
    let mut size = 0u64;
    for &(k, bytes) in items {
        let off = align_up(size, align);
        let end = off.saturating_add(bytes);
        if !cur.is_empty() && end > cap {
            out.push((std::mem::take(&mut cur), size));
            cur.push((k, 0));
            size = bytes;
        } else {
            cur.push((k, off));
            size = end;
        }
    }
    if !cur.is_empty() {
        out.push((cur, size));
    }
    // A zero-byte buffer is refused by some backends.
    for c in &mut out {
        c.1 = c.1.max(align.max(1));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_respect_cap_and_alignment() {
        let items: Vec<(u32, u64)> = vec![(0, 100), (1, 100), (2, 500), (3, 10)];
        let c = plan_chunks(&items, 64, 256);
        assert_eq!(c.len(), 3);
        assert_eq!(c[0].0, vec![(0, 0), (1, 128)]);
        assert_eq!(c[0].1, 228);
        assert_eq!(c[1].0, vec![(2, 0)]);
        assert_eq!(c[2].0, vec![(3, 0)]);
        assert!(plan_chunks::<u32>(&[], 32, 10).is_empty());
    }
}
