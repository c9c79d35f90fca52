//! Staging pools: one device buffer per compute backend, allocated once, from which staging
//! blocks are sub-allocated (first fit) instead of allocating a device buffer per block.
//!
//! Streaming weights segment by segment under a budget stages (and evicts) many small
//! groups of weights every step. Without a pool each group is a device allocation and a
//! free inside the step (`cudaMalloc`/`cudaFree` on CUDA, which synchronise the device).
//! With a pool, a staging block is a region of the pool: the registered tensors are placed
//! at the region's offsets ([`Buffer::place`]) and take their memory back when the block is
//! dropped ([`Buffer::unplace`]); the pool never grows and is freed only when released.
//!
//! Accounting: the pool counts once at its full size in the device's resident bytes (it is
//! device memory whether its regions are used or not); a block in it frees no device
//! memory when evicted, only room in the pool. Capacity checks therefore count the staging
//! copies a request still needs as missing device bytes only when they do not fit in the
//! pool's largest free region (they would then get buffers of their own).

use sd_tensor::ggml::Buffer;

use super::blocks::align_up;
use crate::residency::OwnerId;

/// One staging pool: its buffer, who asked for it and its free regions.
#[derive(Debug)]
pub(crate) struct StagingPool {
    /// The device buffer. Dropping it clears every tensor still placed in it.
    pub buffer: Buffer,
    /// The runtime owner that asked for it (released with the owner).
    pub owner: OwnerId,
    /// Free regions `(offset, size)`, sorted by offset, never adjacent (coalesced).
    free: Vec<(u64, u64)>,
    align: u64,
}

impl StagingPool {
    /// A pool over `buffer`, all free.
    pub fn new(buffer: Buffer, owner: OwnerId) -> StagingPool {
        let align = (buffer.alignment() as u64).max(1);
        let size = buffer.size() as u64;
        StagingPool {
            buffer,
            owner,
            free: vec![(0, size)],
            align,
        }
    }

    /// The pool's size.
    pub fn size(&self) -> u64 {
        self.buffer.size() as u64
    }

    /// Reserves `bytes` (rounded up to the alignment) at the first free region that holds
    /// them; returns the offset, or `None` when no region does.
    pub fn alloc(&mut self, bytes: u64) -> Option<u64> {
        let need = align_up(bytes.max(1), self.align);
        let i = self.free.iter().position(|&(_, s)| s >= need)?;
        let (off, size) = self.free[i];
        if size == need {
            self.free.remove(i);
        } else {
            self.free[i] = (off + need, size - need);
        }
        Some(off)
    }

    /// Returns the region `offset..offset+bytes` (as given to [`alloc`](Self::alloc)).
    pub fn free(&mut self, offset: u64, bytes: u64) {
        let need = align_up(bytes.max(1), self.align);
        let i = self.free.partition_point(|&(o, _)| o < offset);
        self.free.insert(i, (offset, need));
        // Merge with the next, then with the previous region.
        if i + 1 < self.free.len() && self.free[i].0 + self.free[i].1 == self.free[i + 1].0 {
            self.free[i].1 += self.free[i + 1].1;
            self.free.remove(i + 1);
        }
        if i > 0 && self.free[i - 1].0 + self.free[i - 1].1 == self.free[i].0 {
            self.free[i - 1].1 += self.free[i].1;
            self.free.remove(i);
        }
    }

    /// Whether [`alloc`](Self::alloc) would succeed for every size of `sizes`, in order
    /// (first fit on a copy of the free list; nothing changes).
    pub fn fits_all(&self, sizes: impl IntoIterator<Item = u64>) -> bool {
        let mut free = self.free.clone();
        for bytes in sizes {
            let need = align_up(bytes.max(1), self.align);
            let Some(i) = free.iter().position(|&(_, s)| s >= need) else {
                return false;
            };
            if free[i].1 == need {
                free.remove(i);
            } else {
                free[i] = (free[i].0 + need, free[i].1 - need);
            }
        }
        true
    }

    /// The largest free region.
    #[cfg(test)]
    pub fn largest_free(&self) -> u64 {
        self.free.iter().map(|&(_, s)| s).max().unwrap_or(0)
    }

    /// Free bytes in all regions.
    pub fn free_bytes(&self) -> u64 {
        self.free.iter().map(|&(_, s)| s).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sd_tensor::ggml::BufferType;

    #[test]
    fn first_fit_reuses_and_coalesces_regions() {
        let buf = BufferType::cpu().alloc(1024).unwrap();
        let mut p = StagingPool::new(buf, OwnerId(1));
        let a = p.buffer.alignment() as u64;
        assert_eq!(p.free_bytes(), 1024);
        let x = p.alloc(100).unwrap();
        let y = p.alloc(200).unwrap();
        let z = p.alloc(100).unwrap();
        assert_eq!(x, 0);
        assert_eq!(y, align_up(100, a));
        assert!(z >= y + 200 && z.is_multiple_of(a));
        // A hole in the middle is reused by what fits in it, first fit.
        p.free(y, 200);
        assert_eq!(p.alloc(150), Some(y));
        p.free(y, 150);
        // Freeing everything coalesces back into one region.
        p.free(x, 100);
        p.free(z, 100);
        assert_eq!(p.largest_free(), 1024);
        assert_eq!(p.free_bytes(), 1024);
        // The check agrees with allocating in order.
        let x = p.alloc(100).unwrap();
        p.alloc(600).unwrap();
        p.free(x, 100);
        let rest = 1024 - align_up(100, a) - align_up(600, a);
        assert!(p.fits_all([100, rest]));
        assert!(!p.fits_all([100, rest + a]));
        p.free(align_up(100, a), 600);
        assert_eq!(p.free_bytes(), 1024);
        // Too large: refused, nothing changes.
        assert_eq!(p.alloc(2048), None);
        assert_eq!(p.alloc(1024), Some(0));
        assert_eq!(p.largest_free(), 0);
        assert_eq!(p.alloc(1), None);
    }
}
