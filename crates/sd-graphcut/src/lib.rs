//! `sd-graphcut`: runs a ggml compute graph that is larger than the device budget as an
//! ordered plan of segments.
//!
//! - [`CutMarks`] ([`marks`]): model code marks tensors as cuts (`group`, `output`); the
//!   marks are data the planner reads, and misuse is an error naming the call site.
//! - [`CapturedGraph`] / [`GraphView`] ([`view`]): the abstract form of a graph the planner
//!   works on (positions, ops, shapes, sources, cut marks, parameter classification).
//! - [`plan_view`] ([`planner`]) makes a [`Plan`] ([`plan`]): segments in execution order
//!   with internal and output nodes, typed inputs, recomputed shared nodes, live and future
//!   cut sets and byte totals including the measured compute buffer.
//! - [`validate()`] ([`validate`](mod@validate)) checks a plan against a graph;
//!   [`PlanCache`] ([`cache`]) keeps plans by structural [`Fingerprint`] in a small LRU;
//!   [`GraphPlanner`] combines planning, measuring and caching for ggml graphs.
//! - [`SegmentGraph`] and [`SegmentRunner`] ([`segment_graph`]) build, measure and run one
//!   segment with previous cuts bound from a [`CutCache`] ([`cut_cache`]), without modifying
//!   the original graph.

#![warn(missing_docs)]

pub mod cache;
pub mod cut_cache;
pub mod error;
pub mod fingerprint;
pub mod graph_planner;
mod liveness;
pub mod marks;
pub mod plan;
pub mod planner;
pub mod segment_graph;
pub mod validate;
pub mod view;

pub use cache::{CacheStats, PlanCache};
pub use cut_cache::CutCache;
pub use error::{GraphCutError, MarkConflict, Result};
pub use fingerprint::Fingerprint;
pub use graph_planner::GraphPlanner;
pub use marks::{CutMark, CutMarks, CutName, FINAL_GROUP, LEVEL_LAYER, LEVEL_SUBLAYER};
pub use plan::{
    Diagnostic, DiagnosticKind, InputKind, InputRef, Plan, Recomputation, Segment, SegmentBytes,
    SegmentKind, SegmentOutput,
};
pub use planner::{plan_view, NoMeasure, PlanOptions, SegmentMeasure};
pub use segment_graph::{GallocrMeasure, HostInputs, SegmentGraph, SegmentRun, SegmentRunner};
pub use validate::validate;
pub use view::{
    CapturedGraph, CutInfo, GraphView, NoParams, ParamSet, TensorDesc, TensorRef, FLAG_INPUT,
    FLAG_OUTPUT, FLAG_PARAM, OP_NONE,
};
