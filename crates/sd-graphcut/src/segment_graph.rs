//! Segment sub-graphs: building, measuring and running one segment of a plan with ggml.
//!
//! # Binding without touching the original graph
//!
//! A segment graph is built in a fresh no_alloc context from **copies** of the original
//! tensor descriptors ([`Context::copy_node`]): each internal node is copied with its
//! sources re-pointed at
//! - the copies of earlier internal nodes of the segment,
//! - the cut cache's tensor for a previous-cut input (same type, dimensions and strides as
//!   the cut, holding its data; a view whose storage root lives in an earlier segment is
//!   re-based onto the cached cut that carries that root's bytes),
//! - the original leaf for a weight or an external input that has data, or a private copy
//!   of an external input that is filled from [`HostInputs`] after allocation.
//!
//! The original graph's descriptors are never modified: "restoring its bindings" after a
//! segment is dropping the segment's context. So the original graph can still be computed
//! monolithically, captured again, or segmented with another plan, and no other holder of
//! its tensors can observe a temporary binding. The cost is one descriptor copy per
//! internal node per run (a few hundred bytes each).
//!
//! For measuring, weights and previous cuts are private placeholder copies that the
//! allocator treats as already allocated
//! ([`measure_with_external`]), so the
//! measured compute buffer holds the segment's activations and external inputs, whether or
//! not weights are loaded yet.

use std::collections::HashMap;

use sd_tensor::ggml::graph_ext::measure_with_external;
use sd_tensor::ggml::{Backend, BufferType, Context, GTensor, Gallocr, Graph, TensorId};

use crate::cut_cache::CutCache;
use crate::error::{ggml, GraphCutError, Result};
use crate::marks::CutName;
use crate::plan::{InputKind, Plan, Segment, SegmentOutput};
use crate::planner::SegmentMeasure;
use crate::view::{CapturedGraph, TensorRef};

/// Data for external inputs, by tensor: host bytes, or a tensor that already holds the data
/// in some backend buffer (a runner cache entry on the device). An external input found here
/// is written into a private copy in every segment that reads it (like uploading the inputs
/// of a monolithic graph after allocation; a tensor source is copied backend to backend, so
/// device-resident data never goes through the host); one not found here must already have
/// data.
#[derive(Clone, Debug, Default)]
pub struct HostInputs<'a> {
    map: HashMap<TensorId, InputData<'a>>,
}

#[derive(Clone, Debug)]
enum InputData<'a> {
    Bytes(&'a [u8]),
    Tensor(GTensor),
}

impl<'a> HostInputs<'a> {
    /// No host inputs.
    pub fn new() -> HostInputs<'a> {
        HostInputs::default()
    }

    /// Host bytes for input tensor `t` (exactly `t.nbytes()` bytes, in its layout).
    pub fn insert(&mut self, t: &GTensor, bytes: &'a [u8]) -> Result<()> {
        if bytes.len() != t.nbytes() {
            return Err(GraphCutError::InvalidGraph {
                node: format!("input '{}'", t.name()),
                detail: format!(
                    "{} host bytes for a tensor of {} bytes",
                    bytes.len(),
                    t.nbytes()
                ),
            });
        }
        self.map.insert(t.id(), InputData::Bytes(bytes));
        Ok(())
    }

    /// A tensor with data (same type and shape as `t`) to copy into input `t`.
    pub fn insert_tensor(&mut self, t: &GTensor, src: &GTensor) -> Result<()> {
        if src.type_code() != t.type_code() || src.ne() != t.ne() {
            return Err(GraphCutError::InvalidGraph {
                node: format!("input '{}'", t.name()),
                detail: format!(
                    "source '{}' is {:?} of type {}, the input {:?} of type {}",
                    src.name(),
                    src.ne(),
                    src.type_code(),
                    t.ne(),
                    t.type_code()
                ),
            });
        }
        self.map.insert(t.id(), InputData::Tensor(src.clone()));
        Ok(())
    }

    /// The host bytes for a tensor (`None` if it has none, or a tensor source).
    pub fn get(&self, id: TensorId) -> Option<&'a [u8]> {
        match self.map.get(&id) {
            Some(InputData::Bytes(b)) => Some(b),
            _ => None,
        }
    }

    /// Whether there is data (bytes or a tensor) for a tensor.
    pub fn contains(&self, id: TensorId) -> bool {
        self.map.contains_key(&id)
    }

    /// Writes the data for input `id` into `dst`.
    fn write_into(
        &self,
        id: TensorId,
        dst: &GTensor,
    ) -> Option<std::result::Result<(), sd_tensor::GgmlError>> {
        Some(match self.map.get(&id)? {
            InputData::Bytes(b) => dst.write_bytes(0, b),
            InputData::Tensor(src) => Backend::copy_tensor(src, dst),
        })
    }
}

enum Mode<'a> {
    Measure,
    Execute {
        cache: &'a CutCache,
        inputs: &'a HostInputs<'a>,
    },
}

/// The ggml graph of one segment, built from copies of the original descriptors (see the
/// module documentation).
pub struct SegmentGraph {
    index: usize,
    name: String,
    // Field order: the graph before its context.
    graph: Graph,
    _ctx: Context,
    outputs: Vec<(SegmentOutput, GTensor)>,
    /// The copies that are views, in execution order (a view's source before it).
    views: Vec<GTensor>,
    /// The segment's internal nodes copied (one copy each).
    copied: usize,
    uploads: Vec<(GTensor, TensorId)>,
    /// The captured graph's leaf behind each of `uploads` (same order).
    upload_leaves: Vec<usize>,
    /// Leaves used in place (weights, inputs that already had data): (leaf, tensor, data
    /// address when built).
    in_place: Vec<(usize, TensorId, usize)>,
    /// Previous cuts read from cut-cache entries: (cut, the graph's stand-in for the
    /// entry, pointed at its memory).
    cut_inputs: Vec<(CutName, GTensor)>,
    placeholders: Vec<GTensor>,
    /// Tensors of other contexts the copies point at (kept alive with the graph).
    _keep: Vec<GTensor>,
    /// [`Graph::data_addresses_hash`] when it last ran (see [`note_run`](Self::note_run)).
    last_addresses: Option<u64>,
}

impl std::fmt::Debug for SegmentGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SegmentGraph")
            .field("index", &self.index)
            .field("name", &self.name)
            .field("graph", &self.graph)
            .finish()
    }
}

struct Rebase {
    root: usize,
    tensor: GTensor,
    start: usize,
}

impl SegmentGraph {
    /// The graph of segment `index` for measuring: weights and previous cuts are
    /// placeholders, external inputs are allocated by the allocator.
    pub fn for_measure(
        graph: &CapturedGraph,
        segment: &Segment,
        index: usize,
    ) -> Result<SegmentGraph> {
        build(graph, segment, index, Mode::Measure)
    }

    /// The graph of segment `index` of `plan` for running: previous cuts are bound to their
    /// entries in `cache`, weights and external inputs with data are used in place, and
    /// external inputs found in `inputs` get private copies to upload into.
    pub fn for_execution(
        graph: &CapturedGraph,
        plan: &Plan,
        index: usize,
        cache: &CutCache,
        inputs: &HostInputs<'_>,
    ) -> Result<SegmentGraph> {
        let segment = checked_segment(graph, plan, index)?;
        build(graph, segment, index, Mode::Execute { cache, inputs })
    }

    /// The ggml graph.
    pub fn graph(&self) -> &Graph {
        &self.graph
    }

    /// The segment's outputs and their tensors in this graph.
    pub fn outputs(&self) -> &[(SegmentOutput, GTensor)] {
        &self.outputs
    }

    /// The compute buffer a fresh allocator of `buft` needs for this graph (placeholders
    /// counted as allocated elsewhere).
    pub fn measure(&self, buft: BufferType) -> Result<usize> {
        self.measure_kept(buft, |_| true)
    }

    /// [`measure`](Self::measure) with only the cut outputs `kept` accepts (those a later
    /// segment reads) in the cut cache: the others stay in the workspace, as at run time.
    pub fn measure_kept(&self, buft: BufferType, kept: impl Fn(&CutName) -> bool) -> Result<usize> {
        // Cut and graph outputs that are not views go to the cut cache when the segment
        // runs (`CutCache::bind_output`): measured as allocated elsewhere, as they will be,
        // so that the allocator lays the rest out as it will at run time.
        let mut external = self.placeholders.clone();
        external.extend(
            self.outputs
                .iter()
                .filter(|(o, t)| {
                    (o.graph_output || (o.is_cut && kept(&o.name))) && t.view_src().is_none()
                })
                .map(|(_, t)| t.clone()),
        );
        measure_with_external(buft, &self.graph, &external).map_err(ggml(format!(
            "measuring segment {} '{}'",
            self.index, self.name
        )))
    }

    /// Whether this graph, built for a graph with the same fingerprint as `graph` (an
    /// earlier step of a sampling loop), can run `graph`'s segment again as it is: the
    /// same weights and in-place inputs (the same tensors, with memory; they may have
    /// moved, see [`rebase_views`](Self::rebase_views)), host data for every input it
    /// uploads and none for those it uses in place, and the same cut-cache entries (where
    /// they were). Then [`retarget`](Self::retarget) points its uploads at `graph`'s
    /// inputs and nothing needs building or allocating: the backend sees the very graph it
    /// ran before (ggml's CUDA backend replays such a graph as a CUDA graph when nothing it
    /// reads moved).
    pub fn reusable_for(
        &self,
        graph: &CapturedGraph,
        cache: &CutCache,
        inputs: &HostInputs<'_>,
    ) -> bool {
        let leaves = graph.leaf_tensors();
        let leaf_id = |l: usize| leaves.get(l).map(|t| t.id());
        // Weights are read where they are when the graph runs (they may have moved since:
        // `rebase_views` points the views of them at their new place).
        self.in_place.iter().all(|(l, id, _)| {
            leaves
                .get(*l)
                .is_some_and(|t| t.id() == *id && t.is_allocated())
                && !inputs.contains(*id)
        }) && self
            .upload_leaves
            .iter()
            .all(|l| leaf_id(*l).is_some_and(|id| inputs.contains(id)))
            && self.cut_inputs.iter().all(|(name, t)| {
                cache.get(name).is_some_and(|e| {
                    e.is_allocated()
                        && e.type_code() == t.type_code()
                        && e.ne() == t.ne()
                        && e.nb() == t.nb()
                })
            })
    }

    /// Whether this graph was built for `segment` (its name and its node count): a kept
    /// graph is only run again for the segment it computes.
    pub fn built_for(&self, segment: &Segment) -> bool {
        self.name == segment.name && self.copied == segment.internal_nodes.len()
    }

    /// Points the graph's stand-ins for previous cuts at their entries in `cache` now
    /// (checked by [`reusable_for`](Self::reusable_for)); run before
    /// [`rebase_views`](Self::rebase_views).
    pub fn rebind_cuts(&self, cache: &CutCache) -> Result<()> {
        for (name, t) in &self.cut_inputs {
            let e = cache
                .get(name)
                .ok_or_else(|| self.err(format!("cut '{name}' is not in the cut cache")))?;
            t.alias_memory(e).map_err(ggml(format!(
                "binding cut '{name}' of segment {}",
                self.index
            )))?;
        }
        Ok(())
    }

    /// Points every view among the graph's nodes at its source's memory as it is now (see
    /// [`GTensor::rebase_view`]): run before computing a kept graph whose weights or cut
    /// outputs may have moved since it was allocated.
    pub fn rebase_views(&self) {
        for t in &self.views {
            t.rebase_view();
        }
    }

    /// Notes that the graph is about to run with its memory as it is now; returns whether
    /// every node and source is where it was when it last ran (so ggml's CUDA backend can
    /// replay the CUDA graph it captured then; `false` the first time).
    pub fn note_run(&mut self) -> bool {
        let now = self.graph.data_addresses_hash();
        self.last_addresses.replace(now) == Some(now)
    }

    /// Points the uploads at `graph`'s input leaves (see [`reusable_for`](Self::reusable_for)).
    pub fn retarget(&mut self, graph: &CapturedGraph) {
        let leaves = graph.leaf_tensors();
        for ((_, id), l) in self.uploads.iter_mut().zip(&self.upload_leaves) {
            if let Some(t) = leaves.get(*l) {
                *id = t.id();
            }
        }
    }

    /// Writes the host data of the external inputs copied into this graph (after the
    /// graph was allocated).
    pub fn upload(&self, inputs: &HostInputs<'_>) -> Result<()> {
        for (t, id) in &self.uploads {
            let written = inputs
                .write_into(*id, t)
                .ok_or_else(|| self.err(format!("no host data for input '{}'", t.name())))?;
            written.map_err(ggml(format!(
                "uploading input '{}' of segment {}",
                t.name(),
                self.index
            )))?;
        }
        Ok(())
    }

    /// Whether [`upload_queued`](Self::upload_queued) can queue every upload of this graph
    /// on `backend`: each input's data is host bytes (a tensor source is copied
    /// synchronously, by [`upload`](Self::upload)) and its copy in the graph is in a buffer
    /// the backend queues writes into.
    pub fn uploads_queue(&self, inputs: &HostInputs<'_>, backend: &Backend) -> bool {
        self.uploads
            .iter()
            .all(|(t, id)| inputs.get(*id).is_some() && backend.queues_write(t))
    }

    /// [`upload`](Self::upload) queued on `backend` ([`Backend::write_queued`]): the
    /// writes land after the work queued on it before (a graph still computing in the same
    /// workspace) and before this graph, without the host waiting.
    ///
    /// # Safety
    /// The inputs' bytes must stay allocated and unchanged until `backend` is
    /// synchronised (or an event recorded on it after this call has completed).
    pub unsafe fn upload_queued(&self, inputs: &HostInputs<'_>, backend: &Backend) -> Result<()> {
        for (t, id) in &self.uploads {
            let bytes = inputs
                .get(*id)
                .ok_or_else(|| self.err(format!("no host bytes for input '{}'", t.name())))?;
            // SAFETY: the caller keeps the inputs' bytes until the copies ran.
            unsafe { backend.write_queued(t, bytes) }.map_err(ggml(format!(
                "queueing the upload of input '{}' of segment {}",
                t.name(),
                self.index
            )))?;
        }
        Ok(())
    }

    fn err(&self, detail: String) -> GraphCutError {
        GraphCutError::Segment {
            segment: self.index,
            name: self.name.clone(),
            detail,
        }
    }
}

/// Checks that `plan` belongs to `graph` and returns its segment `index`.
fn checked_segment<'p>(graph: &CapturedGraph, plan: &'p Plan, index: usize) -> Result<&'p Segment> {
    check_plan(graph, plan)?;
    plan.segments
        .get(index)
        .ok_or_else(|| GraphCutError::Segment {
            segment: index,
            name: "?".into(),
            detail: format!("the plan has {} segments", plan.segments.len()),
        })
}

fn check_plan(graph: &CapturedGraph, plan: &Plan) -> Result<()> {
    if plan.fingerprint != graph.view().fingerprint() {
        return Err(GraphCutError::FingerprintMismatch {
            plan: plan.fingerprint.to_string(),
            graph: graph.view().fingerprint().to_string(),
        });
    }
    Ok(())
}

fn build(
    graph: &CapturedGraph,
    seg: &Segment,
    index: usize,
    mode: Mode<'_>,
) -> Result<SegmentGraph> {
    let _span = tracing::debug_span!("build_segment_graph", segment = index, name = %seg.name, nodes = seg.internal_nodes.len()).entered();
    let view = graph.view();
    let err = |detail: String| GraphCutError::Segment {
        segment: index,
        name: seg.name.clone(),
        detail,
    };
    let gerr = |what: String| ggml(format!("segment {index} '{}': {what}", seg.name));
    // The segment must refer to this graph's positions (a plan for another graph is refused
    // by fingerprint before; a bare segment is checked here).
    let in_range = |r: TensorRef| match r {
        TensorRef::Leaf(l) => l < view.leaves().len(),
        TensorRef::Node(m) => m < view.nodes().len(),
    };
    if let Some(bad) = seg
        .internal_nodes
        .iter()
        .chain(seg.outputs.iter().map(|o| &o.node))
        .map(|&m| TensorRef::Node(m))
        .chain(seg.inputs.iter().map(|i| i.tensor))
        .find(|&r| !in_range(r))
    {
        return Err(err(format!(
            "refers to {bad:?}, which this graph does not have"
        )));
    }
    let n_tensors = seg.internal_nodes.len() + seg.inputs.len() + 8;
    let ctx = Context::new_descriptors(n_tensors, n_tensors, 1).map_err(gerr("context".into()))?;

    let mut leaves: HashMap<usize, GTensor> = HashMap::new();
    let mut nodes: HashMap<usize, GTensor> = HashMap::new();
    let mut bound: HashMap<usize, GTensor> = HashMap::new();
    let mut carriers: HashMap<usize, Vec<(usize, GTensor, usize)>> = HashMap::new();
    let mut rebased: HashMap<usize, Rebase> = HashMap::new();
    let mut placeholders = Vec::new();
    let mut uploads = Vec::new();
    let mut upload_leaves = Vec::new();
    let mut in_place = Vec::new();
    let mut cut_inputs = Vec::new();
    let mut keep = Vec::new();
    let mut roots: Vec<GTensor> = Vec::new();

    for input in &seg.inputs {
        let orig = graph.tensor(input.tensor);
        match (input.kind, input.tensor) {
            (InputKind::Param, TensorRef::Leaf(l)) => {
                let t = match mode {
                    Mode::Measure => {
                        let c = ctx
                            .new_tensor_like(orig)
                            .map_err(gerr(format!("placeholder of '{}'", orig.name())))?;
                        placeholders.push(c.clone());
                        c
                    }
                    Mode::Execute { .. } => {
                        if !orig.is_allocated() {
                            return Err(err(format!(
                                "parameter '{}' ({}) has no data",
                                orig.name(),
                                view.describe(input.tensor)
                            )));
                        }
                        keep.push(orig.clone());
                        in_place.push((l, orig.id(), orig.data_addr()));
                        orig.clone()
                    }
                };
                roots.push(t.clone());
                leaves.insert(l, t);
            }
            (InputKind::External, TensorRef::Leaf(l)) => {
                let host = match mode {
                    Mode::Measure => true,
                    Mode::Execute { inputs, .. } => inputs.contains(orig.id()),
                };
                let t = if host {
                    let c = ctx
                        .new_tensor_like(orig)
                        .map_err(gerr(format!("copy of input '{}'", orig.name())))?;
                    c.set_input();
                    if matches!(mode, Mode::Execute { .. }) {
                        uploads.push((c.clone(), orig.id()));
                        upload_leaves.push(l);
                    }
                    c
                } else if orig.is_allocated() {
                    keep.push(orig.clone());
                    in_place.push((l, orig.id(), orig.data_addr()));
                    orig.clone()
                } else {
                    return Err(err(format!(
                        "external input '{}' ({}) has no data and no host data was given",
                        orig.name(),
                        view.describe(input.tensor)
                    )));
                };
                roots.push(t.clone());
                leaves.insert(l, t);
            }
            (InputKind::PreviousCut, TensorRef::Node(c)) => {
                let t = match mode {
                    Mode::Measure => {
                        let t = ctx
                            .new_tensor_like(orig)
                            .map_err(gerr(format!("placeholder of cut '{}'", orig.name())))?;
                        placeholders.push(t.clone());
                        t
                    }
                    Mode::Execute { cache, .. } => {
                        let name: CutName =
                            input.cut.as_ref().map(|(n, _)| n.clone()).ok_or_else(|| {
                                err(format!(
                                    "previous-cut input {} has no cut name",
                                    view.describe(input.tensor)
                                ))
                            })?;
                        let t = cache.get(&name).ok_or_else(|| {
                            err(format!(
                                "cut '{name}' ({}) is not in the cut cache",
                                view.describe(input.tensor)
                            ))
                        })?;
                        if t.type_code() != orig.type_code()
                            || t.ne() != orig.ne()
                            || t.nb() != orig.nb()
                        {
                            return Err(err(format!(
                                "cached cut '{name}' has another type or layout than {}",
                                view.describe(input.tensor)
                            )));
                        }
                        // A stand-in pointed at the entry (again at each reuse, see
                        // `rebind_cuts`): the graph outlives the entry it was built with.
                        let stand_in = ctx
                            .new_tensor_like(t)
                            .map_err(gerr(format!("stand-in of cut '{name}'")))?;
                        stand_in
                            .alias_memory(t)
                            .map_err(gerr(format!("stand-in of cut '{name}'")))?;
                        cut_inputs.push((name, stand_in.clone()));
                        stand_in
                    }
                };
                if let Some(TensorRef::Node(root)) = view.nodes()[c].view_src {
                    carriers.entry(root).or_default().push((
                        c,
                        t.clone(),
                        view.nodes()[c].view_offs,
                    ));
                }
                roots.push(t.clone());
                bound.insert(c, t.clone());
                nodes.insert(c, t);
            }
            (kind, r) => {
                return Err(err(format!(
                    "input {} is listed as {kind:?}",
                    view.describe(r)
                )))
            }
        }
    }

    let lookup = |r: TensorRef,
                  leaves: &HashMap<usize, GTensor>,
                  nodes: &HashMap<usize, GTensor>|
     -> Option<GTensor> {
        match r {
            TensorRef::Leaf(l) => leaves.get(&l).cloned(),
            TensorRef::Node(m) => nodes.get(&m).cloned(),
        }
    };

    let mut copies: Vec<GTensor> = Vec::with_capacity(seg.internal_nodes.len());
    let mut views: Vec<GTensor> = Vec::new();
    for &m in &seg.internal_nodes {
        let d = &view.nodes()[m];
        let orig = graph.tensor(TensorRef::Node(m));
        let here = || view.describe(TensorRef::Node(m));
        let mut srcs = Vec::with_capacity(d.srcs.len());
        for s in &d.srcs {
            srcs.push(match s {
                None => None,
                // The op reads its own result; the copy reads itself.
                Some(TensorRef::Node(j)) if *j == m => None,
                Some(r) => Some(lookup(*r, &leaves, &nodes).ok_or_else(|| {
                    err(format!(
                        "{} reads {} which the segment neither computes nor receives",
                        here(),
                        view.describe(*r)
                    ))
                })?),
            });
        }
        let view_base: Option<(GTensor, usize)> = match d.view_src {
            None => None,
            Some(r @ TensorRef::Leaf(_)) => Some((
                lookup(r, &leaves, &nodes).ok_or_else(|| {
                    err(format!(
                        "{} views {} which is not an input",
                        here(),
                        view.describe(r)
                    ))
                })?,
                d.view_offs,
            )),
            Some(TensorRef::Node(root)) => {
                if let Some(t) = nodes.get(&root) {
                    Some((t.clone(), d.view_offs))
                } else {
                    let fits = |start: usize, t: &GTensor| {
                        d.view_offs >= start && d.view_offs - start + d.bytes <= t.nbytes()
                    };
                    // A carrier among the sources: a bound cut or a re-based view of the same root.
                    let mut found: Option<(GTensor, usize)> = None;
                    for s in d.sources() {
                        let TensorRef::Node(j) = s else { continue };
                        if let Some(rb) = rebased.get(&j) {
                            if rb.root == root && fits(rb.start, &rb.tensor) {
                                found = Some((rb.tensor.clone(), rb.start));
                                break;
                            }
                        }
                        if let Some(t) = bound.get(&j) {
                            if view.nodes()[j].view_src == Some(TensorRef::Node(root))
                                && fits(view.nodes()[j].view_offs, t)
                            {
                                found = Some((t.clone(), view.nodes()[j].view_offs));
                                break;
                            }
                        }
                    }
                    if found.is_none() {
                        let candidates: Vec<&(usize, GTensor, usize)> = carriers
                            .get(&root)
                            .map(|v| v.iter().filter(|(_, t, start)| fits(*start, t)).collect())
                            .unwrap_or_default();
                        if candidates.len() == 1 {
                            found = Some((candidates[0].1.clone(), candidates[0].2));
                        }
                    }
                    let (t, start) = found.ok_or_else(|| {
                        err(format!(
                            "{} views the storage of {} at offset {}, which no input of the segment carries",
                            here(),
                            view.describe(TensorRef::Node(root)),
                            d.view_offs
                        ))
                    })?;
                    rebased.insert(
                        m,
                        Rebase {
                            root,
                            tensor: t.clone(),
                            start,
                        },
                    );
                    Some((t, d.view_offs - start))
                }
            }
        };
        let copy = ctx
            .copy_node(orig, &srcs, view_base.as_ref().map(|(t, o)| (t, *o)))
            .map_err(gerr(format!("copying {}", here())))?;
        nodes.insert(m, copy.clone());
        if view_base.is_some() {
            views.push(copy.clone());
        }
        copies.push(copy);
    }

    let mut outputs = Vec::with_capacity(seg.outputs.len());
    let internal: std::collections::HashSet<usize> = seg.internal_nodes.iter().copied().collect();
    for o in &seg.outputs {
        let t = nodes
            .get(&o.node)
            .filter(|_| internal.contains(&o.node))
            .cloned()
            .ok_or_else(|| err(format!("output {} is not computed by the segment", o.name)))?;
        // Flag this graph's own tensors only: the output and, for a view, its storage root
        // when the segment computes it (so the allocator does not reuse it).
        t.set_output_only();
        match view.nodes()[o.node].view_src {
            Some(TensorRef::Node(root)) if internal.contains(&root) => {
                if let Some(r) = nodes.get(&root) {
                    r.set_output_only();
                }
            }
            // A view of a leaf this segment holds a private copy of (an uploaded host
            // input): without the flag the allocator may reuse the copy's memory (in place)
            // before the output is read.
            Some(TensorRef::Leaf(l)) => {
                if let Some(r) = leaves.get(&l) {
                    if r.context().serial() == ctx.serial() {
                        r.set_output_only();
                    }
                }
            }
            _ => {}
        }
        outputs.push((o.clone(), t));
    }

    // Leaves first (every tensor the copies refer to is counted in the graph, so the
    // allocator's hash set is large enough), then the copies in execution order.
    let capacity = copies.len() + roots.len() + 8;
    let mut g = Graph::new(&ctx, capacity).map_err(gerr("graph".into()))?;
    for t in &roots {
        g.build_forward_expand(t)
            .map_err(gerr(format!("adding input '{}'", t.name())))?;
    }
    for t in &copies {
        g.build_forward_expand(t)
            .map_err(gerr(format!("adding '{}'", t.name())))?;
    }
    if g.n_nodes()
        != copies.len()
            + roots
                .iter()
                .filter(|t| !t.is_leaf() || t.is_param())
                .count()
    {
        return Err(err(format!(
            "graph has {} nodes, expected {}",
            g.n_nodes(),
            copies.len()
        )));
    }
    Ok(SegmentGraph {
        index,
        name: seg.name.clone(),
        graph: g,
        _ctx: ctx,
        outputs,
        views,
        copied: copies.len(),
        uploads,
        upload_leaves,
        in_place,
        cut_inputs,
        placeholders,
        last_addresses: None,
        _keep: keep,
    })
}

/// Measures segments with ggml's graph allocator for buffer type `buft` (see
/// [`SegmentGraph::measure`]).
pub struct GallocrMeasure<'g> {
    graph: &'g CapturedGraph,
    buft: BufferType,
}

impl<'g> GallocrMeasure<'g> {
    /// A measure over `graph` for allocators of `buft`.
    pub fn new(graph: &'g CapturedGraph, buft: BufferType) -> GallocrMeasure<'g> {
        GallocrMeasure { graph, buft }
    }
}

impl SegmentMeasure for GallocrMeasure<'_> {
    fn measure(&mut self, index: usize, segment: &Segment) -> Result<usize> {
        SegmentGraph::for_measure(self.graph, segment, index)?.measure(self.buft)
    }

    fn remeasure(&mut self, index: usize, segment: &Segment) -> Result<usize> {
        SegmentGraph::for_measure(self.graph, segment, index)?
            .measure_kept(self.buft, |n| segment.future_cuts.contains(n))
    }
}

/// What running one segment did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegmentRun {
    /// The segment.
    pub segment: usize,
    /// The allocator's compute buffer after allocating the segment.
    pub compute_buffer: usize,
    /// Cut and final outputs stored in the cut cache.
    pub stored: Vec<CutName>,
    /// Bytes in the cut cache after the segment (pruned to its future cuts and the graph
    /// outputs so far).
    pub cache_bytes: usize,
}

/// Runs segments of a plan on one backend with one graph allocator.
pub struct SegmentRunner<'b> {
    backend: &'b Backend,
    galloc: Gallocr,
    /// The last segment graph, kept until the next one is allocated (the allocator still
    /// refers to its tensors).
    last: Option<SegmentGraph>,
}

impl std::fmt::Debug for SegmentRunner<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SegmentRunner")
            .field("backend", &self.backend.name())
            .field("galloc", &self.galloc)
            .finish()
    }
}

impl<'b> SegmentRunner<'b> {
    /// A runner computing on `backend` with an allocator of its default buffer type.
    pub fn new(backend: &'b Backend) -> Result<SegmentRunner<'b>> {
        let galloc = Gallocr::new(backend.buffer_type()).map_err(ggml("segment allocator"))?;
        Ok(SegmentRunner {
            backend,
            galloc,
            last: None,
        })
    }

    /// Runs segment `index`: prunes `cache` to the segment's live cuts (and the graph
    /// outputs of earlier segments), builds and allocates its graph, uploads host inputs,
    /// computes, stores its outputs that later segments or the caller need, and prunes the
    /// cache to its future cuts and the graph outputs.
    pub fn run_segment(
        &mut self,
        graph: &CapturedGraph,
        plan: &Plan,
        index: usize,
        inputs: &HostInputs<'_>,
        cache: &mut CutCache,
    ) -> Result<SegmentRun> {
        let seg = checked_segment(graph, plan, index)?;
        let _span =
            tracing::debug_span!("run_segment", segment = index, name = %seg.name).entered();
        let outputs_so_far: Vec<&CutName> = plan.segments[..=index]
            .iter()
            .flat_map(|s| s.outputs.iter())
            .filter(|o| o.graph_output)
            .map(|o| &o.name)
            .collect();
        cache.retain(|n| seg.live_cuts.contains(n) || outputs_so_far.contains(&n));

        let sg = SegmentGraph::for_execution(graph, plan, index, cache, inputs)?;
        let gerr = |what: &str| ggml(format!("segment {index} '{}': {what}", seg.name));
        self.galloc
            .alloc_graph(sg.graph())
            .map_err(gerr("allocating"))?;
        self.last = None;
        sg.upload(inputs)?;
        self.backend
            .compute(sg.graph())
            .map_err(gerr("computing"))?;

        let mut stored = Vec::new();
        for (o, t) in sg.outputs() {
            if o.graph_output || seg.future_cuts.contains(&o.name) {
                cache.store(&o.name, t)?;
                stored.push(o.name.clone());
            }
        }
        let compute_buffer = self.galloc.buffer_size();
        self.last = Some(sg);
        cache.retain(|n| seg.future_cuts.contains(n) || outputs_so_far.contains(&n));
        Ok(SegmentRun {
            segment: index,
            compute_buffer,
            stored,
            cache_bytes: cache.bytes(),
        })
    }

    /// Runs every segment of `plan` in order, starting from an empty cache. Afterwards the
    /// cache holds the graph outputs ([`Plan::graph_outputs`]) by name.
    pub fn run(
        &mut self,
        graph: &CapturedGraph,
        plan: &Plan,
        inputs: &HostInputs<'_>,
        cache: &mut CutCache,
    ) -> Result<Vec<SegmentRun>> {
        let _span = tracing::debug_span!("run_plan", segments = plan.segments.len()).entered();
        check_plan(graph, plan)?;
        cache.clear();
        (0..plan.segments.len())
            .map(|k| self.run_segment(graph, plan, k, inputs, cache))
            .collect()
    }
}
