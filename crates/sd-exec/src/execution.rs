//! The per-graph execution: decide whole vs segmented, then run the plan segment by
//! segment with the segment weight pipeline.
//!
//! Whole runs are one-segment plans (the graph captured without cut marks), so both paths
//! share one loop. A segmented run under a limit first gives its device a staging pool
//! (`Exec::staging_pool_size`; allocated once and kept from step to step), so that the
//! weights streamed per segment are sub-allocated instead of allocated and freed inside the
//! step. Per segment `k`:
//! 1. prune the cut cache to the segment's live cuts (and graph outputs so far);
//! 2. release the workspace if the segment needs a larger one (never two buffers at once);
//! 3. activate the prefetched weights if they target `k`;
//! 4. `ensure_capacity` for the workspace growth + the cut outputs it will store, with the
//!    segment's weights required and protected, and the other segments' weights in the
//!    preferred eviction order [`eviction_order`] (furthest next use first);
//! 5. `prepare_params` (load, stage, pin) the segment's weights;
//! 6. build the segment graph (cached cuts bound as inputs), allocate it, upload host inputs;
//! 7. best effort: prefetch the next segment's missing weights if they fit now (their
//!    uploads queued on the device's copy stream where it has one, ordered after the compute
//!    queued so far; the compute of their segment waits on their event);
//! 8. wait for the uploads this segment's compute is ordered after (timed as
//!    [`ExecTiming::upload_wait`]), compute; store outputs later segments or the caller
//!    need; unpin; prune the cache to the future cuts; push the runtime residency to the
//!    manager.
//!
//! Layer split (a session with extra devices): the plan's segments are assigned to
//! devices in contiguous ranges ([`Exec::assign_layer_split`]); each segment computes on
//! its device with its own workspace and cut cache there, its weights staged on that
//! device, and the cuts it reads from another device (block outputs, UNet skips) copied
//! into its device's cut cache first, counted in its capacity request.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use sd_graphcut::{CapturedGraph, CutMarks, CutName, HostInputs, Plan, SegmentGraph, SegmentKind};
use sd_residency::{BackendMemoryRequest, DeviceResidencyManager, ParamId, WeightPrefetchResult};
use sd_tensor::ggml::{BufferType, GTensor, TensorId};

use crate::engine::EngineOptions;
use crate::error::{ExecError, Result};
use crate::eviction::{ensure_capacity, CapacityAsk, ReclaimEvent};
use crate::session::{ExecutionSession, SegmentationPolicy, SessionId};
use crate::task::{ComputeResult, ComputeTask, ExecTiming, SegmentReport};

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

impl<M: DeviceResidencyManager> Exec<'_, M> {
    fn invalid(&self, task: &ComputeTask, detail: impl Into<String>) -> ExecError {
        ExecError::InvalidTask {
            task: task.description.clone(),
            detail: detail.into(),
        }
    }

    pub(crate) fn prepare_plan(
        &mut self,
        task: &ComputeTask,
        marks: &CutMarks,
    ) -> Result<Prepared> {
        let weights: HashSet<TensorId> = task.weights.iter().map(|t| t.id()).collect();
        let manager = &*self.manager;
        let is_param = |id: TensorId| weights.contains(&id) || manager.resolve_param(id).is_some();
        let graph = CapturedGraph::capture(&task.graph, marks, &is_param)?;
        self.prepare_captured(graph, marks)
    }

    /// [`prepare_plan`](Self::prepare_plan) of the graph `base` captured, with `marks`
    /// instead of its own (no second walk of the ggml graph).
    pub(crate) fn prepare_remarked(
        &mut self,
        base: &CapturedGraph,
        marks: &CutMarks,
    ) -> Result<Prepared> {
        let graph = base.with_marks(marks)?;
        self.prepare_captured(graph, marks)
    }

    fn prepare_captured(&mut self, graph: CapturedGraph, marks: &CutMarks) -> Result<Prepared> {
        let plan = self.session.planner.plan(&graph)?;
        let buft = self.session.config.backend.buffer_type();
        let mut segment_params = Vec::with_capacity(plan.segments.len());
        let mut segment_weight_bytes = Vec::with_capacity(plan.segments.len());
        let mut param_bytes = HashMap::new();
        for seg in &plan.segments {
            let mut seen = BTreeSet::new();
            let mut bytes = 0u64;
            let mut ids = Vec::new();
            for l in seg.params() {
                let t = &graph.leaf_tensors()[l];
                if let Some(p) = self.manager.resolve_param(t.id()) {
                    if seen.insert(p) {
                        ids.push(p);
                        let b = device_bytes(buft, t);
                        param_bytes.insert(p, b);
                        bytes += b;
                    }
                }
            }
            segment_params.push(ids);
            segment_weight_bytes.push(bytes);
        }
        let segment_groups = group_by_usage(&segment_params);
        let segment_device = vec![0; plan.segments.len()];
        Ok(Prepared {
            graph,
            plan,
            marks: marks.clone(),
            regroup: None,
            segment_params,
            segment_groups,
            granularity: buft.allocation_granularity(),
            segment_weight_bytes,
            segment_device,
            param_bytes,
        })
    }

    /// Runs `task` (see the module documentation).
    pub(crate) fn run(&mut self, task: &ComputeTask) -> Result<ComputeResult> {
        let _span =
            tracing::info_span!("execute", task = %task.description, session = %self.session.id)
                .entered();
        let start = Instant::now();
        let uploaded = self.manager.weight_upload_bytes();
        let (prepared, segmented) = self.choose(task)?;
        let mut timing = ExecTiming {
            plan: start.elapsed(),
            ..ExecTiming::default()
        };
        let mut result = self.run_plan(task, &prepared, segmented, &mut timing)?;
        timing.total = start.elapsed();
        timing.segments = result.segments.len();
        timing.finish();
        timing.log(&task.description);
        result.timing = timing;
        result.weight_upload_bytes = self.manager.weight_upload_bytes().saturating_sub(uploaded);
        Ok(result)
    }

    /// The staging pool plan `p` runs with (see [`sd_residency::DeviceResidencyManager::set_staging_pool`]):
    /// `None` unless it is segmented under a limit on one device other than the CPU, with
    /// [`SessionConfig::staging_pool`](crate::SessionConfig::staging_pool) on. Its size is
    /// the limit less the largest non-weight need of a segment (workspace, live cuts,
    /// outputs, the runner cache) and a 1/64 slack for what the plan does not see (ggml
    /// rounding in the compute buffer), at most the plan's weight bytes; `None` too when
    /// that does not hold the largest segment's weights (the segments then stage into
    /// buffers of their own, as without a pool).
    pub(crate) fn staging_pool_size(&self, p: &Prepared, segmented: bool) -> Option<u64> {
        let cfg = &self.session.config;
        if !segmented || !cfg.staging_pool || self.session.is_layer_split() || cfg.backend.is_cpu()
        {
            return None;
        }
        let limit = self.segment_limit()?;
        let nonweight = (0..p.plan.segments.len())
            .map(|k| {
                let d = crate::refine::segment_plan(p, k);
                tracing::trace!(
                    segment = k,
                    need = d.need,
                    weights = d.weight_bytes,
                    "segment need"
                );
                d.need.saturating_sub(d.weight_bytes)
            })
            .max()?
            .saturating_add(self.session.slots[0].runner_cache.bytes() as u64);
        let largest = p.segment_weight_bytes.iter().copied().max()?;
        let weights: u64 = p.param_bytes.values().sum();
        let size = limit
            .checked_sub(nonweight)?
            .checked_sub(limit / 64)?
            .min(weights);
        // Whole allocation units, so that the pool's footprint is its size.
        let g = self
            .session
            .config
            .backend
            .buffer_type()
            .allocation_granularity();
        let size = if size >= g { size / g * g } else { size };
        if size == 0 || size < largest {
            tracing::debug!(
                limit,
                nonweight,
                largest,
                size,
                "no staging pool: it would not hold the largest segment's weights"
            );
            return None;
        }
        Some(size)
    }

    /// Gives the session's device the staging pool `p` runs with (allocated once: a pool of
    /// the same size is kept from run to run), making room for it first; without one, frees
    /// the session's own pool. A pool that does not fit is skipped (best effort).
    fn setup_staging_pool(
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
        let preferred = eviction_order(&p.segment_params, 0);
        let room = ensure_capacity(
            self.manager,
            self.others,
            &CapacityAsk {
                what: format!("staging pool of '{}'", task.description),
                backend_name: self.session.config.backend.name().to_string(),
                request,
                required: &[],
                preferred: &preferred,
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

    /// Chooses the plan `task` runs with (whole, block segments, refined inside blocks,
    /// merged, or layer split) without running anything; returns it and whether it is
    /// segmented. What fits at no granularity is [`ExecError::BudgetTooSmall`].
    pub(crate) fn choose(&mut self, task: &ComputeTask) -> Result<(Prepared, bool)> {
        if self.session.config.runtime_temporaries {
            // The runtime's pool for this graph's largest product, beyond the reserve's
            // margin, comes out of the budget before anything is planned against it.
            let extra = crate::reserve::backend_temporaries(&task.graph)
                .saturating_sub(crate::reserve::RUNTIME_POOL_MARGIN_BYTES);
            if extra > 0 {
                self.manager
                    .reserve_backend_temporaries(self.session.config.backend_id, extra);
            }
        }
        let whole = self.prepare_plan(task, &CutMarks::new())?;
        if self.session.is_layer_split() && !task.marks.is_empty() {
            let mut p = self.prepare_plan(task, &task.marks.coarse())?;
            if p.plan.segments.len() > 1 {
                self.assign_layer_split(task, &mut p)?;
                let one_device = p.segment_device.iter().all(|d| *d == 0);
                if !one_device || self.should_segment(task, &whole)? {
                    tracing::debug!(
                        segments = p.plan.segments.len(),
                        devices = ?p.segment_device,
                        "layer split plan"
                    );
                    return Ok((p, true));
                }
            }
        }
        // The choice made for this graph under this limit before (every step of a sampling
        // loop): planned once per run, not once per step.
        let key = ChoiceKey {
            graph: whole.plan.fingerprint,
            limit: self.segment_limit(),
            marks: task.marks.len(),
        };
        if let Some(choice) = self.session.choices.get(&key).cloned() {
            let prepared = match choice {
                Choice::Whole => whole,
                Choice::Marks { names, regroup } => {
                    let marks = task.marks.select(|m| names.contains(&m.name));
                    let marks = match &regroup {
                        Some(map) => marks
                            .regrouped(|g| map.get(g).cloned().unwrap_or_else(|| g.to_string()))?,
                        None => marks,
                    };
                    // The graph captured once per step: the whole one, re-marked.
                    let mut p = self.prepare_remarked(&whole.graph, &marks)?;
                    p.regroup = regroup;
                    p
                }
            };
            let segmented = prepared.plan.segments.len() > 1;
            return Ok((prepared, segmented));
        }
        let segmented = self.should_segment(task, &whole)?;
        let prepared = if segmented {
            let p = self.prepare_plan(task, &task.marks.coarse())?;
            let p = self.refine(task, p)?;
            if p.plan.segments.len() > 1 {
                self.merge_segments(task, p)?
            } else {
                whole
            }
        } else {
            whole
        };
        let segmented = prepared.plan.segments.len() > 1;
        tracing::debug!(
            segments = prepared.plan.segments.len(),
            segmented,
            "plan chosen"
        );
        let choice = if segmented {
            let names = prepared
                .marks
                .iter()
                .map(|m| match &prepared.regroup {
                    // Regrouped marks are found again by their original names.
                    Some(_) => task.marks.get(m.tensor).map(|o| o.name.clone()),
                    None => Some(m.name.clone()),
                })
                .collect::<Option<HashSet<CutName>>>();
            names.map(|names| Choice::Marks {
                names,
                regroup: prepared.regroup.clone(),
            })
        } else {
            Some(Choice::Whole)
        };
        if let Some(choice) = choice {
            if self.session.choices.len() >= MAX_CHOICES {
                self.session.choices.clear();
            }
            self.session.choices.insert(key, choice);
        }
        Ok((prepared, segmented))
    }

    /// stable-diffusion.cpp's rule: segment when the graph has cuts, the manager allows it, and its
    /// weights + measured workspace + planning headroom exceed the budget.
    fn should_segment(&self, task: &ComputeTask, whole: &Prepared) -> Result<bool> {
        let cfg = &self.session.config;
        let can = !task.marks.is_empty()
            && self.manager.segmented_compute_enabled()
            && !cfg.backend.is_cpu();
        match cfg.segmentation {
            SegmentationPolicy::Never => return Ok(false),
            SegmentationPolicy::Always => return Ok(can),
            SegmentationPolicy::Auto if !can => return Ok(false),
            SegmentationPolicy::Auto => {}
        }
        let Some(limit) = self.segment_limit() else {
            return Ok(false);
        };
        let weights: u64 = whole.segment_weight_bytes.iter().sum();
        let ws = whole.plan.max_compute_buffer() as u64;
        let buft = cfg.backend.buffer_type();
        let out = whole
            .plan
            .graph_outputs()
            .map(|o| buft.footprint(align_up(o.bytes as u64, 256)))
            .sum::<u64>();
        let ws = buft.footprint(ws);
        let need = weights
            .saturating_add(ws)
            .saturating_add(out)
            .saturating_add(self.options.planning_headroom);
        tracing::debug!(weights, workspace = ws, limit, need, "segmentation check");
        if need > limit {
            return Ok(true);
        }
        Ok(false)
    }

    /// The tightest of the session budget, the device's budget in the manager
    /// (`--max-vram`) and the device's memory, if any.
    pub(crate) fn segment_limit(&self) -> Option<u64> {
        let cfg = &self.session.config;
        crate::limit::device_limit(
            &[cfg.budget, self.manager.backend_budget(cfg.backend_id)],
            &cfg.backend,
        )
    }

    /// Runs consecutive cut groups of `fine` as one segment while the merged segment's
    /// estimated footprint (its weights, the largest compute buffer of its parts, the cut
    /// outputs it produces and the largest set of live cuts) stays within a third of the
    /// limit: one third for the segment computing, one for the next one's prefetched
    /// weights, one for weights that stay resident from step to step. The merged plan is
    /// measured like any other; if a merged segment does not fit the limit after all, the
    /// fine plan runs. Off with [`SessionConfig::merge_segments`], under
    /// [`SegmentationPolicy::Always`], and without a limit.
    fn merge_segments(&mut self, task: &ComputeTask, fine: Prepared) -> Result<Prepared> {
        let cfg = &self.session.config;
        if !cfg.merge_segments || cfg.segmentation == SegmentationPolicy::Always {
            return Ok(fine);
        }
        let Some(limit) = self.segment_limit() else {
            return Ok(fine);
        };
        let target = limit / 3;
        let segs = &fine.plan.segments;
        // Ranges of consecutive cut segments; the final segment stays on its own.
        let mut ranges: Vec<(usize, usize)> = Vec::new();
        let (mut w, mut c, mut o, mut l) = (0u64, 0u64, 0u64, 0u64);
        for (k, seg) in segs.iter().enumerate() {
            let sw = fine.segment_weight_bytes[k];
            let sc = seg.bytes.compute_buffer as u64;
            let so = seg.bytes.outputs as u64;
            let sl = seg.bytes.live_cuts as u64;
            let fits = w + sw + c.max(sc) + o + so + l.max(sl) <= target;
            match ranges.last_mut() {
                Some(r)
                    if seg.kind == SegmentKind::Cut
                        && segs[r.0].kind == SegmentKind::Cut
                        && fits =>
                {
                    r.1 = k;
                    w += sw;
                    c = c.max(sc);
                    o += so;
                    l = l.max(sl);
                }
                _ => {
                    ranges.push((k, k));
                    (w, c, o, l) = (sw, sc, so, sl);
                }
            }
        }
        if ranges.len() == segs.len() {
            return Ok(fine);
        }
        let mut group_of: HashMap<String, String> = HashMap::new();
        for &(a, b) in &ranges {
            let name = if a == b {
                segs[a].name.clone()
            } else {
                format!("{}..{}", segs[a].name, segs[b].name)
            };
            for seg in &segs[a..=b] {
                group_of.insert(seg.name.clone(), name.clone());
            }
        }
        let marks = fine
            .marks
            .regrouped(|g| group_of.get(g).cloned().unwrap_or_else(|| g.to_string()))?;
        let mut merged = self.prepare_plan(task, &marks)?;
        merged.regroup = Some(group_of);
        let too_big = merged
            .plan
            .segments
            .iter()
            .enumerate()
            .find(|(k, _)| crate::refine::segment_need(&merged, *k) > limit);
        if let Some((k, seg)) = too_big {
            tracing::debug!(segment = k, name = %seg.name, limit, "merged segment too large: fine plan");
            return Ok(fine);
        }
        tracing::debug!(
            fine = segs.len(),
            merged = merged.plan.segments.len(),
            target,
            "segments merged"
        );
        Ok(merged)
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

    /// Layer split: assigns each segment to a device, in contiguous ranges in slot order.
    /// Walking the segments with a current device, a segment moves to the next device
    /// while its new weights plus the device's workspace would overflow the current one's
    /// capacity (budget, or device memory); the last device takes what is left and streams
    /// its weights if they exceed it. Assignments are sticky per parameter: the first graph
    /// decides, and the manager is told each parameter's compute backend.
    fn assign_layer_split(&mut self, task: &ComputeTask, p: &mut Prepared) -> Result<()> {
        let n = self.session.slots.len();
        let caps: Vec<u64> = self
            .session
            .slots
            .iter()
            .map(|s| crate::limit::device_limit(&[s.budget], &s.backend).unwrap_or(u64::MAX))
            .collect();
        let mut used = vec![0u64; n];
        let mut workspace = vec![0u64; n];
        let mut d = 0usize;
        let mut fresh: Vec<Vec<ParamId>> = vec![Vec::new(); n];
        for (k, seg) in p.plan.segments.iter().enumerate() {
            let params = &p.segment_params[k];
            if let Some(f) = params
                .iter()
                .filter_map(|x| self.session.split_assignment.get(x))
                .max()
            {
                d = d.max(*f);
            }
            let new_bytes: u64 = params
                .iter()
                .filter(|x| !self.session.split_assignment.contains_key(x))
                .map(|x| p.param_bytes[x])
                .sum();
            let seg_ws = (seg.bytes.compute_buffer + seg.bytes.live_cuts) as u64;
            while d + 1 < n && used[d] + new_bytes + workspace[d].max(seg_ws) > caps[d] {
                d += 1;
            }
            used[d] += new_bytes;
            workspace[d] = workspace[d].max(seg_ws);
            p.segment_device[k] = d;
            for x in params {
                match self.session.split_assignment.get(x) {
                    None => {
                        self.session.split_assignment.insert(*x, d);
                        fresh[d].push(*x);
                    }
                    Some(e) if *e != d => {
                        return Err(self.invalid(
                            task,
                            format!(
                                "layer split: parameter {x:?} is used by segments on devices {e} and {d}; \
                                 a parameter must live on one device \
                                 (mark the computation sharing it as a graph cut)"
                            ),
                        ));
                    }
                    Some(_) => {}
                }
            }
        }
        for (dev, ids) in fresh.iter().enumerate() {
            if !ids.is_empty() {
                let backend = self.session.slots[dev].backend_id;
                self.manager.assign_compute_backend(ids, backend)?;
                tracing::debug!(
                    device = dev,
                    params = ids.len(),
                    bytes = used[dev],
                    "layer split assignment"
                );
            }
        }
        Ok(())
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
        let owner = self.session.id.owner();
        let prefetch_on =
            segmented && self.session.config.prefetch && self.manager.prefetch_enabled();
        for ids in &p.segment_params {
            self.session.params_used.extend(ids.iter().copied());
        }
        self.session.clear_cut_caches();
        let t = Instant::now();
        self.setup_staging_pool(task, p, segmented)?;
        timing.capacity += t.elapsed();
        let mut reports = Vec::with_capacity(plan.segments.len());
        // (target segment, params) of the queued prefetch.
        let mut queued: Option<(usize, Vec<ParamId>)> = None;
        let mut outputs_so_far: Vec<CutName> = Vec::new();

        for (k, seg) in plan.segments.iter().enumerate() {
            let _span = tracing::debug_span!("segment", index = k, name = %seg.name).entered();
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
            for slot in &mut self.session.slots {
                slot.cut_cache
                    .retain(|n| seg.live_cuts.contains(n) || outputs_so_far.contains(n));
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
            let store_bytes: u64 = seg
                .outputs
                .iter()
                .filter(|o| o.graph_output || seg.future_cuts.contains(&o.name))
                .map(|o| buffer_bytes(buft, &p.graph.node_tensors()[o.node]))
                .sum();
            let held = self.session.slots[d].workspace.prepare(compute);
            self.session.sync(self.manager);

            // Prefetched weights for this segment become current.
            let mut prefetched = false;
            let t = Instant::now();
            if let Some((target, ids)) = queued.take() {
                if target == k {
                    prefetched = self.manager.activate_prefetched_params(owner, &ids)?;
                } else {
                    self.manager.clear_prefetched_params(owner);
                }
            }
            timing.wait += t.elapsed();

            let pending = compute.saturating_sub(held) + store_bytes + import_bytes;
            let preferred = eviction_order(&p.segment_params, k);
            // In the order they are prepared (a staging pool is checked placing them so).
            let ordered: Vec<ParamId> = p.segment_groups[k].iter().flatten().copied().collect();
            let t = Instant::now();
            let ask = |request| CapacityAsk {
                what: what.clone(),
                backend_name: backend_name.clone(),
                request,
                required: &ordered,
                preferred: &preferred,
                protected: &ordered,
                pending_unless_pooled: false,
            };
            let room = ensure_capacity(
                self.manager,
                self.others,
                &ask(self.request(d, pending)),
                self.log,
            );
            match room {
                // The workspace kept from a larger segment is more than this one needs (the
                // plan counts this segment's own): give it back and ask again.
                Err(e) if e.is_out_of_memory() && held > compute => {
                    tracing::debug!(held, compute, "releasing the larger workspace for room");
                    self.session.slots[d].workspace.release();
                    self.session.sync(self.manager);
                    let pending = compute + store_bytes + import_bytes;
                    ensure_capacity(
                        self.manager,
                        self.others,
                        &ask(self.request(d, pending)),
                        self.log,
                    )?;
                }
                other => other?,
            }
            timing.capacity += t.elapsed();
            for (name, t) in &imports {
                self.session.slots[d].cut_cache.store(name, t)?;
            }
            // One call per usage group (see `Prepared::segment_groups`).
            let t = Instant::now();
            self.session.pinned_now.clear();
            for group in &p.segment_groups[k] {
                if let Err(e) = self.manager.prepare_params(group) {
                    let pinned = std::mem::take(&mut self.session.pinned_now);
                    if let Err(u) = self.manager.unpin_params(&pinned) {
                        tracing::warn!(error = %u, "unpinning after a failed prepare");
                    }
                    return Err(e.into());
                }
                self.session.pinned_now.extend_from_slice(group);
            }
            timing.staging += t.elapsed();
            // From here on the segment's weights are pinned: unpin whatever happens.
            let r = self.compute_segment(
                task,
                p,
                k,
                &inputs,
                prefetch_on,
                &mut queued,
                store_bytes,
                timing,
            );
            let pinned = std::mem::take(&mut self.session.pinned_now);
            let unpinned = self.manager.unpin_params(&pinned);
            let (cache_bytes, direct_outputs) = r?;
            unpinned?;
            self.session.slots[d].workspace.end_graph();
            for slot in &mut self.session.slots {
                slot.cut_cache
                    .retain(|n| seg.future_cuts.contains(n) || outputs_so_far.contains(n));
            }
            self.session.sync(self.manager);
            reports.push(SegmentReport {
                index: k,
                name: seg.name.clone(),
                device: d,
                params: params.len(),
                weight_bytes: p.segment_weight_bytes[k],
                compute_bytes: compute,
                cache_bytes,
                copied_bytes: import_bytes,
                prefetched,
                direct_outputs,
            });
        }
        if queued.is_some() {
            self.manager.clear_prefetched_params(owner);
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
        })
    }

    /// Steps 6-8 of segment `k` on its device; returns the device's cut cache bytes after
    /// storing its outputs.
    #[allow(clippy::too_many_arguments)]
    fn compute_segment(
        &mut self,
        task: &ComputeTask,
        p: &Prepared,
        k: usize,
        inputs: &HostInputs<'_>,
        prefetch_on: bool,
        queued: &mut Option<(usize, Vec<ParamId>)>,
        store_bytes: u64,
        timing: &mut ExecTiming,
    ) -> Result<(u64, usize)> {
        let plan = &p.plan;
        let seg = &plan.segments[k];
        let d = p.segment_device[k];
        let sg = SegmentGraph::for_execution(
            &p.graph,
            plan,
            k,
            &self.session.slots[d].cut_cache,
            inputs,
        )?;
        // Cut outputs that later segments or the caller read are computed straight into
        // their cut-cache entries (capacity for them was asked for as `store_bytes`); the
        // others are copied there after computing.
        let mut direct: HashSet<CutName> = HashSet::new();
        for (o, t) in sg.outputs() {
            if (o.graph_output || seg.future_cuts.contains(&o.name))
                && !direct.contains(&o.name)
                && self.session.slots[d].cut_cache.bind_output(&o.name, t)?
            {
                tracing::trace!(cut = %o.name, bytes = t.nbytes(), planned = o.bytes, "cut bound");
                direct.insert(o.name.clone());
            }
        }
        self.session.slots[d].workspace.allocate(sg)?;
        self.session.sync(self.manager);
        if prefetch_on {
            let t = Instant::now();
            *queued = self.enqueue_prefetch(task, p, k, store_bytes);
            timing.wait += t.elapsed();
        }
        // Weights uploaded on the copy stream: the compute backend already waits for them in
        // its queue; the host waits here, so that the wait is measured apart from compute.
        let t = Instant::now();
        self.manager.wait_for_uploads();
        timing.upload_wait += t.elapsed();
        let slot = &mut self.session.slots[d];
        let Some(sg) = slot.workspace.current() else {
            return Err(ExecError::Ggml {
                context: format!("segment {k} '{}'", seg.name),
                source: sd_tensor::GgmlError::Mismatch("workspace lost its graph".into()),
            });
        };
        let t = Instant::now();
        sg.upload(inputs)?;
        slot.backend
            .compute(sg.graph())
            .map_err(ExecError::ggml(format!(
                "computing segment {k} '{}'",
                seg.name
            )))?;
        timing.compute += t.elapsed();
        let outs: Vec<_> = sg
            .outputs()
            .iter()
            .filter(|(o, _)| o.graph_output || seg.future_cuts.contains(&o.name))
            .map(|(o, t)| (o.name.clone(), t.clone()))
            .collect();
        for (name, t) in outs {
            if !direct.contains(&name) {
                tracing::trace!(cut = %name, bytes = t.nbytes(), view = t.view_src().is_some(), store_bytes, "storing a cut after compute");
                slot.cut_cache.store(&name, &t)?;
            }
        }
        Ok((slot.cut_cache.bytes() as u64, direct.len()))
    }

    /// Best effort: schedules the next segment's missing weights on its device now if they
    /// fit (evicting only what the policy allows, never the current segment's weights).
    /// The manager copies them on a transfer thread while this segment computes.
    fn enqueue_prefetch(
        &mut self,
        task: &ComputeTask,
        p: &Prepared,
        k: usize,
        store_bytes: u64,
    ) -> Option<(usize, Vec<ParamId>)> {
        let current: HashSet<ParamId> = p.segment_params[k].iter().copied().collect();
        let (target, _) = p
            .segment_params
            .iter()
            .enumerate()
            .skip(k + 1)
            .find(|(_, ids)| !ids.is_empty())?;
        // In the order they are prefetched (one call per usage group).
        let missing: Vec<ParamId> = p.segment_groups[target]
            .iter()
            .flatten()
            .copied()
            .filter(|x| !current.contains(x))
            .collect();
        if missing.is_empty() {
            return None;
        }
        let td = p.segment_device[target];
        let mut protected: Vec<ParamId> = p.segment_params[k].clone();
        protected.extend_from_slice(&missing);
        // On the current device the segment's outputs are still to be stored; and the
        // target segment's workspace growth is left free (a prefetch must not take it).
        let ws = &self.session.slots[td].workspace;
        let growth = ws
            .buffer_type()
            .footprint(p.plan.segments[target].bytes.compute_buffer as u64)
            .saturating_sub(ws.bytes());
        let pending = if td == p.segment_device[k] {
            store_bytes + growth
        } else {
            growth
        };
        let request = self.request(td, pending);
        let backend_name = self.session.slots[td].backend.name().to_string();
        let preferred = eviction_order(&p.segment_params, target);
        let ok = ensure_capacity(
            self.manager,
            self.others,
            &CapacityAsk {
                what: format!("prefetch for segment {target} of '{}'", task.description),
                backend_name,
                request,
                required: &missing,
                preferred: &preferred,
                protected: &protected,
                pending_unless_pooled: true,
            },
            self.log,
        );
        if ok.is_err() {
            tracing::debug!(target, "prefetch skipped: no room");
            return None;
        }
        // One call per usage group, as for prepare.
        let owner = self.session.id.owner();
        let mut scheduled: Vec<ParamId> = Vec::new();
        for group in &p.segment_groups[target] {
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
                other => {
                    tracing::debug!(target, result = ?other, "prefetch not scheduled");
                }
            }
        }
        if scheduled.is_empty() {
            None
        } else {
            Some((target, scheduled))
        }
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

/// The preferred eviction order when segment `k` needs room: the other segments' weights,
/// the one whose next use is furthest away first, for a graph that runs again the same way
/// (a sampling loop calls the same UNet every step). Segments already run in this pass are
/// next needed in the next pass, the most recent one last of all: `k-1, k-2, ..., 0`, then
/// the segments still to come in this pass, the last first: `n-1, ..., k+1`. Evicting in
/// this order keeps a fixed resident set across steps and streams only the rest, where a
/// least-recently-used order would evict exactly the weights the pass needs next.
pub(crate) fn eviction_order(segment_params: &[Vec<ParamId>], k: usize) -> Vec<Vec<ParamId>> {
    let n = segment_params.len();
    (0..k)
        .rev()
        .chain((k + 1..n).rev())
        .map(|j| segment_params[j].clone())
        .collect()
}

#[cfg(test)]
mod eviction_order_tests {
    use super::*;

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
