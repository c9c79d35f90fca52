//! The planner: turns a [`GraphView`] with cut marks into a [`Plan`].
//!
//! 1. Cut nodes are grouped by cut group; groups become segments in the order their first
//!    cut appears in the graph, moved after the groups whose cuts they read. The graph outputs that are not cuts (nodes nothing consumes,
//!    and OUTPUT-flagged nodes) form a final segment after them.
//! 2. Each segment walks backwards from its outputs through sources. A leaf becomes a
//!    parameter or external input; a cut produced by an earlier segment becomes a
//!    previous-cut input and stops the walk; any other node is computed by the segment.
//!    Shared non-cut nodes are thus recomputed in every segment that needs them; the
//!    segment that computes such a node first owns it, the others list it in
//!    [`Segment::recomputed_nodes`].
//! 3. A view computed by a segment also needs its storage root: if the root is neither
//!    computed here nor received as a cut, and no previous-cut input views the same root
//!    (the segment builder re-bases the view onto it), the root is computed here too.
//! 4. Liveness of cut outputs, byte totals and the compute buffer of each segment (through
//!    a [`SegmentMeasure`]) complete the plan; warnings become [`Diagnostic`]s.

use std::collections::HashMap;

use crate::error::{GraphCutError, Result};
use crate::liveness;
use crate::marks::{CutName, FINAL_GROUP};
use crate::plan::{
    Diagnostic, DiagnosticKind, InputKind, InputRef, Plan, Recomputation, Segment, SegmentBytes,
    SegmentKind, SegmentOutput,
};
use crate::view::{GraphView, TensorRef};

/// Options of the planner.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PlanOptions {
    /// Turn every [`Diagnostic`] into an error ([`GraphCutError::Warning`]).
    pub warnings_as_errors: bool,
}

/// Measures the compute buffer of a segment while it is planned.
pub trait SegmentMeasure {
    /// The compute buffer bytes of segment `index` (its inputs and outputs are final; its
    /// liveness and recomputation lists are not filled in yet).
    fn measure(&mut self, index: usize, segment: &Segment) -> Result<usize>;

    /// The compute buffer bytes of segment `index` once its liveness is filled in: the
    /// cut outputs no later segment reads (cuts inside a merged segment) stay in its
    /// workspace instead of the cut cache. Default: [`measure`](Self::measure).
    fn remeasure(&mut self, index: usize, segment: &Segment) -> Result<usize> {
        self.measure(index, segment)
    }
}

impl<F: FnMut(usize, &Segment) -> Result<usize>> SegmentMeasure for F {
    fn measure(&mut self, index: usize, segment: &Segment) -> Result<usize> {
        self(index, segment)
    }
}

/// A measure that reports 0 bytes (planning without a backend).
#[derive(Clone, Copy, Debug, Default)]
pub struct NoMeasure;

impl SegmentMeasure for NoMeasure {
    fn measure(&mut self, _index: usize, _segment: &Segment) -> Result<usize> {
        Ok(0)
    }
}

struct Seed {
    name: String,
    kind: SegmentKind,
    outputs: Vec<usize>,
}

/// Plans `view`. `measure` gives each segment's compute buffer.
pub fn plan_view(
    view: &GraphView,
    options: &PlanOptions,
    measure: &mut dyn SegmentMeasure,
) -> Result<Plan> {
    let nodes = view.nodes();
    let n = nodes.len();
    let _span =
        tracing::debug_span!("plan_graph", nodes = n, leaves = view.leaves().len()).entered();

    // Who consumes what (sources and view roots).
    let mut consumed = vec![false; n];
    for (i, d) in nodes.iter().enumerate() {
        for s in d.sources().chain(d.view_src) {
            match s {
                TensorRef::Node(j) if j != i => consumed[j] = true,
                _ => {}
            }
        }
    }
    let is_graph_output = |i: usize| !consumed[i] || nodes[i].is_output_flagged();

    // Seeds: cut groups in first-appearance order, then the final segment.
    let mut seeds: Vec<Seed> = Vec::new();
    let mut group_of: HashMap<&str, usize> = HashMap::new();
    let mut cut_segment: Vec<Option<usize>> = vec![None; n];
    let mut final_roots = Vec::new();
    for (i, d) in nodes.iter().enumerate() {
        match &d.cut {
            Some(c) => {
                let g = *group_of.entry(c.name.group()).or_insert_with(|| {
                    seeds.push(Seed {
                        name: c.name.group().to_string(),
                        kind: SegmentKind::Cut,
                        outputs: Vec::new(),
                    });
                    seeds.len() - 1
                });
                seeds[g].outputs.push(i);
                cut_segment[i] = Some(g);
            }
            None if is_graph_output(i) => final_roots.push(i),
            None => {}
        }
    }
    // Segments follow the groups' dependencies: a group comes after every group whose cuts
    // it reads, first appearance breaking ties. (A block whose outputs are several streams,
    // a DiT's image and text tokens, can finish one stream early in the graph's order,
    // before fine cuts inside it that its other stream reads.)
    let order = dependency_order(nodes, &seeds, &cut_segment);
    if order.iter().enumerate().any(|(i, &g)| i != g) {
        let mut remap = vec![0usize; seeds.len()];
        for (new, &old) in order.iter().enumerate() {
            remap[old] = new;
        }
        let mut taken: Vec<Option<Seed>> = seeds.into_iter().map(Some).collect();
        seeds = order.iter().filter_map(|&g| taken[g].take()).collect();
        for c in cut_segment.iter_mut().flatten() {
            *c = remap[*c];
        }
    }
    let has_cuts = !seeds.is_empty();
    if !final_roots.is_empty() {
        seeds.push(Seed {
            name: FINAL_GROUP.to_string(),
            kind: SegmentKind::Final,
            outputs: final_roots,
        });
    }

    let mut diagnostics: Vec<Diagnostic> = Vec::new();
    let mut available: Vec<Option<usize>> = vec![None; n];
    let mut owner: Vec<Option<usize>> = cut_segment.clone();
    let mut seen_node = vec![0u32; n];
    let mut internal_mark = vec![0u32; n];
    let mut seen_leaf = vec![0u32; view.leaves().len()];
    let mut segments: Vec<Segment> = Vec::with_capacity(seeds.len());

    for (k, seed) in seeds.iter().enumerate() {
        let epoch = k as u32 + 1;
        let mut internal: Vec<usize> = Vec::new();
        let mut inputs: Vec<InputRef> = Vec::new();
        let mut stack: Vec<TensorRef> = seed
            .outputs
            .iter()
            .rev()
            .map(|&i| TensorRef::Node(i))
            .collect();
        let mut checked_views = 0usize;
        loop {
            while let Some(r) = stack.pop() {
                match r {
                    TensorRef::Leaf(l) => {
                        if seen_leaf[l] == epoch {
                            continue;
                        }
                        seen_leaf[l] = epoch;
                        let d = &view.leaves()[l];
                        let kind = if d.is_param {
                            InputKind::Param
                        } else {
                            InputKind::External
                        };
                        inputs.push(InputRef {
                            kind,
                            tensor: r,
                            name: d.name.clone(),
                            bytes: d.bytes,
                            cut: None,
                        });
                        if let Some(v) = d.view_src {
                            stack.push(v);
                        }
                    }
                    TensorRef::Node(m) => {
                        if seen_node[m] == epoch {
                            continue;
                        }
                        seen_node[m] = epoch;
                        let d = &nodes[m];
                        if let Some(p) = available[m] {
                            let name = d
                                .cut
                                .as_ref()
                                .map(|c| c.name.clone())
                                .unwrap_or_else(|| CutName::final_output(m));
                            inputs.push(InputRef {
                                kind: InputKind::PreviousCut,
                                tensor: r,
                                name: d.name.clone(),
                                bytes: d.bytes,
                                cut: Some((name, p)),
                            });
                            continue;
                        }
                        internal_mark[m] = epoch;
                        internal.push(m);
                        if owner[m].is_none() {
                            owner[m] = Some(k);
                        }
                        stack.extend(d.sources());
                        if let Some(v @ TensorRef::Leaf(_)) = d.view_src {
                            stack.push(v);
                        }
                    }
                }
            }
            // Storage roots of the views computed here.
            let mut added = false;
            while checked_views < internal.len() {
                let m = internal[checked_views];
                checked_views += 1;
                let Some(TensorRef::Node(root)) = nodes[m].view_src else {
                    continue;
                };
                if internal_mark[root] == epoch
                    || seen_node[root] == epoch && available[root].is_some()
                {
                    continue;
                }
                let carried = inputs.iter().any(|i| {
                    i.kind == InputKind::PreviousCut
                        && matches!(i.tensor, TensorRef::Node(c) if nodes[c].view_src == Some(TensorRef::Node(root)))
                });
                if !carried || available[root].is_some() {
                    stack.push(TensorRef::Node(root));
                    added = true;
                }
            }
            if !added {
                break;
            }
        }
        internal.sort_unstable();
        inputs.sort_by_key(|i| (i.kind, i.tensor));

        for &m in &internal {
            if let Some(c) = &nodes[m].cut {
                if cut_segment[m].is_some_and(|s| s > k) {
                    diagnostics.push(Diagnostic {
                        kind: DiagnosticKind::CutOfLaterGroupRecomputed,
                        message: format!(
                            "segment '{}' needs cut '{}' ({}) of a later group; its producers are computed twice",
                            seed.name,
                            c.name,
                            view.describe(TensorRef::Node(m))
                        ),
                        location: c.location,
                    });
                }
            }
        }

        let outputs: Vec<SegmentOutput> = seed
            .outputs
            .iter()
            .map(|&o| SegmentOutput {
                node: o,
                name: nodes[o]
                    .cut
                    .as_ref()
                    .map(|c| c.name.clone())
                    .unwrap_or_else(|| CutName::final_output(o)),
                bytes: nodes[o].bytes,
                is_cut: nodes[o].cut.is_some(),
                graph_output: is_graph_output(o),
            })
            .collect();
        let sum = |kind: InputKind| {
            inputs
                .iter()
                .filter(|i| i.kind == kind)
                .map(|i| i.bytes)
                .sum()
        };
        let bytes = SegmentBytes {
            compute_buffer: 0,
            outputs: outputs.iter().map(|o| o.bytes).sum(),
            input_external: sum(InputKind::External),
            input_previous_cut: sum(InputKind::PreviousCut),
            input_param: sum(InputKind::Param),
            live_cuts: 0,
            future_cuts: 0,
        };
        let mut segment = Segment {
            name: seed.name.clone(),
            kind: seed.kind,
            internal_nodes: internal,
            recomputed_nodes: Vec::new(),
            outputs,
            inputs,
            consumed_cuts: Vec::new(),
            future_cuts: Vec::new(),
            live_cuts: Vec::new(),
            bytes,
        };
        segment.bytes.compute_buffer = measure.measure(k, &segment)?;
        for o in segment.outputs.iter().filter(|o| o.is_cut) {
            available[o.node] = Some(k);
        }
        tracing::trace!(segment = k, name = %segment.name, nodes = segment.internal_nodes.len(), inputs = segment.inputs.len(), "segment planned");
        segments.push(segment);
    }

    // Recomputations.
    let mut also: HashMap<usize, Vec<usize>> = HashMap::new();
    for (k, s) in segments.iter_mut().enumerate() {
        s.recomputed_nodes = s
            .internal_nodes
            .iter()
            .copied()
            .filter(|&m| owner[m] != Some(k))
            .collect();
        for &m in &s.recomputed_nodes {
            also.entry(m).or_default().push(k);
        }
    }
    let mut recomputations: Vec<Recomputation> = also
        .into_iter()
        .map(|(node, also_in)| Recomputation {
            node,
            owner: owner[node].unwrap_or(0),
            also_in,
        })
        .collect();
    recomputations.sort_by_key(|r| r.node);

    // Liveness.
    let lives = liveness::compute(&segments);
    for (s, l) in segments.iter_mut().zip(lives) {
        s.consumed_cuts = l.consumed;
        s.future_cuts = l.future;
        s.live_cuts = l.live;
        s.bytes.live_cuts = l.live_bytes;
        s.bytes.future_cuts = l.future_bytes;
    }
    // Cuts read only inside their own (merged) segment live in its workspace at run time:
    // measured again with that known.
    for (k, s) in segments.iter_mut().enumerate() {
        let inner = s
            .outputs
            .iter()
            .any(|o| o.is_cut && !o.graph_output && !s.future_cuts.contains(&o.name));
        if inner {
            s.bytes.compute_buffer = measure.remeasure(k, s)?;
        }
    }

    // Cuts nothing reads.
    let mut read = vec![false; n];
    for s in &segments {
        for i in s.inputs_of(InputKind::PreviousCut) {
            if let TensorRef::Node(c) = i.tensor {
                read[c] = true;
            }
        }
    }
    for (i, d) in nodes.iter().enumerate() {
        if let Some(c) = &d.cut {
            if !read[i] && !is_graph_output(i) {
                diagnostics.push(Diagnostic {
                    kind: DiagnosticKind::UnconsumedCut,
                    message: format!(
                        "cut '{}' ({}) is read by no later segment",
                        c.name,
                        view.describe(TensorRef::Node(i))
                    ),
                    location: c.location,
                });
            }
        }
    }
    // Debug: a plan's diagnostics are about the model's cut marks (cuts that merged
    // segments hold inside, marks on tensors a graph lacks), not the user's run; `sd plan`
    // lists them, and `warnings_as_errors` makes them errors for the model's own tests.
    for d in &diagnostics {
        tracing::debug!("graph cut: {d}");
    }
    if options.warnings_as_errors {
        if let Some(d) = diagnostics.first() {
            return Err(GraphCutError::Warning(d.to_string()));
        }
    }

    let plan = Plan {
        fingerprint: view.fingerprint(),
        n_nodes: n,
        n_leaves: view.leaves().len(),
        has_cuts,
        segments,
        recomputations,
        diagnostics,
    };
    tracing::debug!(
        segments = plan.segments.len(),
        recomputed = plan.recomputations.len(),
        "graph planned"
    );
    Ok(plan)
}

/// The order of the cut groups `seeds`: a topological order of "reads a cut of" (walking
/// back from a group's outputs through nodes that are not cuts of another group), the
/// first-appearance order among groups that are free to go. Groups caught in a cycle keep
/// their first-appearance order (the planner then recomputes and warns, as before).
fn dependency_order(
    nodes: &[crate::view::TensorDesc],
    seeds: &[Seed],
    cut_segment: &[Option<usize>],
) -> Vec<usize> {
    let g_count = seeds.len();
    let mut preds: Vec<Vec<usize>> = vec![Vec::new(); g_count];
    let mut seen = vec![usize::MAX; nodes.len()];
    for (g, seed) in seeds.iter().enumerate() {
        let mut stack: Vec<usize> = seed.outputs.clone();
        while let Some(m) = stack.pop() {
            if seen[m] == g {
                continue;
            }
            seen[m] = g;
            if let Some(h) = cut_segment[m] {
                if h != g {
                    if !preds[g].contains(&h) {
                        preds[g].push(h);
                    }
                    continue;
                }
            }
            for src in nodes[m].sources().chain(nodes[m].view_src) {
                if let TensorRef::Node(j) = src {
                    if j != m {
                        stack.push(j);
                    }
                }
            }
        }
    }
    let mut placed = vec![false; g_count];
    let mut order = Vec::with_capacity(g_count);
    while order.len() < g_count {
        let next = (0..g_count)
            .find(|&g| !placed[g] && preds[g].iter().all(|&h| placed[h]))
            .or_else(|| (0..g_count).find(|&g| !placed[g]));
        let Some(g) = next else { break };
        placed[g] = true;
        order.push(g);
    }
    order
}
