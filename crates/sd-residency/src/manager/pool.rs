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
//!
//! Stable placement: a weight streamed through the pool again goes back to the offset it
//! had last time when that region is free (see [`StagingPool::place`]). A sampling loop
//! then stages every step's weights where the step before had them, so each segment's
//! graph reads the same addresses every step, which is what ggml's CUDA backend needs to
//! replay the graph it captured (one CUDA graph launch instead of a launch per kernel).

use std::collections::HashMap;

use sd_tensor::ggml::Buffer;

use super::blocks::align_up;
use crate::residency::{OwnerId, ParamId};

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
    /// Where each weight was placed last (see [`place`](Self::place)).
    last: HashMap<ParamId, u64>,
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
            last: HashMap::new(),
        }
    }

    /// Places a group of weights `(param, bytes, high)`, all or none, and returns their
    /// offsets in order. With `stable`, each goes back to the offset it had last time when
    /// that region is free, the others first fit (or high, see [`alloc`](Self::alloc));
    /// when that leaves one without room, the whole group is placed as plain first fit
    /// would: so a group fits exactly when [`fits_all`](Self::fits_all) says it does.
    pub fn place(&mut self, items: &[(ParamId, u64, bool)], stable: bool) -> Option<Vec<u64>> {
        let needs: Vec<(u64, bool)> = items
            .iter()
            .map(|&(_, b, high)| (align_up(b.max(1), self.align), high))
            .collect();
        let attempt = |prefer: &dyn Fn(usize) -> Option<u64>| {
            let mut free = self.free.clone();
            let mut offsets = Vec::with_capacity(needs.len());
            for (i, &(need, high)) in needs.iter().enumerate() {
                let at = prefer(i)
                    .filter(|&o| take_at(&mut free, o, need))
                    .or_else(|| take(&mut free, need, self.align, high))?;
                offsets.push(at);
            }
            Some((free, offsets))
        };
        let sticky = |i: usize| self.last.get(&items[i].0).copied();
        let (free, offsets) = stable
            .then(|| attempt(&sticky))
            .flatten()
            .or_else(|| attempt(&|_| None))?;
        self.free = free;
        for (&(p, _, _), &o) in items.iter().zip(&offsets) {
            self.last.insert(p, o);
        }
        Some(offsets)
    }

    /// The pool's size.
    pub fn size(&self) -> u64 {
        self.buffer.size() as u64
    }

    /// Reserves `bytes` (rounded up to the alignment) at the first free region that holds
    /// them; returns the offset, or `None` when no region does. With `high`, at the end
    /// of the last region that holds them instead (weights kept for long go to the pool's
    /// high end, so that the ones streamed through it find one contiguous region).
    /// (The manager places groups with [`place`](Self::place).)
    #[cfg(test)]
    pub fn alloc(&mut self, bytes: u64, high: bool) -> Option<u64> {
        let need = align_up(bytes.max(1), self.align);
        take(&mut self.free, need, self.align, high)
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
    pub fn fits_all(&self, sizes: impl IntoIterator<Item = (u64, bool)>) -> bool {
        let mut free = self.free.clone();
        sizes.into_iter().all(|(bytes, high)| {
            take(
                &mut free,
                align_up(bytes.max(1), self.align),
                self.align,
                high,
            )
            .is_some()
        })
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

/// Takes `need` bytes (a multiple of `align`) from the free list: at the start of the
/// first region that holds them, or with `high` at the last aligned offset of the last one
/// that does (the pool's end need not be aligned: a tail smaller than `align` stays free);
/// returns the offset.
fn take(free: &mut Vec<(u64, u64)>, need: u64, align: u64, high: bool) -> Option<u64> {
    if !high {
        let i = free.iter().position(|&(_, s)| s >= need)?;
        let (off, size) = free[i];
        if size == need {
            free.remove(i);
        } else {
            free[i] = (off + need, size - need);
        }
        return Some(off);
    }
    let at = |&(off, size): &(u64, u64)| {
        let end = (off + size).checked_sub(need)?;
        let at = end / align * align;
        (at >= off).then_some(at)
    };
    let i = free.iter().rposition(|r| at(r).is_some())?;
    let (off, size) = free[i];
    let a = at(&free[i])?;
    let tail = (a + need, off + size - (a + need));
    let mut parts = Vec::with_capacity(2);
    if a > off {
        parts.push((off, a - off));
    }
    if tail.1 > 0 {
        parts.push(tail);
    }
    free.splice(i..=i, parts);
    Some(a)
}

/// Takes exactly `offset..offset + need` from the free list when one free region holds it;
/// returns whether it did.
fn take_at(free: &mut Vec<(u64, u64)>, offset: u64, need: u64) -> bool {
    let i = free.partition_point(|&(o, _)| o <= offset);
    let Some(i) = i.checked_sub(1) else {
        return false;
    };
    let (off, size) = free[i];
    if offset + need > off + size {
        return false;
    }
    let mut parts = Vec::with_capacity(2);
    if offset > off {
        parts.push((off, offset - off));
    }
    if off + size > offset + need {
        parts.push((offset + need, off + size - offset - need));
    }
    free.splice(i..=i, parts);
    true
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
        let x = p.alloc(100, false).unwrap();
        let y = p.alloc(200, false).unwrap();
        let z = p.alloc(100, false).unwrap();
        assert_eq!(x, 0);
        assert_eq!(y, align_up(100, a));
        assert!(z >= y + 200 && z.is_multiple_of(a));
        // A hole in the middle is reused by what fits in it, first fit.
        p.free(y, 200);
        assert_eq!(p.alloc(150, false), Some(y));
        p.free(y, 150);
        // Freeing everything coalesces back into one region.
        p.free(x, 100);
        p.free(z, 100);
        assert_eq!(p.largest_free(), 1024);
        assert_eq!(p.free_bytes(), 1024);
        // The check agrees with allocating in order.
        let x = p.alloc(100, false).unwrap();
        p.alloc(600, false).unwrap();
        p.free(x, 100);
        let rest = 1024 - align_up(100, a) - align_up(600, a);
        assert!(p.fits_all([(100, false), (rest, false)]));
        assert!(!p.fits_all([(100, false), (rest + a, false)]));
        p.free(align_up(100, a), 600);
        assert_eq!(p.free_bytes(), 1024);
        // Too large: refused, nothing changes.
        assert_eq!(p.alloc(2048, false), None);
        assert_eq!(p.alloc(1024, false), Some(0));
        assert_eq!(p.largest_free(), 0);
        assert_eq!(p.alloc(1, false), None);
        // High placements come from the end of the last region that holds them.
        p.free(0, 1024);
        let lo = p.alloc(100, false).unwrap();
        let hi = p.alloc(100, true).unwrap();
        assert_eq!(lo, 0);
        assert_eq!(hi, (1024 - align_up(100, a)) / a * a);
        let hi2 = p.alloc(200, true).unwrap();
        assert_eq!(hi2, hi - align_up(200, a));
        assert!(p.fits_all([(1024 - align_up(100, a) * 2 - align_up(200, a), true)]));
        p.free(hi, 100);
        // The freed top region is the last that holds 100 bytes again.
        assert_eq!(p.alloc(100, true), Some(hi));
    }

    #[test]
    fn stable_placement_returns_weights_to_their_last_offsets() {
        let buf = BufferType::cpu().alloc(4096).unwrap();
        let mut p = StagingPool::new(buf, OwnerId(1));
        let a = p.buffer.alignment() as u64;
        let (x, y, z) = (ParamId(1), ParamId(2), ParamId(3));
        // First time: first fit.
        let first = p.place(&[(x, 100, false), (y, 200, false)], true).unwrap();
        assert_eq!(first, vec![0, align_up(100, a)]);
        let third = p.place(&[(z, 300, false)], true).unwrap();
        // Freed in another order and placed again in another order: each weight goes
        // back where it was, where first fit would have put `z` at 0.
        p.free(first[0], 100);
        p.free(first[1], 200);
        p.free(third[0], 300);
        assert_eq!(p.place(&[(z, 300, false)], true).unwrap(), third);
        assert_eq!(
            p.place(&[(y, 200, false), (x, 100, false)], true).unwrap(),
            vec![first[1], first[0]]
        );
        p.free(first[0], 100);
        p.free(first[1], 200);
        p.free(third[0], 300);
        assert_eq!(p.free_bytes(), 4096);
        // Without stability: first fit.
        assert_eq!(p.place(&[(z, 300, false)], false).unwrap(), vec![0]);
        p.free(0, 300);
        // A last offset that is taken: first fit for that weight.
        let w = ParamId(4);
        assert_eq!(p.place(&[(w, 300, false)], false).unwrap(), vec![0]);
        let s300 = align_up(300, a);
        assert_eq!(p.place(&[(z, 300, false)], true).unwrap(), vec![s300]);
        p.free(0, 300);
        p.free(s300, 300);
        // A stable placement that would leave a later weight without room falls back to
        // first fit for the whole group, which fits as `fits_all` says.
        let s100 = align_up(100, a);
        assert_eq!(
            p.place(&[(y, 100, false), (x, 100, false)], false).unwrap(),
            vec![0, s100]
        );
        p.free(0, 100);
        p.free(s100, 100);
        let big = 4096 - s100;
        assert!(p.fits_all([(100, false), (big, false)]));
        let got = p.place(&[(x, 100, false), (w, big, false)], true).unwrap();
        assert_eq!(got, vec![0, s100]);
        p.free(0, 100);
        p.free(s100, big);
        assert_eq!(p.free_bytes(), 4096);
        // Failing groups change nothing.
        assert_eq!(p.place(&[(x, 100, false), (w, 4096, false)], true), None);
        assert_eq!(p.free_bytes(), 4096);
    }
}
