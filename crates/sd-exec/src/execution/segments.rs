//! The segment loop (steps 1-5 of the module documentation of `execution`): per segment,
//! the cut cache pruned, the workspace sized, the prefetched weights activated, room made
//! and the weights prepared; then the segment handed to `compute.rs` (steps 6-8, the
//! prefetches of step 7 through `prefetch.rs`).

use super::prefetch::split_groups;
use super::*;

impl<M: DeviceResidencyManager> Exec<'_, M> {
    /// The segment loop of [`run_plan`](Self::run_plan). With `in_flight` (asynchronous
    /// compute), the segments still queued are left in it, not waited for.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn run_segments(
        &mut self,
        task: &ComputeTask,
        p: &Prepared,
        inputs: &HostInputs<'_>,
        segmented: bool,
        resident: &HashSet<ParamId>,
        prefetch_on: bool,
        mut in_flight: Option<&mut VecDeque<InFlight>>,
        timing: &mut ExecTiming,
    ) -> Result<Vec<SegmentReport>> {
        let plan = &p.plan;
        let owner = self.session.id.owner();
        let mut reports = Vec::with_capacity(plan.segments.len());
        // The prefetches in flight, (target segment, params), in segment order.
        let mut queued: VecDeque<(usize, Vec<ParamId>)> = VecDeque::new();
        let mut outputs_so_far: Vec<CutName> = Vec::new();

        for (k, seg) in plan.segments.iter().enumerate() {
            let _span = tracing::debug_span!("segment", index = k, name = %seg.name).entered();
            let prepared_at = Instant::now();
            let d = p.segment_device[k];
            let buft = self.session.slots[d].backend.buffer_type();
            let backend_name = self.session.slots[d].backend.name().to_string();
            let what = if segmented {
                format!("segment {k} '{}' of '{}'", seg.name, task.description)
            } else {
                format!("whole graph '{}'", task.description)
            };
            outputs_so_far.extend(
                seg.outputs
                    .iter()
                    .filter(|o| o.graph_output)
                    .map(|o| o.name.clone()),
            );
            // The segments in flight still read their cuts: they go when each is done.
            let still_read: Vec<CutName> = in_flight
                .as_deref()
                .into_iter()
                .flatten()
                .flat_map(|f| f.dead.iter().cloned())
                .collect();
            for slot in &mut self.session.slots {
                slot.cut_cache.retain(|n| {
                    seg.live_cuts.contains(n)
                        || outputs_so_far.contains(n)
                        || still_read.contains(n)
                });
            }
            // Cuts this segment reads that another device holds (layer split boundaries).
            let imports: Vec<(CutName, GTensor)> = seg
                .consumed_cuts
                .iter()
                .filter(|n| !self.session.slots[d].cut_cache.contains(n))
                .filter_map(|n| {
                    self.session
                        .slots
                        .iter()
                        .find_map(|s| s.cut_cache.get(n))
                        .map(|t| (n.clone(), t.clone()))
                })
                .collect();
            let import_bytes: u64 = imports.iter().map(|(_, t)| buffer_bytes(buft, t)).sum();
            let params = &p.segment_params[k];
            let compute = buft.footprint(seg.bytes.compute_buffer as u64);
            // New cut-cache buffers for the outputs it keeps (spares of the same layout
            // are reused, see `CutCache::room_for`).
            let kept_outputs: Vec<&GTensor> = seg
                .outputs
                .iter()
                .filter(|o| o.graph_output || seg.future_cuts.contains(&o.name))
                .filter(|o| !self.session.slots[d].cut_cache.contains(&o.name))
                .map(|o| &p.graph.node_tensors()[o.node])
                .collect();
            // A workspace too small for this segment is released: not under the one in
            // flight.
            let ws = &self.session.slots[d].workspace;
            if !ws.is_released() && ws.bytes() < compute {
                self.settle_in_flight(&mut in_flight, timing)?;
            }
            // (Spares past the limit are freed here unless a segment is in flight.)
            let mut store_bytes = self.session.slots[d].cut_cache.room_for(&kept_outputs);
            let held = self.session.slots[d].workspace.prepare(compute);
            self.session.sync(self.manager);

            // Prefetched weights for this segment become current.
            let mut prefetched = false;
            let t = Instant::now();
            let wait_before = timing.wait;
            // (Targets are always later segments: none is ever behind `k`.)
            while queued.front().is_some_and(|(target, _)| *target < k) {
                queued.pop_front();
            }
            if queued.front().is_some_and(|(target, _)| *target == k) {
                if let Some((_, ids)) = queued.pop_front() {
                    prefetched = self.manager.activate_prefetched_params(owner, &ids)?;
                }
            }
            timing.wait += t.elapsed();
            let prefetch_wait = timing.wait - wait_before;

            let mut pending = compute.saturating_sub(held) + store_bytes + import_bytes;
            let preferred = p.segment_uses.order(k);
            // In the order they are prepared (a staging pool is checked placing them so).
            let groups = split_groups(&p.segment_groups[k], resident);
            let ordered: Vec<ParamId> = groups.iter().flatten().copied().collect();
            // The resident set is kept too, unless the segment does not fit otherwise.
            let keep: Vec<ParamId> = ordered.iter().chain(resident).copied().collect();
            let t = Instant::now();
            // The segments in flight hold their weights and the cuts only they read: a
            // segment that needs room waits for them first, oldest first, so that it
            // evicts what it would have without them (and their cut entries become spares
            // this one may take).
            let mut settled = false;
            while let Some(q) = in_flight.as_deref_mut().filter(|q| !q.is_empty()) {
                let ask = segment_ask(
                    &what,
                    &backend_name,
                    self.request(d, pending),
                    &ordered,
                    preferred,
                    &keep,
                );
                if fits_as_is(self.manager, &ask)? {
                    break;
                }
                tracing::debug!(
                    segment = k,
                    in_flight = q.len(),
                    "waiting for the oldest segment in flight for room"
                );
                self.settle_oldest(q, false, timing)?;
                settled = true;
            }
            if settled {
                store_bytes = self.session.slots[d].cut_cache.room_for(&kept_outputs);
                pending = compute.saturating_sub(held) + store_bytes + import_bytes;
            }
            let room_for = |this: &mut Self, pending: u64, protected: &[ParamId]| {
                let a = segment_ask(
                    &what,
                    &backend_name,
                    this.request(d, pending),
                    &ordered,
                    preferred,
                    protected,
                );
                ensure_capacity(this.manager, this.others, &a, this.log)
            };
            let out_of_memory = |r: &Result<()>| matches!(r, Err(e) if e.is_out_of_memory());
            let mut room = room_for(self, pending, &keep);
            // Prefetches for later segments hold room this one needs: they go first (the
            // plan counted each segment alone, not with the queue ahead of it).
            if out_of_memory(&room) && !queued.is_empty() {
                tracing::debug!(
                    segment = k,
                    queued = queued.len(),
                    "dropping prefetches for room"
                );
                self.manager.clear_prefetched_params(owner);
                queued.clear();
                room = room_for(self, pending, &keep);
            }
            if out_of_memory(&room) && !resident.is_empty() {
                tracing::debug!(
                    segment = k,
                    "no room next to the resident set: evicting from it"
                );
                room = room_for(self, pending, &ordered);
            }
            // The workspace kept from a larger segment is more than this one needs (the
            // plan counts this segment's own): give it back and ask again.
            if out_of_memory(&room) && held > compute {
                tracing::debug!(held, compute, "releasing the larger workspace for room");
                self.session.slots[d].workspace.release();
                self.session.sync(self.manager);
                room = room_for(self, compute + store_bytes + import_bytes, &ordered);
            }
            room?;
            timing.capacity += t.elapsed();
            if !imports.is_empty() {
                self.settle_in_flight(&mut in_flight, timing)?;
            }
            for (name, t) in &imports {
                self.session.slots[d].cut_cache.store(name, t)?;
            }
            // One call per usage group (see `Prepared::segment_groups`).
            let t = Instant::now();
            self.session.pinned_now.clear();
            for group in &groups {
                if let Err(e) = self.manager.prepare_params(group) {
                    let pinned = std::mem::take(&mut self.session.pinned_now);
                    if let Err(u) = self.manager.unpin_params(&pinned) {
                        tracing::warn!(error = %u, "unpinning after a failed prepare");
                    }
                    return Err(e.into());
                }
                self.session.pinned_now.extend_from_slice(group);
            }
            let staging = t.elapsed();
            timing.staging += staging;
            // From here on the segment's weights are pinned: unpin whatever happens (or
            // when the segment is done, if it is left in flight).
            let evicting_before = self.session.evicting_prefetches;
            let r = self.compute_segment(
                task,
                p,
                k,
                inputs,
                prefetch_on.then_some(resident),
                &mut queued,
                store_bytes,
                in_flight.as_deref_mut(),
                timing,
            );
            let pinned = std::mem::take(&mut self.session.pinned_now);
            let queued_now = matches!(&r, Ok(c) if c.queued);
            let pins = pinned.len();
            let unpinned = if queued_now {
                self.session.pinned_in_flight.extend(pinned);
                Ok(())
            } else {
                self.manager.unpin_params(&pinned)
            };
            let mut done = r?;
            unpinned?;
            if self.session.config.streaming.reuse_graphs {
                let direct = std::mem::take(&mut done.direct);
                self.session.slots[d]
                    .workspace
                    .keep_graph(plan.fingerprint, k, direct);
            } else {
                self.session.slots[d].workspace.end_graph();
            }
            let keep = |n: &CutName| seg.future_cuts.contains(n) || outputs_so_far.contains(n);
            match in_flight.as_deref_mut() {
                Some(q) if queued_now => {
                    // Dropped when the segment is done (see `settle`).
                    let dead: Vec<CutName> = self.session.slots[d]
                        .cut_cache
                        .names()
                        .filter(|n| !keep(n))
                        .cloned()
                        .collect();
                    // No cut-cache buffer is freed under it (see `CutCache::hold_frees`).
                    self.session.slots[d].cut_cache.hold_frees(true);
                    q.push_back(InFlight {
                        index: k,
                        device: d,
                        dead,
                        pins,
                        done: done.event.take(),
                    });
                }
                _ => {
                    for slot in &mut self.session.slots {
                        slot.cut_cache.retain(keep);
                    }
                }
            }
            self.session.sync(self.manager);
            reports.push(SegmentReport {
                index: k,
                name: seg.name.clone(),
                device: d,
                params: params.len(),
                weight_bytes: p.segment_weight_bytes[k],
                compute_bytes: compute,
                cache_bytes: done.cache_bytes,
                spare_bytes: self.session.slots[d]
                    .cut_cache
                    .bytes()
                    .saturating_sub(self.session.slots[d].cut_cache.entry_bytes())
                    as u64,
                copied_bytes: import_bytes,
                prefetched,
                prefetches_ahead: queued.len(),
                direct_outputs: done.direct_outputs,
                graph_reused: done.graph_reused,
                graph_unmoved: done.graph_unmoved,
                overlapped: done.overlapped,
                queued_behind: done.queued_behind,
                held_for_in_flight: done.held_for_in_flight,
                evicting_prefetches: self.session.evicting_prefetches - evicting_before,
                prefetch_wait,
                times: SegmentTimes {
                    prepared: prepared_at,
                    staging,
                    launched: done.launched,
                    returned: done.returned,
                    done: (!queued_now).then_some(done.returned),
                },
            });
        }
        // Prefetches for the next pass stay, staged; any other left over goes.
        let n = plan.segments.len();
        let next_pass: Vec<ParamId> = queued
            .iter()
            .filter(|(target, _)| *target >= n)
            .flat_map(|(_, ids)| ids.iter().copied())
            .collect();
        if !next_pass.is_empty() {
            let t = Instant::now();
            self.manager.activate_prefetched_params(owner, &next_pass)?;
            timing.wait += t.elapsed();
        }
        if queued.iter().any(|(target, _)| *target < n) {
            self.manager.clear_prefetched_params(owner);
        }
        Ok(reports)
    }
}

/// The capacity a segment asks for: room for `required` (its weights) and the request's
/// pending bytes, never evicting `protected`.
pub(super) fn segment_ask<'a>(
    what: &str,
    backend_name: &str,
    request: BackendMemoryRequest,
    required: &'a [ParamId],
    preferred: EvictionOrder<'a>,
    protected: &'a [ParamId],
) -> CapacityAsk<'a> {
    CapacityAsk {
        what: what.to_string(),
        backend_name: backend_name.to_string(),
        request,
        required,
        preferred,
        protected,
        pending_unless_pooled: false,
    }
}
