//! Cut granularity: a segmented plan starts at the block boundaries (level-0 marks) and
//! is refined only where a segment does not fit the limit.
//!
//! Model code marks fine cuts inside blocks ([`CutMarks::mark_fine`]: between layers, then
//! inside layers). For every segment whose footprint (its weights, compute buffer, live
//! cuts and graph outputs) exceeds the limit, the next finer level of marks lying inside
//! that segment is turned on and the graph is planned again, until every segment fits or
//! no finer mark is left. The memory floor is therefore one layer (or one attention /
//! feed-forward) instead of one block, while segments that fit keep their block size.
//! What fits at no granularity fails here, before anything runs, with
//! [`ExecError::BudgetTooSmall`] naming the segment, its largest tensor and the minimum
//! budget.
//!
//! [`CutMarks::mark_fine`]: sd_graphcut::CutMarks::mark_fine

use std::collections::{HashMap, HashSet};

use sd_graphcut::{InputKind, TensorRef};
use sd_residency::DeviceResidencyManager;
use sd_tensor::ggml::TensorId;

use crate::error::{BudgetShortfall, ExecError, Result};
use crate::execution::{window_share, Exec, Prepared};
use crate::task::ComputeTask;

/// The device bytes segment `k` of `p` holds at its peak, as planned: its weights, the
/// compute buffer (the session's one workspace, which keeps the size of the largest
/// segment's buffer), the cuts live while it runs and the graph outputs it produces, plus
/// one allocation granularity of rounding for each buffer they take (the workspace, each
/// cut and output, each weight group).
pub(crate) fn segment_need(p: &Prepared, k: usize) -> u64 {
    segment_plan(p, k).need
}

/// The parts of segment `k`'s planned peak (see [`segment_need`]).
pub(crate) fn segment_plan(p: &Prepared, k: usize) -> crate::task::SegmentPlan {
    let seg = &p.plan.segments[k];
    let outputs: usize = seg
        .outputs
        .iter()
        .filter(|o| o.graph_output && !o.is_cut)
        .map(|o| o.bytes)
        .sum();
    let workspace = p.plan.max_compute_buffer() as u64;
    let weights = p.segment_weight_bytes[k];
    let cuts = seg.bytes.live_cuts as u64;
    let buffers = 1 + seg.live_cuts.len() + seg.outputs.len() + p.segment_groups[k].len();
    let rounding = p.granularity.saturating_sub(1) * buffers as u64;
    crate::task::SegmentPlan {
        name: seg.name.clone(),
        device: p.segment_device[k],
        params: p.segment_params[k].len(),
        weight_bytes: weights,
        compute_bytes: seg.bytes.compute_buffer as u64,
        workspace_bytes: workspace,
        cut_bytes: cuts,
        output_bytes: outputs as u64,
        need: weights + workspace + cuts + outputs as u64 + rounding,
    }
}

/// Refinement rounds tried for a staging pool (see `Exec::refine_for_pool`).
const MAX_POOL_ROUNDS: usize = 4;

/// Turns on the next finer level of `task`'s marks inside each of `targets` (segments of
/// `p`); `false` when none has a finer mark left.
fn enable_finer(
    task: &ComputeTask,
    p: &Prepared,
    targets: &[usize],
    enabled: &mut HashSet<TensorId>,
    node_of: &HashMap<TensorId, usize>,
) -> bool {
    let mut added = false;
    for &k in targets {
        let inside: HashSet<usize> = p.plan.segments[k].internal_nodes.iter().copied().collect();
        let candidates: Vec<_> = task
            .marks
            .iter()
            .filter(|m| !enabled.contains(&m.tensor))
            .filter(|m| node_of.get(&m.tensor).is_some_and(|n| inside.contains(n)))
            .collect();
        if let Some(level) = candidates.iter().map(|m| m.level).min() {
            for m in candidates.iter().filter(|m| m.level == level) {
                enabled.insert(m.tensor);
            }
            added = true;
        }
    }
    added
}

impl<M: DeviceResidencyManager> Exec<'_, M> {
    /// Refines `coarse` (planned with the task's level-0 marks) with finer marks inside
    /// every segment over the limit (see the module documentation). Without a limit, or
    /// when every segment fits, returns it unchanged.
    pub(crate) fn refine(&mut self, task: &ComputeTask, coarse: Prepared) -> Result<Prepared> {
        let Some(limit) = self.segment_limit() else {
            return Ok(coarse);
        };
        let mut enabled: HashSet<TensorId> = coarse.marks.iter().map(|m| m.tensor).collect();
        let node_of: HashMap<TensorId, usize> = coarse
            .graph
            .node_tensors()
            .iter()
            .enumerate()
            .map(|(i, t)| (t.id(), i))
            .collect();
        let mut p = coarse;
        let mut rounds = 0usize;
        loop {
            let over: Vec<usize> = (0..p.plan.segments.len())
                .filter(|&k| segment_need(&p, k) > limit)
                .collect();
            if over.is_empty() {
                if rounds > 0 {
                    tracing::debug!(
                        segments = p.plan.segments.len(),
                        rounds,
                        "plan refined with cuts inside blocks"
                    );
                }
                let p = self.refine_for_pool(task, p, enabled, &node_of, limit)?;
                return self.refine_for_residency(task, p, &node_of, limit);
            }
            // The workspace is sized by the largest compute buffer: refine its segment too.
            let mut targets = over.clone();
            if let Some(k) =
                (0..p.plan.segments.len()).max_by_key(|&k| p.plan.segments[k].bytes.compute_buffer)
            {
                if !targets.contains(&k) {
                    targets.push(k);
                }
            }
            if !enable_finer(task, &p, &targets, &mut enabled, &node_of) {
                return Err(self.too_small(task, &p, &over, limit));
            }
            rounds += 1;
            let marks = task.marks.select(|m| enabled.contains(&m.tensor));
            p = self.prepare_plan(task, &marks)?;
        }
    }

    /// A plan whose segments all fit can still leave a staging pool (the limit less the
    /// largest non-weight need, see `Exec::staging_pool_size`) too little room for the
    /// largest segment's weights: then no pool is used and every streamed segment is staged
    /// in buffers of its own, allocated and freed inside every step (SD1.5 at 64x64
    /// latents under a quarter of its weights: 81 device allocations a step, a third of
    /// their frees under queued compute). And a pool that holds the largest segment but not
    /// [`StreamingOptions::stream_window`](crate::StreamingOptions::stream_window) of them cannot
    /// take the next segments' prefetches while a large one computes: such segments are
    /// staged synchronously, the device idle meanwhile (SDXL at half its weights: 6 of 14).
    /// Refines the segments whose weights exceed one segment's share of the pool (the next
    /// finer marks inside them) while every segment still fits, until the pool holds the
    /// window. When that is not reached, the first refined plan whose pool holds the most
    /// segments of any (at least one more than `p`'s) runs, else `p`: refining further
    /// only adds segments, each with its host work (SD1.5 at a quarter of its weights, its
    /// pool short of two segments even refined: 54 segments instead of 35, 14% slower on an
    /// H100).
    fn refine_for_pool(
        &mut self,
        task: &ComputeTask,
        p: Prepared,
        mut enabled: HashSet<TensorId>,
        node_of: &HashMap<TensorId, usize>,
        limit: u64,
    ) -> Result<Prepared> {
        let window = self.session.config.streaming.stream_window.max(1);
        // How many of `q`'s largest segments its pool holds, up to the window (0: no
        // pool).
        let level = |this: &Self, q: &Prepared| -> usize {
            if this.staging_pool_size(q, true).is_none() {
                return 0;
            }
            let Some((room, _)) = this.staging_pool_room(q, true) else {
                return 0;
            };
            let largest = q.segment_weight_bytes.iter().copied().max().unwrap_or(0);
            (2..=window)
                .take_while(|&n| largest <= window_share(room, n))
                .last()
                .unwrap_or(1)
        };
        let start = level(self, &p);
        if !self.session.config.streaming.refine_for_pool
            || p.plan.segments.len() < 2
            || start >= window
        {
            return Ok(p);
        }
        let mut refined: Vec<(Prepared, usize)> = Vec::new();
        for round in 1..=MAX_POOL_ROUNDS {
            let q = refined.last().map_or(&p, |(q, _)| q);
            let Some((room, _)) = self.staging_pool_room(q, true) else {
                break;
            };
            // Without a pool yet, the pool is to hold one segment first.
            let most = if self.staging_pool_size(q, true).is_some() && window > 1 {
                window_share(room, window)
            } else {
                room
            };
            let targets: Vec<usize> = (0..q.plan.segments.len())
                .filter(|&k| q.segment_weight_bytes[k] > most)
                .collect();
            if !enable_finer(task, q, &targets, &mut enabled, node_of) {
                break;
            }
            let marks = task.marks.select(|m| enabled.contains(&m.tensor));
            let next = self.prepare_plan(task, &marks)?;
            if (0..next.plan.segments.len()).any(|k| segment_need(&next, k) > limit) {
                break;
            }
            let l = level(self, &next);
            tracing::trace!(
                round,
                segments = next.plan.segments.len(),
                level = l,
                "refined for the pool"
            );
            refined.push((next, l));
            if l >= window {
                break;
            }
        }
        let best = refined.iter().map(|(_, l)| *l).max().unwrap_or(0);
        if best <= start {
            tracing::debug!(
                window,
                holds = start,
                "no refinement holds more segments in the staging pool: the plan as it was"
            );
            return Ok(p);
        }
        let at = refined.iter().position(|(_, l)| *l == best).unwrap_or(0);
        let (plan, _) = refined.swap_remove(at);
        tracing::debug!(
            segments = plan.plan.segments.len(),
            was = p.plan.segments.len(),
            window,
            holds = best,
            "plan refined so that the staging pool holds more of its segments"
        );
        Ok(plan)
    }

    /// With [`StreamingOptions::refine_for_residency`](crate::StreamingOptions::refine_for_residency):
    /// refines the segments whose weights exceed `1 / segment_weight_share` of the staging
    /// pool's room for weights (the next finer marks inside them), while every segment
    /// still fits and a pool is left, for at most `MAX_POOL_ROUNDS` rounds. The resident
    /// set keeps what each segment streams beyond a common cap and leaves a window of a few
    /// segments' streamed weights: with smaller segments the window is smaller and more
    /// weights stay (SD1.5 at 64x64 latents on the simulated device, share 16: under 0.75
    /// of its weights 36 segments streaming 0.90 GB a step instead of 12 streaming 1.24;
    /// under half, 53 streaming 1.28 GB instead of 17 streaming 1.60).
    fn refine_for_residency(
        &mut self,
        task: &ComputeTask,
        p: Prepared,
        node_of: &HashMap<TensorId, usize>,
        limit: u64,
    ) -> Result<Prepared> {
        let streaming = &self.session.config.streaming;
        if !streaming.refine_for_residency || p.plan.segments.len() < 2 {
            return Ok(p);
        }
        let share = streaming.segment_weight_share.max(1) as u64;
        let mut enabled: HashSet<TensorId> = p.marks.iter().map(|m| m.tensor).collect();
        let mut p = p;
        for round in 1..=MAX_POOL_ROUNDS {
            let Some((room, _)) = self.staging_pool_room(&p, true) else {
                break;
            };
            let most = room / share;
            let targets: Vec<usize> = (0..p.plan.segments.len())
                .filter(|&k| p.segment_weight_bytes[k] > most)
                .collect();
            if targets.is_empty() {
                break;
            }
            let mut finer = enabled.clone();
            if !enable_finer(task, &p, &targets, &mut finer, node_of) {
                break;
            }
            let marks = task.marks.select(|m| finer.contains(&m.tensor));
            let next = self.prepare_plan(task, &marks)?;
            if (0..next.plan.segments.len()).any(|k| segment_need(&next, k) > limit)
                || self.staging_pool_size(&next, true).is_none()
            {
                break;
            }
            tracing::debug!(
                round,
                segments = next.plan.segments.len(),
                was = p.plan.segments.len(),
                most,
                "plan refined for a larger resident set"
            );
            enabled = finer;
            p = next;
        }
        Ok(p)
    }

    /// The error for segments `over` of `p` that fit the limit at no granularity.
    fn too_small(&self, task: &ComputeTask, p: &Prepared, over: &[usize], limit: u64) -> ExecError {
        let need = |k: usize| segment_need(p, k);
        let worst = over.iter().copied().max_by_key(|&k| need(k)).unwrap_or(0);
        let minimum = over.iter().map(|&k| need(k)).max().unwrap_or(0);
        let seg = &p.plan.segments[worst];
        // The largest weight of the segment (or, without weights, its largest node).
        let weights: Vec<(String, u64)> = seg
            .inputs
            .iter()
            .filter(|i| i.kind == InputKind::Param)
            .map(|i| {
                let b = match i.tensor {
                    TensorRef::Leaf(l) => p
                        .graph
                        .leaf_tensors()
                        .get(l)
                        .and_then(|t| self.manager.resolve_param(t.id()))
                        .and_then(|id| p.param_bytes.get(&id).copied())
                        .unwrap_or(i.bytes as u64),
                    TensorRef::Node(_) => i.bytes as u64,
                };
                (i.name.clone(), b)
            })
            .collect();
        let nodes = || {
            seg.internal_nodes.iter().map(|&n| {
                let t = &p.graph.node_tensors()[n];
                (format!("{} ({})", t.name(), t.op_name()), t.nbytes() as u64)
            })
        };
        let (largest, largest_bytes) = if weights.is_empty() {
            nodes().max_by_key(|(_, b)| *b).unwrap_or_default()
        } else {
            weights
                .into_iter()
                .max_by_key(|(_, b)| *b)
                .unwrap_or_default()
        };
        ExecError::BudgetTooSmall(Box::new(BudgetShortfall {
            task: task.description.clone(),
            backend: self.session.config.backend.name().to_string(),
            segment: seg.name.clone(),
            weight_bytes: p.segment_weight_bytes[worst],
            compute_bytes: p.plan.max_compute_buffer() as u64,
            live_cut_bytes: seg.bytes.live_cuts as u64,
            largest,
            largest_bytes,
            minimum,
            limit,
            runtime_reserve: 0,
        }))
    }
}
