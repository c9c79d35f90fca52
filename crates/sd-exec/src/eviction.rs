//! `ensure_capacity`: the engine's policy for making room on a compute device.
//!
//! 0. When the session's staging pool cannot hold the required weights that go to it,
//!    evict blocks of the pool (in the order of step 3) until it can.
//! 1. Inspect the request; an invalid device report fails, a fitting request is done.
//! 2. Release the idle workspaces (and caches) of *other* sessions one by one, re-checking
//!    after each; then the staging pool another session holds on the device (with the
//!    weights staged in it).
//! 3. Candidates: evictable weight blocks on the backend, except blocks holding required,
//!    protected, pinned or prefetching parameters. Sorted (stable) by: blocks not needing
//!    demotion first; then by position in the preferred eviction order (a block's position
//!    is the maximum of its members'; a block with a member outside the order goes after
//!    ordered ones); then least recently used first. Demotion-requiring blocks come last.
//! 4. Evict one block at a time, re-checking after each.
//! 5. Fail with the needed and available device and budget bytes.

use std::collections::BTreeMap;

use rustc_hash::{FxHashMap, FxHashSet};

use sd_residency::{
    BackendMemoryRequest, BlockId, DeviceResidencyManager, ParamId, WeightResidencyBlock,
};

use crate::error::{ExecError, Result};
use crate::session::{ExecutionSession, SessionId};

/// One step the engine took to make room, in order (see [`crate::ExecutionEngine::reclaim_log`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReclaimEvent {
    /// Another session's idle workspace and cut cache were released.
    ReleasedWorkspace {
        /// The session.
        session: SessionId,
        /// Bytes it held on the device.
        bytes: u64,
    },
    /// Another session's staging pool was released, with the weights staged in it.
    ReleasedStagingPool {
        /// The session.
        session: SessionId,
        /// The pool's bytes.
        bytes: u64,
    },
    /// A weight block was evicted from the device.
    EvictedBlock {
        /// The block.
        block: BlockId,
        /// Its parameters.
        params: Vec<ParamId>,
        /// Bytes freed.
        bytes: u64,
        /// Whether its weights were demoted to disk mode.
        demoted: bool,
    },
}

/// Which segments of a plan use each parameter, built once per prepared plan, so that the
/// preferred eviction order of any segment ([`SegmentUses::order`]) costs no list of the
/// plan's parameters per capacity ask (a budgeted SDXL step asks hundreds of times).
#[derive(Debug, Default)]
pub(crate) struct SegmentUses {
    /// The segments using each parameter, ascending.
    uses: FxHashMap<ParamId, Vec<u32>>,
    /// Segments in the plan.
    segments: usize,
}

impl SegmentUses {
    /// The uses of each parameter in `segment_params` (one list per segment).
    pub(crate) fn new(segment_params: &[Vec<ParamId>]) -> SegmentUses {
        let mut uses: FxHashMap<ParamId, Vec<u32>> = FxHashMap::default();
        for (j, params) in segment_params.iter().enumerate() {
            for p in params {
                let u = uses.entry(*p).or_default();
                if u.last() != Some(&(j as u32)) {
                    u.push(j as u32);
                }
            }
        }
        SegmentUses {
            uses,
            segments: segment_params.len(),
        }
    }

    /// The preferred eviction order when segment `k` needs room (see
    /// `execution::eviction_order`, which lists it).
    pub(crate) fn order(&self, k: usize) -> EvictionOrder<'_> {
        EvictionOrder {
            uses: Some(self),
            k,
        }
    }
}

/// A preferred eviction order: the other segments' weights, the one whose next use is
/// furthest away first, for a graph that runs again the same way: segments `k-1, ..., 0`,
/// then `n-1, ..., k+1` (see `execution::eviction_order`); or none.
#[derive(Clone, Copy, Debug)]
pub(crate) struct EvictionOrder<'a> {
    uses: Option<&'a SegmentUses>,
    k: usize,
}

impl EvictionOrder<'_> {
    /// No preferred order (least recently used first).
    pub(crate) const NONE: EvictionOrder<'static> = EvictionOrder { uses: None, k: 0 };

    /// The position of `p` in the order: that of the first segment in the order that uses
    /// it (`None`: no segment but `k` does, or there is no order).
    pub(crate) fn position(&self, p: ParamId) -> Option<usize> {
        let u = self.uses?;
        let (k, n) = (self.k, u.segments);
        u.uses
            .get(&p)?
            .iter()
            .map(|&j| j as usize)
            .filter(|&j| j != k)
            .map(|j| if j < k { k - 1 - j } else { k + (n - 1 - j) })
            .min()
    }
}

/// What to make room for.
pub(crate) struct CapacityAsk<'a> {
    /// What it is for (in errors and logs).
    pub what: String,
    /// The backend's name (in errors).
    pub backend_name: String,
    /// The request.
    pub request: BackendMemoryRequest,
    /// Parameters that must be resident afterwards.
    pub required: &'a [ParamId],
    /// The order to evict in.
    pub preferred: EvictionOrder<'a>,
    /// Parameters never to evict.
    pub protected: &'a [ParamId],
    /// Whether the request's pending bytes are needed only when the required weights do
    /// not all go to the staging pool. A prefetch: weights staged into the pool take
    /// nothing from the budget outside it, where the current segment's outputs and the
    /// next segment's workspace live (those were asked for by the segments themselves).
    pub pending_unless_pooled: bool,
}

/// The evictable weight blocks on the asked backend holding no required or protected
/// parameter, in eviction order (step 3).
fn candidates<M: DeviceResidencyManager>(
    manager: &M,
    ask: &CapacityAsk<'_>,
) -> Vec<WeightResidencyBlock> {
    let _span = tracing::debug_span!("eviction_candidates").entered();
    let keep_set: FxHashSet<ParamId> = ask.required.iter().chain(ask.protected).copied().collect();
    // (Blocks holding a kept parameter are left out here, with the fast hash, rather than
    // by the manager.)
    let mut out: Vec<WeightResidencyBlock> = manager
        .evictable_compute_backend_blocks(ask.request.backend, &[])
        .into_iter()
        .filter(|b| !b.params.iter().any(|p| keep_set.contains(p)))
        .collect();
    sort_candidates(&mut out, ask.preferred);
    out
}

/// The log event of evicting `b`.
fn eviction_event(b: &WeightResidencyBlock) -> ReclaimEvent {
    ReclaimEvent::EvictedBlock {
        block: b.id,
        params: b.params.clone(),
        bytes: b.bytes,
        demoted: b.requires_demotion,
    }
}

/// Evicts blocks of the staging pool (not holding required, protected, pinned or
/// prefetching weights; in the candidate order) until the pool holds the required weights
/// that go to it, or no such block is left.
fn make_pool_room<M: DeviceResidencyManager>(
    manager: &mut M,
    ask: &CapacityAsk<'_>,
    log: &mut Vec<ReclaimEvent>,
) -> Result<()> {
    let _span = tracing::debug_span!("make_pool_room").entered();
    let backend = ask.request.backend;
    if ask.required.is_empty() || manager.pool_holds(backend, ask.required)? {
        return Ok(());
    }
    for b in candidates(manager, ask).into_iter().filter(|b| b.pooled) {
        if !manager.evict_compute_backend_block(&b) {
            continue;
        }
        tracing::debug!(
            block = b.id.0,
            bytes = b.bytes,
            "evicted a pool block for pool room"
        );
        log.push(eviction_event(&b));
        if manager.pool_holds(backend, ask.required)? {
            break;
        }
    }
    Ok(())
}

/// Whether `ask` fits as the device stands: the staging pool holds its required weights
/// (where they go there) and the request fits, without releasing or evicting anything.
pub(crate) fn fits_as_is<M: DeviceResidencyManager>(
    manager: &M,
    ask: &CapacityAsk<'_>,
) -> Result<bool> {
    let backend = ask.request.backend;
    let pooled = !ask.required.is_empty() && manager.staging_pool(backend).is_some();
    if pooled && !manager.pool_holds(backend, ask.required)? {
        return Ok(false);
    }
    let mut request = ask.request;
    if ask.pending_unless_pooled && pooled {
        request.pending_bytes = 0;
    }
    Ok(manager
        .inspect_compute_backend_capacity(&request, ask.required)?
        .fits(false))
}

/// Makes room for `ask` (see the module documentation). `others` are the engine's other
/// sessions (the asking one is not among them).
pub(crate) fn ensure_capacity<M: DeviceResidencyManager>(
    manager: &mut M,
    others: &mut BTreeMap<SessionId, ExecutionSession>,
    ask: &CapacityAsk<'_>,
    log: &mut Vec<ReclaimEvent>,
) -> Result<()> {
    let _span = tracing::debug_span!("ensure_capacity", what = %ask.what, pending = ask.request.pending_bytes).entered();
    // 0. The staging pool: the plan counts the required weights in it, so blocks left in
    // it by earlier segments make room for them even when buffers of their own would fit
    // (those would sit next to a pool that keeps its bytes, and later segments would not
    // find the budget the plan gave them).
    make_pool_room(manager, ask, log)?;
    let mut request = ask.request;
    if ask.pending_unless_pooled
        && !ask.required.is_empty()
        && manager.staging_pool(request.backend).is_some()
        && manager.pool_holds(request.backend, ask.required)?
    {
        request.pending_bytes = 0;
    }
    let check =
        |m: &M, after: bool| -> Result<(bool, sd_residency::capacity::DeviceMemoryCapacity)> {
            let cap = m.inspect_compute_backend_capacity(&request, ask.required)?;
            Ok((cap.fits(after), cap))
        };
    let (fits, cap) = check(manager, false)?;
    if fits {
        return Ok(());
    }
    if cap.valid {
        // 2. Other sessions' idle workspaces.
        for (id, s) in others.iter_mut() {
            if !s.uses_backend(ask.request.backend) {
                continue;
            }
            let bytes = s.release_idle(manager, ask.request.backend);
            if bytes == 0 {
                continue;
            }
            tracing::debug!(session = %id, bytes, "released idle workspace");
            log.push(ReclaimEvent::ReleasedWorkspace {
                session: *id,
                bytes,
            });
            if check(manager, true)?.0 {
                return Ok(());
            }
        }
        // Another session's staging pool.
        if let Some((owner, bytes)) = manager.staging_pool(ask.request.backend) {
            if owner != ask.request.owner
                && manager
                    .set_staging_pool(owner, ask.request.backend, None)
                    .is_ok()
            {
                let session = SessionId(owner.0);
                tracing::debug!(session = %session, bytes, "released staging pool");
                log.push(ReclaimEvent::ReleasedStagingPool { session, bytes });
                if check(manager, true)?.0 {
                    return Ok(());
                }
            }
        }
        // 3. Weight blocks.
        let candidates = candidates(manager, ask);
        tracing::debug!(
            candidates = candidates.len(),
            pooled = candidates.iter().filter(|b| b.pooled).count(),
            bytes = candidates.iter().map(|b| b.bytes).sum::<u64>(),
            required = ask.required.len(),
            "eviction candidates"
        );
        // 4. One at a time. A block of a staging pool frees no device memory: it is
        // passed over while the request is short of more than pool room (and taken up
        // again after other evictions made the device room).
        let mut pass = candidates;
        loop {
            let mut skipped = Vec::new();
            let mut evicted = false;
            for b in pass {
                if b.pooled && !manager.fits_with_pool_room(&request, ask.required)? {
                    skipped.push(b);
                    continue;
                }
                if !manager.evict_compute_backend_block(&b) {
                    continue;
                }
                evicted = true;
                tracing::debug!(
                    block = b.id.0,
                    bytes = b.bytes,
                    demoted = b.requires_demotion,
                    "evicted weight block"
                );
                log.push(eviction_event(&b));
                if check(manager, true)?.0 {
                    return Ok(());
                }
            }
            if !evicted || skipped.is_empty() {
                break;
            }
            pass = skipped;
        }
    }
    // 5. Fail. (Debug, not a warning: callers recover from most of these, a prefetch by
    // skipping it, a segment by dropping prefetches or resident weights first; one they
    // cannot recover from reaches the user as the error below.)
    let cap = manager.inspect_compute_backend_capacity(&request, ask.required)?;
    tracing::debug!(
        what = %ask.what,
        needed_device = cap.required_device_bytes,
        available_device = cap.available_device_bytes,
        needed_budget = cap.required_budget_bytes,
        available_budget = cap.available_budget_bytes,
        "not enough memory"
    );
    Err(ExecError::Capacity {
        what: ask.what.clone(),
        backend: ask.backend_name.clone(),
        needed_device: cap.required_device_bytes,
        available_device: cap.available_device_bytes,
        needed_budget: cap.required_budget_bytes,
        available_budget: cap.available_budget_bytes,
        budget: ask.request.max_backend_bytes,
    })
}

/// Sorts eviction candidates (stable): no demotion first; preferred-order position
/// (unordered after ordered); oldest last use first.
pub(crate) fn sort_candidates(blocks: &mut [WeightResidencyBlock], preferred: EvictionOrder<'_>) {
    let key = |b: &WeightResidencyBlock| {
        let position = b
            .params
            .iter()
            .map(|p| preferred.position(*p))
            .try_fold(0usize, |acc, p| p.map(|p| acc.max(p)))
            .unwrap_or(usize::MAX);
        (b.requires_demotion, position, b.last_use_epoch)
    };
    blocks.sort_by_cached_key(key);
}

#[cfg(test)]
mod tests {
    use super::*;
    use sd_residency::BackendId;

    fn block(id: u64, params: &[u64], epoch: u64, demote: bool) -> WeightResidencyBlock {
        WeightResidencyBlock {
            id: BlockId(id),
            backend: BackendId(1),
            params: params.iter().map(|p| ParamId(*p)).collect(),
            bytes: 100,
            last_use_epoch: epoch,
            requires_demotion: demote,
            pooled: false,
        }
    }

    #[test]
    fn candidates_sort_by_demotion_order_and_age() {
        let mut v = vec![
            block(1, &[9], 1, false),    // unordered, old
            block(2, &[1], 5, false),    // order position 1
            block(3, &[0], 9, false),    // order position 0
            block(4, &[0, 9], 0, false), // member outside order: unordered
            block(5, &[2], 0, true),     // demotion last
            block(6, &[8], 0, false),    // unordered, oldest
        ];
        // Segment 2 asks: segment 1 (param 0) comes first, then segment 0 (param 1); param
        // 2 is used by segment 2 only, 8 and 9 by no segment.
        let uses = SegmentUses::new(&[vec![ParamId(1)], vec![ParamId(0)], vec![ParamId(2)]]);
        sort_candidates(&mut v, uses.order(2));
        let ids: Vec<u64> = v.iter().map(|b| b.id.0).collect();
        assert_eq!(ids, [3, 2, 4, 6, 1, 5]);
    }
}
