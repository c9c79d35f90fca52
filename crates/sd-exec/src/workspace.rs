//! [`ComputeWorkspace`]: the compute buffer of a session (one ggml graph allocator on the
//! session's compute buffer type), the segment graph it currently holds, and the graphs
//! kept from earlier executions of the same plan (each laid out in the same buffer on its
//! own, valid while the buffer is the one they were allocated in).

use std::collections::HashMap;

use sd_graphcut::{CutName, Fingerprint, SegmentGraph};
use sd_tensor::ggml::{BufferType, Gallocr};

use crate::error::{ExecError, Result};

/// One graph allocator whose buffer counts against the session's budget.
///
/// The buffer only grows inside ggml; [`prepare`](Self::prepare) releases it first when a
/// graph needs more, so that the old and the new buffer never exist at the same time.
pub struct ComputeWorkspace {
    buft: BufferType,
    // Field order: the allocator (which forgets its tensors' memory) before their graph.
    galloc: Option<Gallocr>,
    current: Option<SegmentGraph>,
    /// The allocator's generation when `current` was allocated.
    current_generation: u64,
    /// Graphs computed before, kept for the next execution of the same plan (see
    /// [`take_reusable`](Self::take_reusable)), by plan fingerprint and segment: one plan's
    /// at a time.
    kept: HashMap<(Fingerprint, usize), KeptGraph>,
    reservations: usize,
    /// The compute bytes of segment graphs measured by [`grows_for`](Self::grows_for),
    /// by plan and segment.
    needs: HashMap<(Fingerprint, usize), u64>,
}

/// A graph kept by [`ComputeWorkspace::keep_graph`].
struct KeptGraph {
    generation: u64,
    graph: SegmentGraph,
    direct: Vec<CutName>,
}

/// At most this many graphs are kept (a plan of more segments keeps its first ones).
const MAX_KEPT_GRAPHS: usize = 4096;

impl std::fmt::Debug for ComputeWorkspace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ComputeWorkspace")
            .field("buffer_type", &self.buft.name())
            .field("bytes", &self.bytes())
            .field("reservations", &self.reservations)
            .finish()
    }
}

impl ComputeWorkspace {
    /// An empty workspace allocating from `buft`.
    pub fn new(buft: BufferType) -> ComputeWorkspace {
        ComputeWorkspace {
            buft,
            galloc: None,
            current: None,
            current_generation: 0,
            kept: HashMap::new(),
            reservations: 0,
            needs: HashMap::new(),
        }
    }

    /// The buffer type it allocates from.
    pub fn buffer_type(&self) -> BufferType {
        self.buft
    }

    /// Device bytes of its buffer now (0 when released): its size rounded up to the buffer
    /// type's allocation granularity.
    pub fn bytes(&self) -> u64 {
        self.galloc
            .as_ref()
            .map_or(0, |g| self.buft.footprint(g.buffer_size() as u64))
    }

    /// Number of allocators created so far (a growing graph re-creates it).
    pub fn reservations(&self) -> usize {
        self.reservations
    }

    /// Whether no buffer is held.
    pub fn is_released(&self) -> bool {
        self.galloc.is_none()
    }

    /// Prepares for a graph needing `needed` bytes: releases the buffer if it is smaller
    /// (ggml would otherwise grow it in place). Returns the bytes still held.
    pub fn prepare(&mut self, needed: u64) -> u64 {
        if self.galloc.is_some() && self.bytes() < needed {
            self.release();
        }
        self.bytes()
    }

    /// The buffer bytes `graph` (segment `segment` of the plan `plan`) needs, as the
    /// allocator will lay it out: measured once per plan and segment.
    pub fn need(&mut self, graph: &SegmentGraph, plan: Fingerprint, segment: usize) -> u64 {
        if self.needs.len() > 4096 {
            self.needs.clear();
        }
        let buft = self.buft;
        *self.needs.entry((plan, segment)).or_insert_with(|| {
            sd_tensor::ggml::Gallocr::new(buft)
                .map(|g| g.measure(graph.graph()) as u64)
                .unwrap_or(0)
        })
    }

    /// Whether allocating `graph` (segment `segment` of the plan `plan`) would grow the
    /// buffer, freeing the one held (ggml reallocates a buffer too small for a graph).
    /// False without a buffer.
    pub fn grows_for(&mut self, graph: &SegmentGraph, plan: Fingerprint, segment: usize) -> bool {
        let need = self.need(graph, plan, segment);
        self.galloc
            .as_ref()
            .is_some_and(|g| need > g.buffer_size() as u64)
    }

    /// Allocates `graph`'s tensors in the buffer (creating or growing it; a buffer that
    /// grows takes the memory of every kept graph, which is then dropped) and holds the
    /// graph as the current one.
    pub fn allocate(&mut self, graph: SegmentGraph) -> Result<&SegmentGraph> {
        if self.galloc.is_none() {
            let g = Gallocr::new(self.buft).map_err(ExecError::ggml("creating the allocator"))?;
            self.galloc = Some(g);
            self.reservations += 1;
        }
        let Some(galloc) = self.galloc.as_mut() else {
            return Err(ExecError::Ggml {
                context: "compute workspace".into(),
                source: sd_tensor::GgmlError::Mismatch("allocator missing".into()),
            });
        };
        if let Err(e) = galloc.alloc_graph_kept(graph.graph()) {
            // ggml may have dropped the buffer: start over next time.
            self.release();
            return Err(ExecError::ggml("allocating the compute buffer")(e));
        }
        let generation = galloc.generation();
        self.current_generation = generation;
        self.kept.retain(|_, k| k.generation == generation);
        Ok(&*self.current.insert(graph))
    }

    /// The graph kept by [`keep_graph`](Self::keep_graph) for segment `segment` of the plan
    /// `plan`, if its tensors still have their memory here (the buffer is the one it was
    /// allocated in): it becomes the current graph again without building or allocating.
    /// Returns the outputs it computed into cut-cache entries last time.
    pub fn take_reusable(&mut self, plan: Fingerprint, segment: usize) -> Option<Vec<CutName>> {
        let kept = self.kept.remove(&(plan, segment))?;
        let galloc = self.galloc.as_ref()?;
        if kept.generation != galloc.generation() {
            return None;
        }
        self.current_generation = kept.generation;
        self.current = Some(kept.graph);
        Some(kept.direct)
    }

    /// Gives the current graph back when it is not to be reused after all.
    pub fn drop_current(&mut self) {
        self.current = None;
    }

    /// The current graph (mutable, see [`take_reusable`](Self::take_reusable)).
    pub fn current_mut(&mut self) -> Option<&mut SegmentGraph> {
        self.current.as_mut()
    }

    /// Like [`end_graph`](Self::end_graph), but keeps the graph for the next execution of
    /// segment `segment` of the plan `plan` (see [`take_reusable`](Self::take_reusable)),
    /// with the outputs it computed into cut-cache entries (`direct`). The graphs kept for
    /// other plans go.
    pub fn keep_graph(&mut self, plan: Fingerprint, segment: usize, direct: Vec<CutName>) {
        let Some(graph) = self.current.take() else {
            return;
        };
        self.kept.retain(|(f, _), _| *f == plan);
        if self.kept.len() >= MAX_KEPT_GRAPHS {
            return;
        }
        self.kept.insert(
            (plan, segment),
            KeptGraph {
                generation: self.current_generation,
                graph,
                direct,
            },
        );
    }

    /// Number of graphs kept for reuse.
    pub fn kept_graphs(&self) -> usize {
        self.kept.len()
    }

    /// The graph allocated last (until [`end_graph`](Self::end_graph) or release).
    pub fn current(&self) -> Option<&SegmentGraph> {
        self.current.as_ref()
    }

    /// Frees the buffer and the graph it held (their tensors lose their memory).
    pub fn release(&mut self) {
        self.galloc = None;
        self.current = None;
        self.kept.clear();
    }

    /// Drops the graph it holds but keeps the buffer (and the kept graphs) for the next
    /// graph.
    pub fn end_graph(&mut self) {
        self.current = None;
    }
}
