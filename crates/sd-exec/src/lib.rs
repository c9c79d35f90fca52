//! `sd-exec`: running model graphs inside a memory budget.
//!
//! It owns the [`ExecutionEngine`] (one per residency manager, owning every session and
//! the cross-session eviction policy), [`ExecutionSession`]s (one per model runner: backend,
//! compute workspace, graph-cut tensor cache, budget), the per-graph execution that decides
//! between running a graph whole and in segments at graph cuts, and the segment weight
//! pipeline (pin, make room, stage each segment's weights; prefetch the next segment's
//! weights on the manager's transfer thread while the current one computes, best effort),
//! and layer split across several devices ([`SessionConfig::with_split_device`]). Model
//! code only builds graphs and
//! calls [`ExecutionEngine::execute`]; the engine never knows a model.
//!
//! Layout: [`engine`] (sessions, `execute`, `end`), [`session`] (per-runner state), [`streaming`] (how weights stream),
//! [`task`] (what to compute and what came out), [`workspace`] (the compute buffer),
//! [`execution`] (the per-graph algorithm), `refine` (cut granularity), [`eviction`] (`ensure_capacity`), [`error`].

#![warn(missing_docs)]

pub mod engine;
pub mod error;
pub mod eviction;
pub mod execution;
pub mod limit;
mod refine;
pub mod reserve;
pub mod session;
pub mod streaming;
pub mod task;
pub mod workspace;

pub use engine::{EngineOptions, ExecutionEngine, DEFAULT_PLANNING_HEADROOM};
pub use error::{BudgetShortfall, ExecError, Result};
pub use eviction::ReclaimEvent;
pub use limit::device_limit;
pub use reserve::{measure_runtime_reserve, RuntimeReserve};
pub use session::{ExecutionSession, SegmentationPolicy, SessionConfig, SessionId, SplitDevice};
pub use streaming::StreamingOptions;
pub use task::{
    ComputeResult, ComputeTask, ExecTiming, PlanSummary, SegmentPlan, SegmentReport, SegmentTimes,
};
pub use workspace::ComputeWorkspace;
