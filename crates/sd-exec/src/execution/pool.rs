//! The staging pool of a segmented run: its size under the limit, allocated once and kept
//! from step to step, so that streamed weights are sub-allocated instead of allocated and
//! freed inside a step.

use super::*;

impl<M: DeviceResidencyManager> Exec<'_, M> {
    /// The staging pool plan `p` runs with (see [`sd_residency::DeviceResidencyManager::set_staging_pool`]):
    /// `None` unless it is segmented under a limit on one device other than the CPU, with
    /// [`StreamingOptions::staging_pool`](crate::StreamingOptions::staging_pool) on. Its size is
    /// the limit less the largest non-weight need of a segment (workspace, live cuts,
    /// outputs, the runner cache) and a 1/64 slack for what the plan does not see (ggml
    /// rounding in the compute buffer), at most the plan's weight bytes; `None` too when
    /// that does not hold the largest segment's weights (the segments then stage into
    /// buffers of their own, as without a pool).
    pub(crate) fn staging_pool_size(&self, p: &Prepared, segmented: bool) -> Option<u64> {
        let (size, nonweight) = self.staging_pool_room(p, segmented)?;
        let largest = p.segment_weight_bytes.iter().copied().max()?;
        if size == 0 || size < largest {
            tracing::debug!(
                nonweight,
                largest,
                size,
                "no staging pool: it would not hold the largest segment's weights"
            );
            return None;
        }
        Some(size)
    }

    /// The room plan `p` leaves for a staging pool (see
    /// [`staging_pool_size`](Self::staging_pool_size)), whether or not it holds the
    /// largest segment's weights, and the largest non-weight need it leaves it beside;
    /// `None` where no pool is used.
    pub(crate) fn staging_pool_room(&self, p: &Prepared, segmented: bool) -> Option<(u64, u64)> {
        let extra = self.stable_cuts_plan(p).map_or(0, |(extra, _)| extra);
        self.staging_pool_room_with(p, segmented, extra)
    }

    /// [`staging_pool_room`](Self::staging_pool_room) leaving `extra` bytes beside the
    /// segments' needs (the stable cuts' spares).
    fn staging_pool_room_with(
        &self,
        p: &Prepared,
        segmented: bool,
        extra: u64,
    ) -> Option<(u64, u64)> {
        let cfg = &self.session.config;
        if !segmented
            || !cfg.streaming.staging_pool
            || self.session.is_layer_split()
            || cfg.backend.is_cpu()
        {
            return None;
        }
        let limit = self.segment_limit()?;
        let nonweight = (0..p.plan.segments.len())
            .map(|k| {
                let d = crate::refine::segment_plan(p, k);
                tracing::trace!(
                    segment = k,
                    name = %d.name,
                    need = d.need,
                    weights = d.weight_bytes,
                    compute = d.compute_bytes,
                    cuts = d.cut_bytes,
                    "segment need"
                );
                d.need.saturating_sub(d.weight_bytes)
            })
            .max()?
            .saturating_add(self.session.slots[0].runner_cache.bytes() as u64)
            .saturating_add(extra);
        let weights: u64 = p.param_bytes.values().sum();
        let size = limit
            .saturating_sub(nonweight)
            .saturating_sub(limit / 64)
            .min(weights);
        // Whole allocation units, so that the pool's footprint is its size.
        let g = self
            .session
            .config
            .backend
            .buffer_type()
            .allocation_granularity();
        let size = if size >= g { size / g * g } else { size };
        Some((size, nonweight))
    }

    /// Gives the session's device the staging pool `p` runs with (allocated once: a pool of
    /// the same size is kept from run to run), making room for it first; without one, frees
    /// the session's own pool. A pool that does not fit is skipped (best effort).
    pub(super) fn setup_staging_pool(
        &mut self,
        task: &ComputeTask,
        p: &Prepared,
        segmented: bool,
    ) -> Result<()> {
        let owner = self.session.id.owner();
        let backend = self.session.config.backend_id;
        let current = self.manager.staging_pool(backend);
        let Some(size) = self.staging_pool_size(p, segmented) else {
            if current.is_some_and(|(o, _)| o == owner) {
                self.manager.set_staging_pool(owner, backend, None)?;
            }
            return Ok(());
        };
        if current == Some((owner, size)) {
            return Ok(());
        }
        if let Some((o, _)) = current {
            self.manager.set_staging_pool(o, backend, None)?;
        }
        // A workspace kept from a larger graph would not leave the pool its room.
        let ws = &mut self.session.slots[0].workspace;
        if ws.bytes()
            > ws.buffer_type()
                .footprint(p.plan.max_compute_buffer() as u64)
        {
            ws.release();
            self.session.sync(self.manager);
        }
        let request = self.request(0, size);
        let room = ensure_capacity(
            self.manager,
            self.others,
            &CapacityAsk {
                what: format!("staging pool of '{}'", task.description),
                backend_name: self.session.config.backend.name().to_string(),
                request,
                required: &[],
                preferred: p.segment_uses.order(0),
                protected: &[],
                pending_unless_pooled: false,
            },
            self.log,
        );
        if let Err(e) = room {
            tracing::debug!(size, error = %e, "no room for a staging pool: staging without one");
            return Ok(());
        }
        if let Err(e) = self.manager.set_staging_pool(owner, backend, Some(size)) {
            tracing::warn!(size, error = %e, "staging pool not allocated: staging without one");
        }
        Ok(())
    }

    /// The spare limit of the session's cut cache for plan `p` (see
    /// [`sd_graphcut::CutCache::set_spare_limit`]): with a staging pool of this session,
    /// the largest cut and output bytes of any segment (rounded per buffer), which the
    /// pool's size already leaves room for, so that entries removed between segments keep
    /// their buffers for the next step's same cuts; `None` otherwise.
    pub(crate) fn cut_spare_limit(&self, p: &Prepared) -> Option<u64> {
        let cfg = &self.session.config;
        if self.session.is_layer_split() {
            return None;
        }
        let (owner, _) = self.manager.staging_pool(cfg.backend_id)?;
        if owner != self.session.id.owner() {
            return None;
        }
        let extra = self.stable_cuts_plan(p).map_or(0, |(extra, _)| extra);
        Some(live_cut_limit(p)? + extra)
    }

    /// With kept segment graphs ([`StreamingOptions::reuse_graphs`](crate::StreamingOptions::reuse_graphs))
    /// and [`StreamingOptions::stable_cuts`](crate::StreamingOptions::stable_cuts) in a segmented run, the segments whose cuts the cut cache holds at once: the one
    /// being prepared and those still in flight (see [`stable_cuts`]); `None` otherwise.
    fn stable_cut_window(&self, p: &Prepared) -> Option<usize> {
        let cfg = &self.session.config;
        if p.plan.segments.len() < 2
            || !cfg.streaming.reuse_graphs
            || !cfg.streaming.stable_cuts
            || self.session.is_layer_split()
        {
            return None;
        }
        Some(if cfg.streaming.async_compute {
            cfg.streaming.segments_in_flight.max(1) + 1
        } else {
            1
        })
    }

    /// With stable cuts (see [`stable_cut_window`](Self::stable_cut_window)), the bytes
    /// the cut cache's spares need beyond [`live_cut_limit`] so that every cut finds the
    /// buffer it had the step before, and the spare quota that keeps them (see
    /// [`stable_cuts`] and [`sd_graphcut::CutCache::set_spare_quota`]): kept segment graphs
    /// then read and write the same addresses from step to step (which ggml's CUDA backend
    /// needs to replay them). The staging pool leaves the bytes room, so they are taken
    /// only while they cost it at most a quarter of its size (more streaming otherwise
    /// outweighs the replays); `None` otherwise.
    pub(crate) fn stable_cuts_plan(&self, p: &Prepared) -> Option<(u64, HashMap<usize, usize>)> {
        p.stable_cuts
            .get_or_init(|| self.compute_stable_cuts_plan(p))
            .clone()
    }

    fn compute_stable_cuts_plan(&self, p: &Prepared) -> Option<(u64, HashMap<usize, usize>)> {
        let window = self.stable_cut_window(p)?;
        let (bytes, quota) = stable_cuts(p, window, self.session.config.backend.buffer_type());
        let extra = bytes.saturating_sub(live_cut_limit(p).unwrap_or(0));
        if extra > 0 {
            let (pool, _) = self.staging_pool_room_with(p, true, 0)?;
            if extra > pool / 4 {
                tracing::debug!(extra, pool, "stable cuts would take too much of the pool");
                return None;
            }
        }
        Some((extra, quota))
    }

    /// The resident set of [`StreamingOptions::compute_aware_residency`](crate::StreamingOptions::compute_aware_residency):
    /// each segment streams at most its share ([`compute_shares`]) times the smallest scale
    /// at which the kept weights and the most any `window` consecutive segments stream fit
    /// `usable` bytes, and keeps its largest tensors past that. `None` (the caller falls back
    /// to equal caps) when the plan counts no work or no scale fits.
    fn compute_aware_set(
        &self,
        p: &Prepared,
        usable: u64,
        window: usize,
    ) -> Option<HashSet<ParamId>> {
        let nodes = p.graph.node_tensors();
        let flops: Vec<f64> = p
            .plan
            .segments
            .iter()
            .map(|seg| {
                seg.internal_nodes
                    .iter()
                    .chain(&seg.recomputed_nodes)
                    .filter_map(|&i| nodes.get(i))
                    .map(sd_tensor::ggml::node_flops)
                    .sum()
            })
            .collect();
        let shares = compute_shares(&flops)?;
        let w = &p.segment_weight_bytes;
        let mut m = smallest_fitting_scale(w, &shares, window, usable)?;
        let bytes = |id: &ParamId| p.param_bytes.get(id).copied().unwrap_or(0);
        // Whole tensors overshoot the caps: raise the scale until the set and its window
        // fit (a 64th of the largest segment's scale at a time).
        let top = full_scale(w, &shares);
        loop {
            let (set, each) = keep_above(&p.segment_params, |k| (shares[k] * m) as u64, bytes);
            let kept: u64 = set.iter().map(bytes).sum();
            if kept + window_bytes(&each, window) <= usable {
                tracing::debug!(
                    scale = m,
                    resident_bytes = kept,
                    streamed_bytes = each.iter().sum::<u64>(),
                    params = set.len(),
                    "compute-aware resident set"
                );
                return Some(set);
            }
            if m >= top {
                return None;
            }
            m = (m + top / 64.0).min(top);
        }
    }

    /// The weights a segmented run with a staging pool keeps on the device from step to
    /// step: protected from eviction (unless a segment does not fit otherwise) while the
    /// other weights stream through the rest of the pool, the streaming window, where
    /// prefetches run as far ahead as it has room. Without it, deep prefetches evict the
    /// weights used longest ago, the next step's first, and a sampling loop ends up
    /// streaming every weight every step.
    ///
    /// The window must hold the streamed part of the segment computing and of the next
    /// one, and of as many more as [`StreamingOptions::stream_window`](crate::StreamingOptions::stream_window)
    /// asks beyond two (a segment still in flight while the next one's prefetch runs). So
    /// every segment streams at most `m` bytes and keeps the rest of its weights resident,
    /// with the smallest `m` for which the resident weights and a window of `w m` fit the
    /// pool (less a 1/32 slack for placement), `w` the window of at least 2 segments: the
    /// fewest bytes streamed per step for that window. A segment's largest tensors are the ones it keeps. Empty
    /// without a pool of this session, with
    /// [`StreamingOptions::resident_set`](crate::StreamingOptions::resident_set) off, for a
    /// layer split, or when no window fits.
    pub(crate) fn resident_set(&self, p: &Prepared) -> HashSet<ParamId> {
        let cfg = &self.session.config;
        let n = p.plan.segments.len();
        if !cfg.streaming.resident_set || self.session.is_layer_split() || n < 2 {
            return HashSet::new();
        }
        let Some((owner, pool)) = self.manager.staging_pool(cfg.backend_id) else {
            return HashSet::new();
        };
        if owner != self.session.id.owner() {
            return HashSet::new();
        }
        let usable = pool_usable(pool);
        let window = cfg.streaming.stream_window.max(2) as u64;
        let w = &p.segment_weight_bytes;
        if cfg.streaming.compute_aware_residency {
            if let Some(set) = self.compute_aware_set(p, usable, window as usize) {
                return set;
            }
        }
        let Some(lo) = smallest_cap(w, window, usable) else {
            return HashSet::new();
        };
        let largest = w.iter().copied().max().unwrap_or(0);
        let bytes = |id: &ParamId| p.param_bytes.get(id).copied().unwrap_or(0);
        // Whole tensors overshoot the cap: raise it until the chosen set and its window
        // fit (a sixteenth of the largest segment at a time).
        let mut m = lo;
        let step = (largest / 16).max(1);
        let set = loop {
            let (set, each) = keep_above(&p.segment_params, |_| m, bytes);
            let streamed = each.iter().copied().max().unwrap_or(0);
            let kept: u64 = set.iter().map(bytes).sum();
            if kept + window * streamed <= usable {
                break set;
            }
            if m >= largest {
                return HashSet::new();
            }
            m = (m + step).min(largest);
        };
        tracing::debug!(
            pool,
            cap = m,
            resident_bytes = set.iter().map(bytes).sum::<u64>(),
            params = set.len(),
            "resident set"
        );
        set
    }
}

/// The most bytes of cut-cache entries any segment of plan `p` holds at once (its live
/// cuts and its outputs, each rounded up to the allocation granularity); `None` for a plan
/// without segments.
fn live_cut_limit(p: &Prepared) -> Option<u64> {
    (0..p.plan.segments.len())
        .map(|k| {
            let d = crate::refine::segment_plan(p, k);
            let seg = &p.plan.segments[k];
            let buffers = (seg.live_cuts.len() + seg.outputs.len()) as u64;
            d.cut_bytes + d.output_bytes + p.granularity.saturating_sub(1) * buffers
        })
        .max()
}

/// The cut-cache bytes a step of plan `p` needs for every cut to get back the buffer it
/// had in the step before: entries of one layout are interchangeable (a cut takes a
/// spare of its layout, the one it had last time first, see `CutCache`), so for each
/// entry size the most entries of that size held at once, summed over the sizes. Held at
/// once: the cuts live in `window` consecutive segments (segments still in flight keep the
/// cuts they read) and the graph's outputs (kept from one step to the next).
fn stable_cuts(p: &Prepared, window: usize, buft: BufferType) -> (u64, HashMap<usize, usize>) {
    let segs = &p.plan.segments;
    let mut bytes_of: HashMap<&CutName, usize> = HashMap::new();
    let mut outputs: HashSet<&CutName> = HashSet::new();
    for seg in segs {
        for o in &seg.outputs {
            bytes_of.insert(&o.name, o.bytes);
            if o.graph_output {
                outputs.insert(&o.name);
            }
        }
    }
    // An entry's buffer: its bytes aligned, in whole allocation units.
    let align = buft.alignment().max(1) as u64;
    let entry = |b: usize| buft.footprint((b as u64).div_ceil(align) * align);
    let mut peak: HashMap<usize, usize> = HashMap::new();
    for k in 0..segs.len() {
        let mut held: HashSet<&CutName> = outputs.clone();
        for seg in &segs[k.saturating_sub(window.max(1) - 1)..=k] {
            held.extend(seg.live_cuts.iter());
            held.extend(seg.outputs.iter().map(|o| &o.name));
        }
        let mut count: HashMap<usize, usize> = HashMap::new();
        for name in held {
            if let Some(&b) = bytes_of.get(name) {
                *count.entry(b).or_default() += 1;
            }
        }
        for (size, n) in count {
            let e = peak.entry(size).or_default();
            *e = (*e).max(n);
        }
    }
    let bytes = peak.iter().map(|(&size, &n)| entry(size) * n as u64).sum();
    (bytes, peak)
}

/// The bytes of a staging pool of `pool` bytes that streamed weights may fill: less a 1/32
/// slack for placement (sub-allocations are aligned, and freed regions are not always
/// contiguous).
pub(crate) fn pool_usable(pool: u64) -> u64 {
    pool - pool / 32
}

/// One segment's share of a staging pool of `pool` bytes whose streaming window is
/// `window` segments (see [`StreamingOptions::stream_window`](crate::StreamingOptions::stream_window)):
/// segments whose weights stay within it can be prefetched `window - 1` ahead.
pub(crate) fn window_share(pool: u64, window: usize) -> u64 {
    pool_usable(pool) / window.max(1) as u64
}

/// The smallest cap `m` such that the weights kept when each segment streams at most `m`
/// of its `weights` (shared weights counted once per segment: an upper bound), plus a
/// window of `window` segments streaming `m` each, fit `usable` bytes; `None` when no cap
/// does.
///
/// `f(m) = sum(max(w_k - m, 0)) + window m` is convex in `m`: its slope, `window` less the
/// segments over `m`, grows with `m`. So it is smallest at the `window`-th largest
/// segment's weights (0 with fewer segments) and falls until there; the smallest fitting
/// cap is found by bisection below that point. (Testing only the largest segment's weights,
/// as an earlier version did, misses the caps between: SD1.5 under 0.75 of its weights,
/// where three of its largest segments overfill the pool, ran with no resident set at all
/// and streamed 1.59 of its 1.72 GB a step.)
fn smallest_cap(weights: &[u64], window: u64, usable: u64) -> Option<u64> {
    let resident_at = |m: u64| weights.iter().map(|b| b.saturating_sub(m)).sum::<u64>();
    let fits = |m: u64| resident_at(m).saturating_add(window.saturating_mul(m)) <= usable;
    let mut sorted = weights.to_vec();
    sorted.sort_unstable_by(|a, b| b.cmp(a));
    let lowest = sorted
        .get((window as usize).saturating_sub(1))
        .copied()
        .unwrap_or(0);
    if !fits(lowest) {
        return None;
    }
    let (mut lo, mut hi) = (0u64, lowest);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if fits(mid) {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    Some(lo)
}

/// Per segment in order, the weights kept so that it streams at most `cap(k)` bytes: its
/// largest tensors while more than one is needed, then the smallest single tensor that
/// brings it under the cap (less overshoot than taking the largest). Returns the kept set
/// and each segment's streamed bytes.
fn keep_above(
    segments: &[Vec<ParamId>],
    cap: impl Fn(usize) -> u64,
    bytes: impl Fn(&ParamId) -> u64,
) -> (HashSet<ParamId>, Vec<u64>) {
    let mut set: HashSet<ParamId> = HashSet::new();
    let mut each = Vec::with_capacity(segments.len());
    for (k, params) in segments.iter().enumerate() {
        let cap = cap(k);
        let mut streamed: u64 = params
            .iter()
            .filter(|id| !set.contains(id))
            .map(&bytes)
            .sum();
        let mut by_size: Vec<ParamId> = params
            .iter()
            .copied()
            .filter(|id| !set.contains(id))
            .collect();
        by_size.sort_by_key(|id| std::cmp::Reverse(bytes(id)));
        let mut closing: Option<ParamId> = None;
        for id in by_size {
            if streamed <= cap {
                break;
            }
            let b = bytes(&id);
            if b > streamed - cap {
                // Would close the gap alone: remember the smallest such.
                closing = Some(id);
                continue;
            }
            streamed -= b;
            set.insert(id);
        }
        if streamed > cap {
            if let Some(id) = closing {
                streamed -= bytes(&id);
                set.insert(id);
            }
        }
        each.push(streamed);
    }
    (set, each)
}

/// The most bytes any `window` consecutive segments stream (cyclically: a sampling loop's
/// next step follows the last segment), given each segment's streamed bytes.
fn window_bytes(streamed: &[u64], window: usize) -> u64 {
    let n = streamed.len();
    (0..n)
        .map(|i| {
            (0..window.min(n))
                .map(|j| streamed[(i + j) % n])
                .sum::<u64>()
        })
        .max()
        .unwrap_or(0)
}

/// Each segment's share of the streamed bytes under
/// [`StreamingOptions::compute_aware_residency`](crate::StreamingOptions::compute_aware_residency):
/// in proportion to the work of the segment before it (cyclically), whose compute its
/// prefetch runs under; `None` when no segment computes anything counted.
pub(crate) fn compute_shares(flops: &[f64]) -> Option<Vec<f64>> {
    let n = flops.len();
    let mean = flops.iter().sum::<f64>() / n.max(1) as f64;
    (mean > 0.0).then(|| (0..n).map(|k| flops[(k + n - 1) % n] / mean).collect())
}

/// The scale at which every segment with a share streams all of its `weights`.
fn full_scale(weights: &[u64], shares: &[f64]) -> f64 {
    weights
        .iter()
        .zip(shares)
        .filter(|(_, &a)| a > 0.0)
        .map(|(&w, &a)| w as f64 / a)
        .fold(0.0f64, f64::max)
}

/// The smallest scale `m` (bytes of streamed weights per unit of share) for which the
/// weights kept when each segment streams at most `shares[k] m` of its `weights[k]`, plus
/// the most any `window` consecutive segments stream, fit `usable` bytes; searched over
/// 256 steps up to the scale at which every segment with a share streams all of its
/// weights. `None` when none fits.
pub(crate) fn smallest_fitting_scale(
    weights: &[u64],
    shares: &[f64],
    window: usize,
    usable: u64,
) -> Option<f64> {
    let top = full_scale(weights, shares);
    let fits = |m: f64| {
        let streamed: Vec<u64> = weights
            .iter()
            .zip(shares)
            .map(|(&w, &a)| w.min((a * m) as u64))
            .collect();
        let kept: u64 = weights.iter().zip(&streamed).map(|(w, s)| w - s).sum();
        kept + window_bytes(&streamed, window) <= usable
    };
    const STEPS: u32 = 256;
    (0..=STEPS)
        .map(|i| top * f64::from(i) / f64::from(STEPS))
        .find(|&m| fits(m))
}

#[cfg(test)]
mod tests {
    use super::{compute_shares, smallest_cap, smallest_fitting_scale, window_bytes};

    #[test]
    fn each_segment_streams_in_proportion_to_the_work_before_it() {
        // Segment 1 follows the heavy segment 0; segment 0 follows segment 2 (the next step).
        assert_eq!(compute_shares(&[4.0, 1.0, 1.0]), Some(vec![0.5, 2.0, 0.5]));
        assert_eq!(compute_shares(&[0.0, 0.0]), None);
        assert_eq!(window_bytes(&[1, 2, 3, 4], 2), 7);
        // The window wraps around: the last segment and the next step's first.
        assert_eq!(window_bytes(&[4, 0, 0, 4], 2), 8);
        assert_eq!(window_bytes(&[5, 1], 3), 6);
    }

    #[test]
    fn the_smallest_scale_keeps_the_most_that_fits() {
        let (w, shares) = ([100u64, 100, 100], [0.5, 2.0, 0.5]);
        // Everything fits resident: nothing streams.
        assert_eq!(smallest_fitting_scale(&w, &shares, 2, 300), Some(0.0));
        // Streaming [m/2, min(2m, 100), m/2] keeps 300 - the streamed bytes and needs a
        // window of two: 300 - m/2 <= 250 from m = 100 on (segment 1 streams all of its
        // weights, the others half).
        assert_eq!(smallest_fitting_scale(&w, &shares, 2, 250), Some(100.0));
        // Only everything streamed fits 200 (a window of two whole segments).
        assert_eq!(smallest_fitting_scale(&w, &shares, 2, 200), Some(200.0));
        assert_eq!(smallest_fitting_scale(&w, &shares, 2, 199), None);
    }

    #[test]
    fn the_smallest_cap_is_found_where_the_largest_segments_overfill_the_window() {
        // SD1.5's segments under 0.75 of its weights on an H100 (MB), a pool of 785 MB
        // usable and a window of three: three of the largest (280 + 233 + 197) overfill it,
        // yet a cap near 152 keeps about 328 MB resident and fits.
        let w = [99u64, 280, 125, 194, 197, 128, 168, 168, 233, 105, 24];
        let f = |m: u64| w.iter().map(|b| b.saturating_sub(m)).sum::<u64>() + 3 * m;
        let m = smallest_cap(&w, 3, 785).unwrap();
        assert!(f(m) <= 785 && f(m - 1) > 785, "cap {m}");
        assert!((150..=155).contains(&m), "cap {m}");
        // Everything resident fits: nothing streams.
        assert_eq!(smallest_cap(&w, 3, 1721), Some(0));
        // The bound is smallest at the third largest segment (197 a segment in the window
        // and 83 + 36 kept) and flat down to the fourth (194): the smallest such cap.
        assert_eq!(smallest_cap(&w, 3, 3 * 197 + 83 + 36), Some(194));
        assert_eq!(smallest_cap(&w, 3, 3 * 197 + 83 + 35), None);
        // Fewer segments than the window: nothing kept, the window holds them all.
        assert_eq!(smallest_cap(&[10, 20], 3, 30), Some(0));
        assert_eq!(smallest_cap(&[10, 20], 3, 29), None);
    }
}
