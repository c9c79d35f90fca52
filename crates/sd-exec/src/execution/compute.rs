//! Steps 6-8 of one segment: its graph built (or the kept one run again), allocated and
//! bound to the cached cuts, its host inputs written, the next segments' prefetches
//! scheduled (`prefetch.rs`), the uploads it needs waited for, computed (queued without
//! waiting where it can be), and its outputs stored.

use super::prefetch::RoomMode;
use super::*;

impl<M: DeviceResidencyManager> Exec<'_, M> {
    /// Steps 6-8 of segment `k` on its device. With `in_flight` (asynchronous compute),
    /// queues this one without waiting when all its kept outputs are computed into their
    /// cut-cache entries ([`SegmentDone::queued`]; the caller puts it in flight): its
    /// inputs are written in the device's queue behind the segments in flight (at most
    /// [`StreamingOptions::segments_in_flight`](crate::StreamingOptions::segments_in_flight) including it; the oldest are waited for
    /// first), or, with one segment at a time, after waiting for the one in flight.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn compute_segment(
        &mut self,
        task: &ComputeTask,
        p: &Prepared,
        k: usize,
        inputs: &HostInputs<'_>,
        prefetch: Option<&HashSet<ParamId>>,
        queued: &mut VecDeque<(usize, Vec<ParamId>)>,
        store_bytes: u64,
        mut in_flight: Option<&mut VecDeque<InFlight>>,
        timing: &mut ExecTiming,
    ) -> Result<SegmentDone> {
        let plan = &p.plan;
        let seg = &plan.segments[k];
        let d = p.segment_device[k];
        let kept_out = |o: &SegmentOutput| o.graph_output || seg.future_cuts.contains(&o.name);
        // Cut outputs that later segments or the caller read are computed straight into
        // their cut-cache entries (capacity for them was asked for as `store_bytes`); the
        // others are copied there after computing.
        let mut direct: HashSet<CutName> = HashSet::new();
        // The graph this segment ran last time runs again when nothing it is bound to
        // changed (see `StreamingOptions::reuse_graphs`): its outputs go into the same cut-cache
        // entries, the views of moved weights or cuts follow them.
        let slot = &mut self.session.slots[d];
        let mut reused = false;
        let t = Instant::now();
        if self.session.config.streaming.reuse_graphs {
            if let Some(before) = slot.workspace.take_reusable(plan.fingerprint, k) {
                let cache = &mut slot.cut_cache;
                reused = match slot.workspace.current() {
                    Some(sg) if sg.built_for(seg) && sg.reusable_for(&p.graph, cache, inputs) => {
                        let mut ok = true;
                        for (o, t) in sg.outputs() {
                            if before.contains(&o.name) && !cache.rebind_output(&o.name, t)? {
                                ok = false;
                                break;
                            }
                        }
                        ok
                    }
                    _ => false,
                };
                if reused {
                    direct.extend(before);
                } else {
                    slot.workspace.drop_current();
                }
            }
        }
        if reused {
            let Some(sg) = slot.workspace.current_mut() else {
                return Err(self.invalid(task, "the reused graph went missing"));
            };
            sg.retarget(&p.graph);
            sg.rebind_cuts(&slot.cut_cache)?;
            sg.rebase_views();
        }
        timing.allocate += t.elapsed();
        if !reused {
            slot.workspace.drop_current();
            let t = Instant::now();
            let sg = SegmentGraph::for_execution(&p.graph, plan, k, &slot.cut_cache, inputs)?;
            timing.build += t.elapsed();
            let t = Instant::now();
            for (o, t) in sg.outputs() {
                if kept_out(o)
                    && !direct.contains(&o.name)
                    && self.session.slots[d].cut_cache.bind_output(&o.name, t)?
                {
                    tracing::trace!(cut = %o.name, bytes = t.nbytes(), planned = o.bytes, "cut bound");
                    direct.insert(o.name.clone());
                }
            }
            // A buffer too small for this graph is freed and allocated again: not under
            // the segment in flight.
            if in_flight.as_deref().is_some_and(|q| !q.is_empty())
                && self.session.slots[d]
                    .workspace
                    .grows_for(&sg, plan.fingerprint, k)
            {
                tracing::debug!(
                    segment = k,
                    "the workspace grows: waiting for the segment in flight"
                );
                self.settle_in_flight(&mut in_flight, timing)?;
            }
            self.session.slots[d].workspace.allocate(sg)?;
            self.session.sync(self.manager);
            timing.allocate += t.elapsed();
        }
        // Under segments in flight, only prefetches that need no eviction (their weights
        // are pinned: one that would evict waits until they are done, to evict what it
        // would have without them).
        let overlapped = in_flight.as_deref().is_some_and(|q| !q.is_empty());
        let mode = match (overlapped, self.session.config.streaming.evict_in_flight) {
            (false, _) => RoomMode::Evict,
            (true, false) => RoomMode::AsIs,
            (true, true) => RoomMode::EvictOrLater,
        };
        let mut deferred = false;
        if let Some(resident) = prefetch {
            deferred =
                self.timed_prefetches(task, p, k, store_bytes, resident, queued, mode, timing);
        }
        let slot = &self.session.slots[d];
        let Some(sg) = slot.workspace.current() else {
            return Err(ExecError::Ggml {
                context: format!("segment {k} '{}'", seg.name),
                source: sd_tensor::GgmlError::Mismatch("workspace lost its graph".into()),
            });
        };
        let stores: Vec<_> = sg
            .outputs()
            .iter()
            .filter(|(o, _)| kept_out(o) && !direct.contains(&o.name))
            .map(|(o, t)| (o.name.clone(), t.clone()))
            .collect();
        // Copies into the cut cache after computing need the results on the host's
        // side of the queue: such a segment is waited for; so is one whose inputs are
        // copied from tensors (synchronous copies into the workspace).
        let queue =
            in_flight.is_some() && stores.is_empty() && sg.uploads_queue(inputs, &slot.backend);
        let depth = if queue {
            self.session.config.streaming.segments_in_flight.max(1)
        } else {
            1
        };
        // At most `depth` segments in flight with this one; with one at a time, its inputs
        // are written after the one in flight is done.
        while let Some(q) = in_flight.as_deref_mut().filter(|q| q.len() >= depth) {
            self.settle_oldest(q, false, timing)?;
        }
        if !queue {
            self.settle_in_flight(&mut in_flight, timing)?;
        }
        let queued_behind = in_flight.as_deref().map_or(0, VecDeque::len);
        // Prefetches that need an eviction, with nothing in flight any more: now, so that
        // their copies start before this segment's kernels are queued (behind segments in
        // flight they wait until after, see below).
        if let (Some(resident), true, 0) = (prefetch, deferred, queued_behind) {
            self.timed_prefetches(
                task,
                p,
                k,
                store_bytes,
                resident,
                queued,
                RoomMode::Evict,
                timing,
            );
            deferred = false;
        }
        if queued_behind == 0 {
            // Weights uploaded on the copy stream: the compute backend already waits for
            // them in its queue; with nothing in flight the host waits here, so that the
            // wait is measured apart from compute (behind queued segments it would only
            // hold back the next segment's preparation).
            let t = Instant::now();
            self.manager.wait_for_uploads();
            timing.upload_wait += t.elapsed();
        }
        let slot = &mut self.session.slots[d];
        let Some(sg) = slot.workspace.current_mut() else {
            return Err(ExecError::Ggml {
                context: format!("segment {k} '{}'", seg.name),
                source: sd_tensor::GgmlError::Mismatch("workspace lost its graph".into()),
            });
        };
        let graph_unmoved = sg.note_run();
        let sg = &*sg;
        let t = Instant::now();
        let context = || format!("computing segment {k} '{}'", seg.name);
        let mut event = None;
        let launched = Instant::now();
        if queue {
            // SAFETY: the inputs' bytes are borrowed for the whole execution, which waits
            // for every segment it queued before it returns (`run_plan`).
            unsafe { sg.upload_queued(inputs, &slot.backend) }?;
            // SAFETY: the graph's memory is the workspace (kept until the caller settles
            // this segment: a workspace is released or grows only after that; a later
            // segment's graph in it runs after this one in the backend's queue), the
            // cut-cache entries it reads (kept until then, see `InFlight::dead`) or writes
            // (kept), and its weights (pinned until then); nothing writes them before then
            // without waiting for it first or being queued after it, and its outputs are
            // read only after.
            let span = tracing::debug_span!("segment_launch").entered();
            unsafe { slot.backend.compute_async(sg.graph()) }
                .map_err(ExecError::ggml(context()))?;
            drop(span);
            event = slot.backend.device().and_then(Event::new).map(Arc::new);
            if let Some(e) = &event {
                e.record(&slot.backend)
                    .map_err(ExecError::ggml(format!("recording segment {k}'s event")))?;
                if let Some(w) = &self.session.watcher {
                    w.watch(k, e.clone());
                }
            }
        } else {
            sg.upload(inputs)?;
            slot.backend
                .compute(sg.graph())
                .map_err(ExecError::ggml(context()))?;
        }
        let returned = Instant::now();
        timing.compute += t.elapsed();
        let t = Instant::now();
        for (name, t) in stores {
            tracing::trace!(cut = %name, bytes = t.nbytes(), view = t.view_src().is_some(), store_bytes, "storing a cut after compute");
            slot.cut_cache.store(&name, &t)?;
        }
        timing.allocate += t.elapsed();
        // Prefetches that need an eviction: after the segments before this one are done
        // (this one, queued, keeps its weights pinned and goes on computing meanwhile).
        if let (Some(resident), true) = (prefetch, deferred) {
            while let Some(q) = in_flight.as_deref_mut().filter(|q| !q.is_empty()) {
                self.settle_oldest(q, queue, timing)?;
            }
            self.timed_prefetches(
                task,
                p,
                k,
                store_bytes,
                resident,
                queued,
                RoomMode::Evict,
                timing,
            );
        }
        let slot = &self.session.slots[d];
        let mut held: HashSet<&CutName> = HashSet::new();
        for f in in_flight.as_deref().into_iter().flatten() {
            held.extend(f.dead.iter().filter(|n| !seg.live_cuts.contains(n)));
        }
        let held_for_in_flight = held
            .into_iter()
            .filter_map(|n| slot.cut_cache.entry_footprint(n))
            .sum();
        Ok(SegmentDone {
            held_for_in_flight,
            cache_bytes: slot.cut_cache.entry_bytes() as u64,
            direct_outputs: direct.len(),
            direct: direct.into_iter().collect(),
            graph_reused: reused,
            graph_unmoved,
            queued: queue,
            overlapped,
            queued_behind,
            event,
            launched,
            returned,
        })
    }
}

/// What computing one segment came to.
pub(super) struct SegmentDone {
    /// The device's cut-cache bytes after storing its outputs.
    pub(super) cache_bytes: u64,
    /// Outputs computed into their cut-cache entries.
    pub(super) direct_outputs: usize,
    /// The outputs it computed into their cut-cache entries (kept with its graph).
    pub(super) direct: Vec<CutName>,
    /// Whether the graph kept from the last execution ran again.
    pub(super) graph_reused: bool,
    /// See [`SegmentReport::graph_unmoved`].
    pub(super) graph_unmoved: bool,
    /// Whether it was queued without waiting (the caller puts it in flight).
    pub(super) queued: bool,
    /// Whether its preparation overlapped the compute of the segment before it.
    pub(super) overlapped: bool,
    /// Segments in flight ahead of it when it was queued.
    pub(super) queued_behind: usize,
    /// See [`SegmentReport::held_for_in_flight`].
    pub(super) held_for_in_flight: u64,
    /// Recorded on its backend right after it was queued.
    pub(super) event: Option<Arc<Event>>,
    /// When its graph was handed to the backend, and when the backend returned.
    pub(super) launched: Instant,
    pub(super) returned: Instant,
}
