//! The per-graph execution: decide whole vs segmented, then run the plan segment by
//! segment with the segment weight pipeline.
//!
//! Whole runs are one-segment plans (the graph captured without cut marks), so both paths
//! share one loop. A segmented run under a limit first gives its device a staging pool
//! (`Exec::staging_pool_size`; allocated once and kept from step to step), so that the
//! weights streamed per segment are sub-allocated instead of allocated and freed inside the
//! step, and a resident set (`Exec::resident_set`): weights kept from step to step at the
//! pool's high end, so that every segment streams at most a cap and the rest of the pool
//! is a window the prefetches fill in order. Per segment `k`:
//! 1. prune the cut cache to the segment's live cuts (and graph outputs so far);
//! 2. release the workspace if the segment needs a larger one (never two buffers at once);
//! 3. activate the prefetched weights that target `k` (prefetches for later segments stay
//!    in flight);
//! 4. `ensure_capacity` for the workspace growth + the cut outputs it will store, with the
//!    segment's weights required and protected (the resident set too, unless the segment
//!    does not fit otherwise; prefetches for later segments are dropped first), and the
//!    other segments' weights in the preferred eviction order (`SegmentUses::order`)
//!    (furthest next use first);
//! 5. `prepare_params` (load, stage, pin) the segment's weights;
//! 6. build the segment graph (cached cuts bound as inputs), allocate it, upload host inputs;
//! 7. best effort: prefetch the missing weights of the segments after `k`, in order, up
//!    to [`StreamingOptions::prefetch_depth`](crate::StreamingOptions::prefetch_depth) segments ahead, while they fit now next to every
//!    segment in between (their uploads queued on the device's copy stream where it has
//!    one, ordered after the compute queued so far, or on transfer threads that copy one
//!    after another; the compute of their segment waits on their event);
//! 8. wait for the uploads this segment's compute is ordered after (timed as
//!    [`ExecTiming::upload_wait`]), compute; store outputs later segments or the caller
//!    need; unpin; prune the cache to the future cuts; push the runtime residency to the
//!    manager.
//!
//! Layer split (a session with extra devices): the plan's segments are assigned to
//! devices in contiguous ranges (`Exec::assign_layer_split`); each segment computes on
//! its device with its own workspace and cut cache there, its weights staged on that
//! device, and the cuts it reads from another device (block outputs, UNet skips) copied
//! into its device's cut cache first, counted in its capacity request.
//!
//! Files: this one holds the run and the segment loop; `choice.rs` how a graph runs
//! (planning, the cached choice, refining and merging cuts), `pool.rs` the staging pool,
//! `layer_split.rs` the assignment of segments to devices.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use sd_graphcut::{
    CapturedGraph, CutMarks, CutName, HostInputs, Plan, SegmentGraph, SegmentKind, SegmentOutput,
};
use sd_residency::{BackendMemoryRequest, DeviceResidencyManager, ParamId, WeightPrefetchResult};
use sd_tensor::ggml::{BufferType, Event, GTensor, TensorId};

use crate::engine::EngineOptions;
use crate::error::{ExecError, Result};
use crate::eviction::{
    ensure_capacity, fits_as_is, CapacityAsk, EvictionOrder, ReclaimEvent, SegmentUses,
};
use crate::session::{ExecutionSession, SegmentationPolicy, SessionConfig, SessionId};
use crate::task::{ComputeResult, ComputeTask, ExecTiming, SegmentReport, SegmentTimes};

mod choice;
mod layer_split;
mod pool;
pub(crate) mod watcher;

pub(crate) use pool::window_share;

/// Everything one execution borrows from the engine.
pub(crate) struct Exec<'a, M> {
    pub manager: &'a mut M,
    pub others: &'a mut BTreeMap<SessionId, ExecutionSession>,
    pub options: &'a EngineOptions,
    pub log: &'a mut Vec<ReclaimEvent>,
    pub session: &'a mut ExecutionSession,
}

fn align_up(n: u64, a: u64) -> u64 {
    if a <= 1 {
        n
    } else {
        n.div_ceil(a) * a
    }
}

/// Device bytes of `t` in a buffer of `buft` (aligned allocation size).
fn device_bytes(buft: BufferType, t: &GTensor) -> u64 {
    align_up(buft.alloc_size(t) as u64, buft.alignment() as u64)
}

/// Device bytes of `t` in a buffer of its own of `buft` (a cut cache entry): its
/// [`device_bytes`] rounded up to the allocation granularity.
fn buffer_bytes(buft: BufferType, t: &GTensor) -> u64 {
    buft.footprint(device_bytes(buft, t))
}

/// A plan with its captured graph, and the parameters of each segment.
pub(crate) struct Prepared {
    pub(crate) graph: CapturedGraph,
    pub(crate) plan: Arc<Plan>,
    /// The marks the plan was made with.
    pub(crate) marks: CutMarks,
    /// How the task's marks were regrouped into merged segments (group -> merged group),
    /// if they were.
    pub(crate) regroup: Option<HashMap<String, String>>,
    pub(crate) segment_params: Vec<Vec<ParamId>>,
    /// Per segment, its parameters grouped by the set of segments that use them: each
    /// group is prepared (and prefetched) in a call of its own, so the manager's staging
    /// blocks never mix weights needed by different sets of segments (a block holding a
    /// weight a later segment requires would otherwise keep its other members resident).
    pub(crate) segment_groups: Vec<Vec<Vec<ParamId>>>,
    /// The allocation granularity of the session's device buffers (1: exact sizes).
    pub(crate) granularity: u64,
    pub(crate) segment_weight_bytes: Vec<u64>,
    /// The device (session slot) each segment runs on: all 0 without layer split.
    pub(crate) segment_device: Vec<usize>,
    /// Device bytes of each parameter (primary device's buffer type).
    pub(crate) param_bytes: HashMap<ParamId, u64>,
    /// The segments using each parameter: every segment's preferred eviction order.
    pub(crate) segment_uses: SegmentUses,
    /// `Exec::stable_cuts_plan`, once computed for this execution.
    pub(crate) stable_cuts: std::cell::OnceCell<Option<(u64, HashMap<usize, usize>)>>,
}

/// What names a plan a session keeps from a recent execution (see [`KeptPrepared`]):
/// the task graph's [`revision`](sd_tensor::ggml::Graph::revision) (the same graph, not
/// changed since), the limit and the task's marks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct KeptKey {
    revision: u64,
    limit: Option<u64>,
    marks: u64,
}

/// At most this many plans are kept per session (see [`KeptPrepared`]): a sampling loop
/// may alternate graphs (one per prompt where the contexts differ in length, a skip-layer
/// pass on some steps).
const MAX_KEPT_PLANS: usize = 4;

/// The plan of a recent execution, kept for a task that runs the same graph again (a
/// sampling loop that keeps its step's graph and feeds it new inputs): the next execution
/// neither captures nor plans.
pub(crate) struct KeptPrepared {
    key: KeptKey,
    prepared: Prepared,
    segmented: bool,
}

/// What a session remembers of a plan choice: the graph (structure, without marks), the
/// limit it was chosen for and the number of marks the task had.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct ChoiceKey {
    graph: sd_graphcut::Fingerprint,
    limit: Option<u64>,
    marks: usize,
}

/// A remembered plan choice: whole, or the task's marks selected by name and regrouped.
#[derive(Clone, Debug)]
pub(crate) enum Choice {
    Whole,
    Marks {
        names: HashSet<CutName>,
        regroup: Option<HashMap<String, String>>,
    },
}

/// Choices a session remembers (cleared when full).
const MAX_CHOICES: usize = 16;

/// Splits each segment's parameters by the set of segments using them (groups in order
/// of first member, members in segment order).
fn group_by_usage(segment_params: &[Vec<ParamId>]) -> Vec<Vec<Vec<ParamId>>> {
    let mut users: HashMap<ParamId, Vec<usize>> = HashMap::new();
    for (k, ids) in segment_params.iter().enumerate() {
        for p in ids {
            users.entry(*p).or_default().push(k);
        }
    }
    segment_params
        .iter()
        .map(|ids| {
            let mut groups: Vec<(&[usize], Vec<ParamId>)> = Vec::new();
            for p in ids {
                let key = users[p].as_slice();
                match groups.iter_mut().find(|(k, _)| *k == key) {
                    Some((_, g)) => g.push(*p),
                    None => groups.push((key, vec![*p])),
                }
            }
            groups.into_iter().map(|(_, g)| g).collect()
        })
        .collect()
}

/// Whether the output entries of a plan of `segments` segments stay in the cut cache from
/// one execution to the next (a graph run whole with [`StreamingOptions::reuse_graphs`](crate::StreamingOptions::reuse_graphs)):
/// its kept graph writes them again in place. A segmented run's entries become spares
/// instead, which its kept graphs take back (`CutCache::rebind_output`). The engine asks
/// the same of a finished execution (its segment count).
pub(crate) fn reuses_graphs(segments: usize, config: &SessionConfig) -> bool {
    segments == 1 && config.streaming.reuse_graphs
}

impl<M: DeviceResidencyManager> Exec<'_, M> {
    fn invalid(&self, task: &ComputeTask, detail: impl Into<String>) -> ExecError {
        ExecError::InvalidTask {
            task: task.description.clone(),
            detail: detail.into(),
        }
    }

    /// Runs `task` (see the module documentation).
    pub(crate) fn run(&mut self, task: &ComputeTask) -> Result<ComputeResult> {
        let _span =
            tracing::info_span!("execute", task = %task.description, session = %self.session.id)
                .entered();
        let start = Instant::now();
        let uploaded = self.manager.weight_upload_bytes();
        let key = self.kept_key(task);
        let found = self.session.kept_prepared.iter().position(|k| k.key == key);
        let (prepared, segmented, kept) = match found.map(|i| self.session.kept_prepared.remove(i))
        {
            Some(k) => {
                tracing::trace!(
                    revision = key.revision,
                    "a plan kept from a recent execution"
                );
                (k.prepared, k.segmented, true)
            }
            _ => {
                let (p, segmented) = self.choose(task)?;
                (p, segmented, false)
            }
        };
        let mut timing = ExecTiming {
            plan: start.elapsed(),
            ..ExecTiming::default()
        };
        let mut result = self.run_plan(task, &prepared, segmented, &mut timing)?;
        // Keyed as the next execution will see it (choosing may have lowered the limit:
        // the runtime's temporaries for this graph).
        let key = if kept { key } else { self.kept_key(task) };
        let plans = &mut self.session.kept_prepared;
        plans.retain(|k| k.key.revision != key.revision);
        if plans.len() >= MAX_KEPT_PLANS {
            plans.remove(0);
        }
        plans.push(KeptPrepared {
            key,
            prepared,
            segmented,
        });
        timing.total = start.elapsed();
        timing.segments = result.segments.len();
        timing.finish();
        timing.log(&task.description);
        result.timing = timing;
        result.weight_upload_bytes = self.manager.weight_upload_bytes().saturating_sub(uploaded);
        result.plan_kept = kept;
        Ok(result)
    }

    /// The key under which `task`'s plan is kept (see [`KeptPrepared`]).
    fn kept_key(&self, task: &ComputeTask) -> KeptKey {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        for m in task.marks.iter() {
            (m.tensor, &m.name, m.level).hash(&mut h);
        }
        KeptKey {
            revision: task.graph.revision(),
            limit: self.segment_limit(),
            marks: h.finish(),
        }
    }

    fn request(&self, device: usize, pending: u64) -> BackendMemoryRequest {
        let slot = &self.session.slots[device];
        BackendMemoryRequest {
            backend: slot.backend_id,
            owner: self.session.id.owner(),
            pending_bytes: pending,
            runtime_resident_bytes: slot.resident_bytes(),
            max_backend_bytes: slot.budget,
        }
    }

    fn run_plan(
        &mut self,
        task: &ComputeTask,
        p: &Prepared,
        segmented: bool,
        timing: &mut ExecTiming,
    ) -> Result<ComputeResult> {
        let plan = &p.plan;
        let output_index = plan
            .graph_outputs()
            .find(|o| p.graph.node_tensors()[o.node].id() == task.output.id())
            .map(|o| o.name.clone())
            .ok_or_else(|| {
                self.invalid(
                    task,
                    format!(
                        "output '{}' is not a graph output (flag it as output or make it the last node)",
                        task.output.name()
                    ),
                )
            })?;
        let mut inputs = HostInputs::new();
        for (t, b) in &task.inputs {
            inputs.insert(t, b)?;
        }
        for (t, name) in &task.cached_inputs {
            let key = crate::engine::runner_key(name)?;
            let entry = self.session.slots[0]
                .runner_cache
                .get(&key)
                .ok_or_else(|| {
                    self.invalid(
                        task,
                        format!(
                            "input '{}' reads runner cache entry '{name}', which session {} does not hold",
                            t.name(),
                            self.session.id
                        ),
                    )
                })?;
            inputs.insert_tensor(t, entry)?;
        }
        let prefetch_on =
            segmented && self.session.config.prefetch && self.manager.prefetch_enabled();
        for ids in &p.segment_params {
            self.session.params_used.extend(ids.iter().copied());
        }
        // The previous execution's outputs stay in the cut cache until the first segment's
        // pruning below keeps only those this plan writes again: a graph run again is bound
        // to the same entries (no device allocation for them inside a step).
        if !reuses_graphs(plan.segments.len(), &self.session.config) {
            self.session.drop_cut_entries();
        }
        let t = Instant::now();
        self.setup_staging_pool(task, p, segmented)?;
        let resident = self.resident_set(p);
        let spares = self.cut_spare_limit(p);
        let quota = self.stable_cuts_plan(p).map(|(_, q)| q).unwrap_or_default();
        self.session.slots[0].cut_cache.set_spare_quota(quota);
        self.session.slots[0].cut_cache.set_spare_limit(spares);
        self.session.slots[0].cut_cache.hold_frees(false);
        if segmented {
            let kept: Vec<ParamId> = resident.iter().copied().collect();
            self.manager.keep_at_pool_end(&kept);
        }
        timing.capacity += t.elapsed();
        // Segments queued without waiting (see `StreamingOptions::async_compute`): one device,
        // whose backend queues work. Uploads then need not wait for queued compute: the
        // segment in flight keeps its weights pinned, so no memory freed for an upload is
        // read by it.
        let async_compute = segmented
            && self.session.config.streaming.async_compute
            && self.session.slots.len() == 1
            && self.session.slots[0].backend.supports_events();
        self.manager.set_uploads_wait_for_compute(!async_compute);
        if async_compute && self.session.config.streaming.timeline && self.session.watcher.is_none()
        {
            self.session.watcher = watcher::DoneWatcher::start();
        }
        if let Some(w) = &self.session.watcher {
            // What an execution that failed left (its events are done: it was settled).
            w.take();
        }
        let mut in_flight: VecDeque<InFlight> = VecDeque::new();
        let run = self.run_segments(
            task,
            p,
            &inputs,
            segmented,
            &resident,
            prefetch_on,
            async_compute.then_some(&mut in_flight),
            timing,
        );
        let settled = self.settle_all(&mut in_flight, timing);
        let mut reports = run?;
        settled?;
        if let Some(w) = &self.session.watcher {
            for (k, at) in w.take() {
                if let Some(r) = reports.get_mut(k) {
                    r.times.done = Some(at);
                }
            }
            // A device finishes its segments in order: a watched segment seen done after a
            // later one (the watcher's wake-up came after that one's call returned) was
            // done by then.
            let mut next: Option<std::time::Instant> = None;
            for r in reports.iter_mut().rev() {
                if let Some(done) = r.times.done {
                    let done = next.map_or(done, |n| done.min(n));
                    r.times.done = Some(done);
                    next = Some(done);
                }
            }
        }
        let out = self
            .session
            .slots
            .iter()
            .find_map(|s| s.cut_cache.get(&output_index))
            .ok_or_else(|| {
                self.invalid(task, format!("output '{output_index}' was not produced"))
            })?;
        let bytes = out.read_bytes().map_err(ExecError::ggml(format!(
            "reading output '{}'",
            task.output.name()
        )))?;
        let ne = out.ne();
        if let Some(peak) = reports.iter().map(|r| r.compute_bytes).max() {
            tracing::debug!(segments = reports.len(), peak_compute = peak, "executed");
        }
        Ok(ComputeResult {
            output: bytes,
            ne,
            segmented,
            segments: reports,
            timing: ExecTiming::default(),
            weight_upload_bytes: 0,
            plan_kept: false,
        })
    }

    /// Waits for every segment in flight (all the work queued on their devices) and
    /// [`finish`](Self::finish)es them.
    fn settle_all(&mut self, q: &mut VecDeque<InFlight>, timing: &mut ExecTiming) -> Result<()> {
        if q.is_empty() {
            return Ok(());
        }
        let t = Instant::now();
        let devices: BTreeSet<usize> = q.iter().map(|f| f.device).collect();
        for d in devices {
            self.session.slots[d].backend.synchronize();
        }
        timing.compute_wait += t.elapsed();
        let mut first = Ok(());
        while let Some(f) = q.pop_front() {
            let r = self.finish(f, q.is_empty());
            if first.is_ok() {
                first = r;
            }
        }
        first
    }

    /// Waits for the oldest segment in flight (its event; the segments queued after it
    /// go on computing) and [`finish`](Self::finish)es it. With `more_queued`, a segment
    /// not in `q` is queued after it (nothing is freed under it).
    fn settle_oldest(
        &mut self,
        q: &mut VecDeque<InFlight>,
        more_queued: bool,
        timing: &mut ExecTiming,
    ) -> Result<()> {
        let Some(f) = q.pop_front() else {
            return Ok(());
        };
        let t = Instant::now();
        let _span = tracing::debug_span!("segment_wait").entered();
        match &f.done {
            Some(event) => event.synchronize(),
            None => self.session.slots[f.device].backend.synchronize(),
        }
        timing.compute_wait += t.elapsed();
        self.finish(f, q.is_empty() && !more_queued)
    }

    /// Finishes a segment that is done: drops the cut entries nothing after it reads and
    /// unpins its weights (the oldest of `ExecutionSession::pinned_in_flight`). With
    /// `last` (nothing queued after it), the cut caches free what they held meanwhile and
    /// the copies the device's compute waited for are collected.
    fn finish(&mut self, f: InFlight, last: bool) -> Result<()> {
        tracing::trace!(segment = f.index, "segment done");
        for slot in &mut self.session.slots {
            slot.cut_cache.retain(|n| !f.dead.contains(n));
            if last {
                slot.cut_cache.hold_frees(false);
            }
        }
        if last {
            // Every copy a queued segment waited for is done: collecting them waits for
            // nothing.
            self.manager.wait_for_uploads();
        }
        self.session.sync(self.manager);
        let n = f.pins.min(self.session.pinned_in_flight.len());
        let pinned: Vec<ParamId> = self.session.pinned_in_flight.drain(..n).collect();
        self.manager.unpin_params(&pinned)?;
        Ok(())
    }

    /// The segment loop of [`run_plan`](Self::run_plan). With `in_flight` (asynchronous
    /// compute), the segments still queued are left in it, not waited for.
    #[allow(clippy::too_many_arguments)]
    fn run_segments(
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

    /// [`settle_all`](Self::settle_all)s the segments in flight, if any.
    fn settle_in_flight(
        &mut self,
        in_flight: &mut Option<&mut VecDeque<InFlight>>,
        timing: &mut ExecTiming,
    ) -> Result<()> {
        match in_flight.as_deref_mut() {
            Some(q) => self.settle_all(q, timing),
            None => Ok(()),
        }
    }

    /// Steps 6-8 of segment `k` on its device. With `in_flight` (asynchronous compute),
    /// queues this one without waiting when all its kept outputs are computed into their
    /// cut-cache entries ([`SegmentDone::queued`]; the caller puts it in flight): its
    /// inputs are written in the device's queue behind the segments in flight (at most
    /// [`StreamingOptions::segments_in_flight`](crate::StreamingOptions::segments_in_flight) including it; the oldest are waited for
    /// first), or, with one segment at a time, after waiting for the one in flight.
    #[allow(clippy::too_many_arguments)]
    fn compute_segment(
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

    /// Best effort, while segment `k` is about to compute: extends the queue of
    /// prefetches to the segments after it, in order, up to
    /// [`StreamingOptions::prefetch_depth`](crate::StreamingOptions::prefetch_depth) segments ahead of `k`, stopping at the first
    /// that does not fit now. The manager copies them on the device's copy stream or on
    /// transfer threads while the segments before them compute. With [`RoomMode::AsIs`],
    /// stops at the first that would need an eviction, with [`RoomMode::EvictOrLater`] at
    /// the first without room beside the segments in flight, and returns `true`
    /// (deferred). Timed as [`ExecTiming::prefetch`].
    #[allow(clippy::too_many_arguments)]
    fn timed_prefetches(
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
    fn enqueue_prefetch(
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
fn split_groups(groups: &[Vec<ParamId>], resident: &HashSet<ParamId>) -> Vec<Vec<ParamId>> {
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
enum RoomMode {
    /// Evict as the policy allows; no room is final for this pass.
    Evict,
    /// Only what fits as the device stands: a prefetch that needs an eviction is
    /// [`Prefetch::Later`].
    AsIs,
    /// Evict as the policy allows (never a pinned weight); no room beside the segments in
    /// flight is [`Prefetch::Later`].
    EvictOrLater,
}

/// A segment queued on its device and not waited for yet (see
/// [`StreamingOptions::async_compute`](crate::StreamingOptions::async_compute)). Its weights are pinned
/// (`ExecutionSession::pinned_in_flight`) until it is done.
pub(crate) struct InFlight {
    index: usize,
    device: usize,
    /// The cut-cache entries to drop once it is done: those it reads that nothing after
    /// it reads (kept meanwhile, since it reads them).
    dead: Vec<CutName>,
    /// How many of `ExecutionSession::pinned_in_flight` (from the front) are its pins.
    pins: usize,
    /// Recorded on its backend right after it: done when it is (`None`: the backend is
    /// synchronised instead).
    done: Option<Arc<Event>>,
}

/// What computing one segment came to.
struct SegmentDone {
    /// The device's cut-cache bytes after storing its outputs.
    cache_bytes: u64,
    /// Outputs computed into their cut-cache entries.
    direct_outputs: usize,
    /// The outputs it computed into their cut-cache entries (kept with its graph).
    direct: Vec<CutName>,
    /// Whether the graph kept from the last execution ran again.
    graph_reused: bool,
    /// See [`SegmentReport::graph_unmoved`].
    graph_unmoved: bool,
    /// Whether it was queued without waiting (the caller puts it in flight).
    queued: bool,
    /// Whether its preparation overlapped the compute of the segment before it.
    overlapped: bool,
    /// Segments in flight ahead of it when it was queued.
    queued_behind: usize,
    /// See [`SegmentReport::held_for_in_flight`].
    held_for_in_flight: u64,
    /// Recorded on its backend right after it was queued.
    event: Option<Arc<Event>>,
    /// When its graph was handed to the backend, and when the backend returned.
    launched: Instant,
    returned: Instant,
}

/// The capacity a segment asks for: room for `required` (its weights) and the request's
/// pending bytes, never evicting `protected`.
fn segment_ask<'a>(
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

/// What asking to prefetch one segment's weights came to.
enum Prefetch {
    /// Copies in flight for these parameters.
    Scheduled(Vec<ParamId>),
    /// Nothing to copy: its weights are on the device or on their way.
    Resident,
    /// No room (or the manager could not schedule them): later segments wait too.
    NoRoom,
    /// Not scheduled now: it would need an eviction while a segment is in flight.
    Later,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_groups_split_weights_shared_with_other_segments() {
        let p = |v: &[u64]| v.iter().map(|x| ParamId(*x)).collect::<Vec<_>>();
        // 9 is used by segments 0 and 2, 5 by 1 and 2; the rest by one segment each.
        let segs = vec![p(&[1, 9, 2]), p(&[3, 5]), p(&[9, 4, 5, 6]), p(&[])];
        let g = group_by_usage(&segs);
        assert_eq!(g[0], vec![p(&[1, 2]), p(&[9])]);
        assert_eq!(g[1], vec![p(&[3]), p(&[5])]);
        assert_eq!(g[2], vec![p(&[9]), p(&[4, 6]), p(&[5])]);
        assert!(g[3].is_empty());
    }
}

#[cfg(test)]
mod eviction_order_tests {
    use super::*;

    /// The preferred eviction order when segment `k` needs room: the other segments' weights,
    /// the one whose next use is furthest away first, for a graph that runs again the same way
    /// (a sampling loop calls the same UNet every step). Segments already run in this pass are
    /// next needed in the next pass, the most recent one last of all: `k-1, k-2, ..., 0`, then
    /// the segments still to come in this pass, the last first: `n-1, ..., k+1`. Evicting in
    /// this order keeps a fixed resident set across steps and streams only the rest, where a
    /// least-recently-used order would evict exactly the weights the pass needs next.
    fn eviction_order(segment_params: &[Vec<ParamId>], k: usize) -> Vec<Vec<ParamId>> {
        let n = segment_params.len();
        (0..k)
            .rev()
            .chain((k + 1..n).rev())
            .map(|j| segment_params[j].clone())
            .collect()
    }

    /// [`SegmentUses::order`] ranks each parameter where [`eviction_order`]'s list puts
    /// it first (parameters of several segments, and of the asking one, included).
    #[test]
    fn segment_uses_rank_as_the_listed_order() {
        let p = |v: &[u64]| v.iter().map(|&i| ParamId(i)).collect::<Vec<_>>();
        let segs = vec![p(&[0, 1]), p(&[2, 1]), p(&[3]), p(&[4, 0]), p(&[5, 3, 6])];
        let uses = SegmentUses::new(&segs);
        for k in 0..segs.len() {
            let listed = eviction_order(&segs, k);
            for id in 0..8 {
                let want = listed.iter().position(|g| g.contains(&ParamId(id)));
                assert_eq!(
                    uses.order(k).position(ParamId(id)),
                    want,
                    "k {k} param {id}"
                );
            }
        }
    }

    #[test]
    fn furthest_next_use_comes_first() {
        let segs: Vec<Vec<ParamId>> = (0..5).map(|i| vec![ParamId(i)]).collect();
        let order = |k| {
            eviction_order(&segs, k)
                .into_iter()
                .map(|g| g[0].0)
                .collect::<Vec<_>>()
        };
        assert_eq!(order(0), vec![4, 3, 2, 1]);
        assert_eq!(order(2), vec![1, 0, 4, 3]);
        assert_eq!(order(4), vec![3, 2, 1, 0]);
    }
}
