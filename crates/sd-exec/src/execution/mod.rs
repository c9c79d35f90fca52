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
//! Files: this one holds the run of a plan (`Exec::run`, `run_plan`); `choice.rs` how a
//! graph runs (planning, the cached choice, refining and merging cuts), `segments.rs` the
//! segment loop (steps 1-5), `compute.rs` one segment's steps 6-8, `prefetch.rs` step 7,
//! `in_flight.rs` the segments queued and not waited for, `pool.rs` the staging pool and
//! the resident set, `layer_split.rs` the assignment of segments to devices.

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
mod compute;
mod in_flight;
mod layer_split;
mod pool;
mod prefetch;
mod segments;
pub(crate) mod watcher;

pub(crate) use in_flight::InFlight;
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
