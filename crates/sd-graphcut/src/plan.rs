//! Plans: the ordered segments a graph runs as.

use std::fmt;
use std::panic::Location;

use crate::fingerprint::Fingerprint;
use crate::marks::CutName;
use crate::view::TensorRef;

/// What kind of tensor a segment input is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum InputKind {
    /// A parameter (weight) leaf.
    Param,
    /// A graph input leaf that is not a parameter (latents, timesteps, context, ...).
    External,
    /// The output of a cut computed by an earlier segment (read from the cut cache).
    PreviousCut,
}

/// One input of a segment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InputRef {
    /// Its kind.
    pub kind: InputKind,
    /// The leaf (parameter, external) or cut node (previous cut).
    pub tensor: TensorRef,
    /// The tensor's name (for messages).
    pub name: String,
    /// Bytes it spans.
    pub bytes: usize,
    /// For a previous cut: its name and the segment that produces it.
    pub cut: Option<(CutName, usize)>,
}

/// One output of a segment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegmentOutput {
    /// The node.
    pub node: usize,
    /// Its name: the cut name, or [`CutName::final_output`] for a final output.
    pub name: CutName,
    /// Bytes it spans (what the cut cache holds for it).
    pub bytes: usize,
    /// Whether it is a model cut (otherwise a final output of the graph).
    pub is_cut: bool,
    /// Whether the caller reads it after the graph ran (a node nothing consumes, or one
    /// flagged as a ggml output).
    pub graph_output: bool,
}

/// What a segment is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SegmentKind {
    /// The segment of one cut group.
    Cut,
    /// The final segment: the graph outputs that are not cuts.
    Final,
}

/// Byte totals of a segment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SegmentBytes {
    /// Compute buffer measured by ggml's graph allocator for this segment alone (its
    /// activations and external inputs; parameters and previous cuts live elsewhere).
    pub compute_buffer: usize,
    /// The segment's outputs.
    pub outputs: usize,
    /// External inputs.
    pub input_external: usize,
    /// Previous-cut inputs.
    pub input_previous_cut: usize,
    /// Parameter inputs.
    pub input_param: usize,
    /// Cut outputs held in the cut cache during the segment ([`Segment::live_cuts`]).
    pub live_cuts: usize,
    /// Cut outputs held after the segment ([`Segment::future_cuts`]).
    pub future_cuts: usize,
}

impl SegmentBytes {
    /// Device bytes the segment needs at once: compute buffer, parameters, and the cut
    /// cache while it runs (live cuts, which include its outputs needed later).
    pub fn footprint(&self) -> usize {
        self.compute_buffer + self.input_param + self.live_cuts
    }
}

/// One segment of a plan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Segment {
    /// The cut group, or [`FINAL_GROUP`](crate::FINAL_GROUP).
    pub name: String,
    /// Cut group or final segment.
    pub kind: SegmentKind,
    /// Nodes this segment computes, ascending (= execution order).
    pub internal_nodes: Vec<usize>,
    /// The internal nodes another segment owns: non-cut tensors shared between segments
    /// are recomputed in each segment that needs them, and listed here. Ascending.
    pub recomputed_nodes: Vec<usize>,
    /// Outputs in node order.
    pub outputs: Vec<SegmentOutput>,
    /// Inputs, sorted by (kind, tensor).
    pub inputs: Vec<InputRef>,
    /// Cut outputs this segment reads (its previous-cut inputs), by producing node order.
    pub consumed_cuts: Vec<CutName>,
    /// Cut outputs that must still be held after this segment: produced by it or earlier
    /// and read by a later segment.
    pub future_cuts: Vec<CutName>,
    /// Cut outputs held while this segment runs: `consumed_cuts` ∪ `future_cuts`.
    pub live_cuts: Vec<CutName>,
    /// Byte totals.
    pub bytes: SegmentBytes,
}

impl Segment {
    /// The parameter (weight) leaves this segment uses.
    pub fn params(&self) -> impl Iterator<Item = usize> + '_ {
        self.inputs.iter().filter_map(|i| match (i.kind, i.tensor) {
            (InputKind::Param, TensorRef::Leaf(l)) => Some(l),
            _ => None,
        })
    }

    /// Inputs of one kind.
    pub fn inputs_of(&self, kind: InputKind) -> impl Iterator<Item = &InputRef> + '_ {
        self.inputs.iter().filter(move |i| i.kind == kind)
    }

    /// Cut outputs held in the cache during this segment that it neither reads nor
    /// produces (e.g. UNet skip connections passing through).
    pub fn carried_cuts(&self) -> impl Iterator<Item = &CutName> + '_ {
        self.future_cuts.iter().filter(|c| {
            !self.consumed_cuts.contains(c) && !self.outputs.iter().any(|o| &o.name == *c)
        })
    }
}

/// A non-cut node computed by more than one segment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Recomputation {
    /// The node.
    pub node: usize,
    /// The segment that owns it (the first to compute it, or its cut group).
    pub owner: usize,
    /// The other segments that compute it again.
    pub also_in: Vec<usize>,
}

/// What a diagnostic is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DiagnosticKind {
    /// A cut that no later segment reads and that is not a graph output.
    UnconsumedCut,
    /// A mark on a tensor that is not in the graph.
    MarkNotInGraph,
    /// A segment computes a cut of a later group (its producers run twice).
    CutOfLaterGroupRecomputed,
}

/// A planner warning, with the mark's source location where it concerns a mark.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Diagnostic {
    /// What it is about.
    pub kind: DiagnosticKind,
    /// The message (names the cut and tensor).
    pub message: String,
    /// Where the mark concerned was made.
    pub location: Option<&'static Location<'static>>,
}

impl fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.location {
            Some(l) => write!(f, "{} (marked at {l})", self.message),
            None => f.write_str(&self.message),
        }
    }
}

/// The plan of one graph structure: segments in execution order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    /// Fingerprint of the graph structure it was made for.
    pub fingerprint: Fingerprint,
    /// Number of op nodes of that graph.
    pub n_nodes: usize,
    /// Number of leaves of that graph.
    pub n_leaves: usize,
    /// Whether the graph has cut marks (otherwise there is one final segment).
    pub has_cuts: bool,
    /// The segments in execution order.
    pub segments: Vec<Segment>,
    /// Nodes computed by several segments.
    pub recomputations: Vec<Recomputation>,
    /// Warnings found while planning.
    pub diagnostics: Vec<Diagnostic>,
}

impl Plan {
    /// The outputs the caller reads after the graph ran, in segment order.
    pub fn graph_outputs(&self) -> impl Iterator<Item = &SegmentOutput> + '_ {
        self.segments
            .iter()
            .flat_map(|s| s.outputs.iter())
            .filter(|o| o.graph_output)
    }

    /// The segment that produces cut `name`.
    pub fn producer_of(&self, name: &CutName) -> Option<usize> {
        self.segments
            .iter()
            .position(|s| s.outputs.iter().any(|o| &o.name == name))
    }

    /// The largest compute buffer of any segment.
    pub fn max_compute_buffer(&self) -> usize {
        self.segments
            .iter()
            .map(|s| s.bytes.compute_buffer)
            .max()
            .unwrap_or(0)
    }

    /// The most bytes the cut cache holds during any segment.
    pub fn max_live_cut_bytes(&self) -> usize {
        self.segments
            .iter()
            .map(|s| s.bytes.live_cuts)
            .max()
            .unwrap_or(0)
    }

    /// A one-line-per-segment summary.
    pub fn summary(&self) -> String {
        let mut s = format!(
            "plan {}: {} nodes, {} segments\n",
            self.fingerprint,
            self.n_nodes,
            self.segments.len()
        );
        for (i, seg) in self.segments.iter().enumerate() {
            s.push_str(&format!(
                "  #{i} {}: {} nodes ({} recomputed), {} inputs, {} outputs, compute {} B, params {} B, live cuts {} ({} B)\n",
                seg.name,
                seg.internal_nodes.len(),
                seg.recomputed_nodes.len(),
                seg.inputs.len(),
                seg.outputs.len(),
                seg.bytes.compute_buffer,
                seg.bytes.input_param,
                seg.live_cuts.len(),
                seg.bytes.live_cuts
            ));
        }
        s
    }
}
