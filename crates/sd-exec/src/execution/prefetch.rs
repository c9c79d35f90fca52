//! Step 7: the missing weights of the segments after the current one, scheduled in
//! segment order while they fit next to every segment in between (see
//! [`RoomMode`] for what a prefetch may evict).

use super::*;

impl<M: DeviceResidencyManager> Exec<'_, M> {
    /// Best effort, while segment `k` is about to compute: extends the queue of
    /// prefetches to the segments after it, in order, up to
    /// [`StreamingOptions::prefetch_depth`](crate::StreamingOptions::prefetch_depth) segments ahead of `k`, stopping at the first
    /// that does not fit now. The manager copies them on the device's copy stream or on
    /// transfer threads while the segments before them compute. With [`RoomMode::AsIs`],
    /// stops at the first that would need an eviction, with [`RoomMode::EvictOrLater`] at
    /// the first without room beside the segments in flight, and returns `true`
    /// (deferred). Timed as [`ExecTiming::prefetch`].
    #[allow(clippy::too_many_arguments)]
    pub(super) fn timed_prefetches(
        &mut self,
        task: &ComputeTask,
        p: &Prepared,
        k: usize,
        store_bytes: u64,
        resident: &HashSet<ParamId>,
        queued: &mut VecDeque<(usize, Vec<ParamId>)>,
        mode: RoomMode,
        timing: &mut ExecTiming,
    ) -> bool {
        let t = Instant::now();
        let depth = self.session.config.streaming.prefetch_depth.max(1);
        let n = p.plan.segments.len();
        // Targets from `n` on are the next pass's segments `target - n`.
        let streaming = &self.session.config.streaming;
        let next_pass = if streaming.next_pass_prefetch {
            streaming.next_pass_segments.min(n.saturating_sub(2))
        } else {
            0
        };
        let per_segment = streaming.prefetches_per_segment.max(1);
        let last = k.saturating_add(depth).min(n - 1 + next_pass);
        let first = queued.back().map_or(k, |(t, _)| *t) + 1;
        let mut scheduled = 0;
        let mut deferred = false;
        for target in first..=last {
            if p.segment_params[target % n].is_empty() {
                continue;
            }
            // The next pass's segments evict only where a resident set is kept: every other
            // weight there streams through the pool each pass, evicted before its next use
            // anyway. Without one, weights kept from pass to pass would go for them (the
            // best victims, the segments still to run, are protected), and stream again.
            let mode = if target >= n && resident.is_empty() {
                RoomMode::AsIs
            } else {
                mode
            };
            match self.enqueue_prefetch(task, p, k, target, store_bytes, resident, mode) {
                Prefetch::Scheduled(ids) => {
                    queued.push_back((target, ids));
                    scheduled += 1;
                    // Each segment extends the queue by a bounded number of targets: the
                    // scheduling is host work the segment's compute waits for.
                    if scheduled == per_segment {
                        break;
                    }
                }
                Prefetch::Resident => {}
                Prefetch::NoRoom => break,
                Prefetch::Later => {
                    deferred = true;
                    break;
                }
            }
        }
        timing.prefetch += t.elapsed();
        deferred
    }

    /// Schedules the missing weights of segment `target` (after `k`) on its device now if
    /// they fit next to the segments `k..target` and the resident set (evicting only what
    /// the policy allows, never a weight of those; see [`RoomMode`] for when it is
    /// [`Prefetch::Later`]).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn enqueue_prefetch(
        &mut self,
        task: &ComputeTask,
        p: &Prepared,
        k: usize,
        target: usize,
        store_bytes: u64,
        resident: &HashSet<ParamId>,
        mode: RoomMode,
    ) -> Prefetch {
        let n = p.plan.segments.len();
        // A target from `n` on is segment `target - n` of the next pass.
        let (segment, next_pass) = (target % n, target >= n);
        let current: HashSet<ParamId> = p.segment_params[k].iter().copied().collect();
        let groups = split_groups(&p.segment_groups[segment], resident);
        // In the order they are prefetched (one call per group).
        let missing: Vec<ParamId> = groups
            .iter()
            .flatten()
            .copied()
            .filter(|x| !current.contains(x))
            .collect();
        if missing.is_empty() {
            return Prefetch::Resident;
        }
        let td = p.segment_device[segment];
        // Every segment from `k` to the target keeps its weights, and the resident set. A
        // prefetch beyond the next segment evicts only weights already used this step
        // (needed again next step at the earliest): evicting one still to come would
        // stream it twice; unless `evict_later_uses`, where those of segments after the
        // target may go too (furthest next use first).
        let later_uses = self.session.config.streaming.evict_later_uses && !next_pass;
        let keep_until = if target > k + 1 && !later_uses {
            n - 1
        } else {
            target
        };
        let mut protected: Vec<ParamId> = p.segment_params[k..=keep_until.min(n - 1)].concat();
        protected.extend(resident.iter().copied());
        // The segments between `k` and the target: the rest of this pass, then the next
        // pass's up to the target.
        let between: Vec<&sd_graphcut::Segment> = if next_pass {
            p.plan.segments[k + 1..]
                .iter()
                .chain(&p.plan.segments[..=segment])
                .collect()
        } else {
            p.plan.segments[k + 1..=target].iter().collect()
        };
        // On the current device the segment's outputs are still to be stored; and the
        // workspace growth of the segments up to the target is left free (a prefetch must
        // not take it), and for a target further than the next segment, the growth of the
        // cut cache in between.
        let ws = &self.session.slots[td].workspace;
        let buft = ws.buffer_type();
        let growth = between
            .iter()
            .map(|s| buft.footprint(s.bytes.compute_buffer as u64))
            .max()
            .unwrap_or(0)
            .saturating_sub(ws.bytes());
        let held_cuts = p.plan.segments[k].bytes.future_cuts as u64;
        let cut_growth = between
            .iter()
            .skip(1)
            .map(|s| {
                (s.bytes.live_cuts as u64 + p.granularity * s.live_cuts.len() as u64)
                    .saturating_sub(held_cuts)
            })
            .max()
            .unwrap_or(0);
        let pending = if td == p.segment_device[k] {
            store_bytes + growth + cut_growth
        } else {
            growth + cut_growth
        };
        let request = self.request(td, pending);
        let backend_name = self.session.slots[td].backend.name().to_string();
        let preferred = p.segment_uses.order(segment);
        let pass = if next_pass { "the next " } else { "" };
        let ask = CapacityAsk {
            what: format!(
                "prefetch for segment {segment} of {pass}'{}'",
                task.description
            ),
            backend_name,
            request,
            required: &missing,
            preferred,
            protected: &protected,
            pending_unless_pooled: true,
        };
        if mode == RoomMode::AsIs && !fits_as_is(self.manager, &ask).unwrap_or(false) {
            tracing::trace!(target, "prefetch deferred: it needs an eviction");
            return Prefetch::Later;
        }
        let evicts =
            mode == RoomMode::EvictOrLater && !fits_as_is(self.manager, &ask).unwrap_or(false);
        let ok = ensure_capacity(self.manager, self.others, &ask, self.log);
        if ok.is_ok() && evicts {
            self.session.evicting_prefetches += 1;
        }
        if ok.is_err() {
            if mode == RoomMode::EvictOrLater {
                // The segments in flight hold the rest (their weights are pinned, and the
                // staging pool may have no free run long enough beside them).
                tracing::trace!(
                    target,
                    "prefetch deferred: no room beside the segments in flight"
                );
                return Prefetch::Later;
            }
            tracing::debug!(target, "prefetch skipped: no room");
            return Prefetch::NoRoom;
        }
        // One call per usage group, as for prepare.
        let owner = self.session.id.owner();
        let mut scheduled: Vec<ParamId> = Vec::new();
        let mut resident = true;
        for group in &groups {
            let group: Vec<ParamId> = group
                .iter()
                .copied()
                .filter(|x| !current.contains(x))
                .collect();
            if group.is_empty() {
                continue;
            }
            match self.manager.prefetch_params(owner, &group) {
                WeightPrefetchResult::Scheduled => scheduled.extend_from_slice(&group),
                WeightPrefetchResult::AlreadyResident => {}
                other => {
                    resident = false;
                    tracing::debug!(target, result = ?other, "prefetch not scheduled");
                }
            }
        }
        if !scheduled.is_empty() {
            Prefetch::Scheduled(scheduled)
        } else if resident {
            Prefetch::Resident
        } else {
            Prefetch::NoRoom
        }
    }
}

/// Segment usage groups (see [`Prepared::segment_groups`]), each split into its part in
/// the run's resident set and the rest: one prepare or prefetch call each, so that no
/// staging block mixes weights the run keeps with weights it streams (a block is evicted
/// whole).
pub(super) fn split_groups(
    groups: &[Vec<ParamId>],
    resident: &HashSet<ParamId>,
) -> Vec<Vec<ParamId>> {
    if resident.is_empty() {
        return groups.to_vec();
    }
    let mut out = Vec::with_capacity(groups.len() * 2);
    for g in groups {
        let (kept, streamed): (Vec<ParamId>, Vec<ParamId>) =
            g.iter().partition(|id| resident.contains(id));
        out.extend([kept, streamed].into_iter().filter(|g| !g.is_empty()));
    }
    out
}

/// How a prefetch pass may make room (see [`StreamingOptions::evict_in_flight`](crate::StreamingOptions::evict_in_flight)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum RoomMode {
    /// Evict as the policy allows; no room is final for this pass.
    Evict,
    /// Only what fits as the device stands: a prefetch that needs an eviction is
    /// [`Prefetch::Later`].
    AsIs,
    /// Evict as the policy allows (never a pinned weight); no room beside the segments in
    /// flight is [`Prefetch::Later`].
    EvictOrLater,
}

/// What asking to prefetch one segment's weights came to.
pub(super) enum Prefetch {
    /// Copies in flight for these parameters.
    Scheduled(Vec<ParamId>),
    /// Nothing to copy: its weights are on the device or on their way.
    Resident,
    /// No room (or the manager could not schedule them): later segments wait too.
    NoRoom,
    /// Not scheduled now: it would need an eviction while a segment is in flight.
    Later,
}
