//! Choosing how a graph runs: captured and planned once per step (whole, and with the
//! task's cut marks when it is segmented), the choice for a graph under a limit kept from
//! step to step ([`ChoiceKey`]), cuts refined where a segment does not fit
//! ([`crate::refine`]) and merged where consecutive ones fit a third of the limit.

use super::*;

impl<M: DeviceResidencyManager> Exec<'_, M> {
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

    pub(super) fn prepare_captured(
        &mut self,
        graph: CapturedGraph,
        marks: &CutMarks,
    ) -> Result<Prepared> {
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
        let segment_uses = SegmentUses::new(&segment_params);
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
            segment_uses,
            stable_cuts: Default::default(),
        })
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
    pub(super) fn should_segment(&self, task: &ComputeTask, whole: &Prepared) -> Result<bool> {
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
    /// weights, one for weights that stay resident from step to step. With a staging pool
    /// (and [`StreamingOptions::pool_sized_segments`](crate::StreamingOptions::pool_sized_segments))
    /// a merged segment's weights also stay within a quarter of the room the fine plan
    /// leaves for weights (the limit less its largest non-weight need: about the pool), so
    /// that the streaming window of the resident set (two segments' streamed weights) fits
    /// beside kept weights. With a staging pool, a merged segment's weights stay within the
    /// pool divided by [`StreamingOptions::stream_window`](crate::StreamingOptions::stream_window),
    /// so that merging does not undo what `refine_for_pool` cut for the window. The merged
    /// plan is measured like any other; if a merged segment does not fit the limit after
    /// all, the fine plan runs. Off with [`StreamingOptions::merge_segments`](crate::StreamingOptions::merge_segments), under
    /// [`SegmentationPolicy::Always`], and without a limit.
    pub(super) fn merge_segments(
        &mut self,
        task: &ComputeTask,
        fine: Prepared,
    ) -> Result<Prepared> {
        let cfg = &self.session.config;
        if !cfg.streaming.merge_segments || cfg.segmentation == SegmentationPolicy::Always {
            return Ok(fine);
        }
        let Some(limit) = self.segment_limit() else {
            return Ok(fine);
        };
        let target = limit / 3;
        let weight_cap = if cfg.streaming.staging_pool && cfg.streaming.pool_sized_segments {
            let nonweight = (0..fine.plan.segments.len())
                .map(|k| {
                    crate::refine::segment_need(&fine, k)
                        .saturating_sub(fine.segment_weight_bytes[k])
                })
                .max()
                .unwrap_or(0);
            limit.saturating_sub(nonweight) / cfg.streaming.segment_weight_share.max(1) as u64
        } else {
            u64::MAX
        };
        // A fine plan with a staging pool keeps it, and its window: no merged segment's
        // weights outgrow the pool's share of one segment (see
        // [`StreamingOptions::stream_window`](crate::StreamingOptions::stream_window)).
        let pooled = self.staging_pool_size(&fine, true);
        let weight_cap = weight_cap.min(pooled.map_or(u64::MAX, |p| {
            if cfg.streaming.stream_window > 1 {
                super::pool::window_share(p, cfg.streaming.stream_window)
            } else {
                p
            }
        }));
        let segs = &fine.plan.segments;
        // Ranges of consecutive cut segments; the final segment stays on its own.
        let mut ranges: Vec<(usize, usize)> = Vec::new();
        let (mut w, mut c, mut o, mut l) = (0u64, 0u64, 0u64, 0u64);
        for (k, seg) in segs.iter().enumerate() {
            let sw = fine.segment_weight_bytes[k];
            let sc = seg.bytes.compute_buffer as u64;
            let so = seg.bytes.outputs as u64;
            let sl = seg.bytes.live_cuts as u64;
            let fits = w + sw + c.max(sc) + o + so + l.max(sl) <= target && w + sw <= weight_cap;
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
        if pooled.is_some() && self.staging_pool_size(&merged, true).is_none() {
            tracing::debug!(limit, "merged plan leaves no staging pool: fine plan");
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
}
