//! `sd-exec`: running model graphs inside a memory budget.
//!
//! It will own the `ExecutionEngine` (one per residency manager, owning every session and
//! the cross-session eviction policy), `ExecutionSession`s (one per model runner: backends,
//! compute workspace, runner cache, graph-cut tensor cache, budgets), the per-graph
//! execution that decides between running a graph whole and in segments at graph cuts, the
//! segment weight pipeline (stage, prefetch the next segment while the current one
//! computes) and layer split across devices. Model code only builds graphs and calls
//! `execute`; the engine never knows a model. See the issue "Execution engine (`sd-exec`)".
