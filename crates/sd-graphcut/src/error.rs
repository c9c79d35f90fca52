//! Errors of the graph-cut planner.

use sd_tensor::GgmlError;
use thiserror::Error;

/// Everything that can go wrong while marking cuts, planning, validating, building or
/// running segments. Each variant names the tensor, node, cut or segment concerned and,
/// for marks, the source location of the `mark` call.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum GraphCutError {
    /// The same tensor was marked as a cut twice.
    #[error("tensor '{tensor}' is marked as cut '{}' at {} and again as '{}' at {}", marks.first, marks.first_at, marks.second, marks.second_at)]
    DuplicateMark {
        /// Name of the tensor.
        tensor: String,
        /// The two marks (first and second are cut names).
        marks: Box<MarkConflict>,
    },
    /// Two different tensors were marked with the same cut name.
    #[error("cut '{cut}' is marked on tensor '{}' at {} and on tensor '{}' at {}", marks.first, marks.first_at, marks.second, marks.second_at)]
    DuplicateCutName {
        /// The cut name (`group|output`).
        cut: String,
        /// The two marks (first and second are tensor names).
        marks: Box<MarkConflict>,
    },
    /// A graph leaf (input or weight) was marked as a cut; only computed tensors can be.
    #[error("cut '{cut}' at {at} marks leaf tensor '{tensor}'; only op results can be cuts")]
    CutOnLeaf {
        /// The cut name.
        cut: String,
        /// The tensor.
        tensor: String,
        /// Where the mark was made.
        at: String,
    },
    /// A group or output name that cannot be used.
    #[error("invalid cut name '{group}|{output}' at {at}: {reason}")]
    InvalidCutName {
        /// The group.
        group: String,
        /// The output.
        output: String,
        /// Why it is invalid.
        reason: String,
        /// Where the mark was made.
        at: String,
    },
    /// A graph description that is not a DAG in execution order, or refers to tensors that
    /// do not exist.
    #[error("invalid graph at {node}: {detail}")]
    InvalidGraph {
        /// The node or leaf (`node #i 'name' (op)`).
        node: String,
        /// What is wrong.
        detail: String,
    },
    /// A plan that does not fit its graph (coverage, ordering, inputs, liveness).
    #[error("invalid plan at {node}: {detail}")]
    InvalidPlan {
        /// The node, cut or segment concerned.
        node: String,
        /// What is wrong.
        detail: String,
    },
    /// A planner warning promoted to an error by [`PlanOptions::warnings_as_errors`](crate::PlanOptions).
    #[error("{0}")]
    Warning(String),
    /// A plan used with a graph of a different structure.
    #[error("plan for graph {plan} used with graph {graph}")]
    FingerprintMismatch {
        /// Fingerprint the plan was made for.
        plan: String,
        /// Fingerprint of the graph it was used with.
        graph: String,
    },
    /// A segment could not be built, measured or run.
    #[error("segment {segment} '{name}': {detail}")]
    Segment {
        /// Index of the segment.
        segment: usize,
        /// Name of the segment (its cut group).
        name: String,
        /// What went wrong.
        detail: String,
    },
    /// An error of the ggml layer, with what was being done.
    #[error("{what}: {source}")]
    Ggml {
        /// What was being done.
        what: String,
        /// The ggml layer's error.
        #[source]
        source: GgmlError,
    },
}

/// Two conflicting marks: what each names and where each was made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MarkConflict {
    /// What the first mark names (a cut name or a tensor name).
    pub first: String,
    /// Where the first mark was made.
    pub first_at: String,
    /// What the second mark names.
    pub second: String,
    /// Where the second mark was made.
    pub second_at: String,
}

/// Convenience alias.
pub type Result<T> = std::result::Result<T, GraphCutError>;

/// Wraps a ggml error with what was being done.
pub(crate) fn ggml(what: impl Into<String>) -> impl FnOnce(GgmlError) -> GraphCutError {
    let what = what.into();
    move |source| GraphCutError::Ggml { what, source }
}
