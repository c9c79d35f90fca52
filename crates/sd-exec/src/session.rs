//! [`ExecutionSession`]: the state one model runner keeps in the engine.

use std::collections::BTreeSet;
use std::fmt;
use std::sync::Arc;

use sd_graphcut::{CutCache, GraphPlanner, PlanOptions};
use sd_residency::{BackendId, DeviceResidencyManager, OwnerId, ParamId};
use sd_tensor::ggml::Backend;

use crate::task::SegmentReport;
use crate::workspace::ComputeWorkspace;

/// A session's id in its engine (also its residency owner id).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SessionId(pub u64);

impl fmt::Display for SessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "session#{}", self.0)
    }
}

impl SessionId {
    /// The residency owner this session registers as.
    pub fn owner(self) -> OwnerId {
        OwnerId(self.0)
    }
}

/// When a graph runs in segments.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum SegmentationPolicy {
    /// Segment only when weights + measured workspace + planning headroom exceed the
    /// budget (the seed's rule).
    #[default]
    Auto,
    /// Segment every graph that has cuts (tests, benchmarks).
    Always,
    /// Never segment.
    Never,
}

/// How to create a session.
#[derive(Clone, Debug)]
pub struct SessionConfig {
    /// A name for logs.
    pub name: String,
    /// The compute backend.
    pub backend: Arc<Backend>,
    /// The same backend's id in the residency manager.
    pub backend_id: BackendId,
    /// The most bytes this session may have on the device, its weights included (`None`:
    /// only the device and the manager's budget apply).
    pub budget: Option<u64>,
    /// When to segment.
    pub segmentation: SegmentationPolicy,
    /// Whether to prefetch the next segment's weights (also needs the manager's switch).
    pub prefetch: bool,
}

impl SessionConfig {
    /// A session on `backend` (`backend_id` in the manager) with no budget of its own,
    /// automatic segmentation and prefetch on.
    pub fn new(name: impl Into<String>, backend: Arc<Backend>, backend_id: BackendId) -> Self {
        SessionConfig {
            name: name.into(),
            backend,
            backend_id,
            budget: None,
            segmentation: SegmentationPolicy::Auto,
            prefetch: true,
        }
    }

    /// Sets the budget.
    pub fn with_budget(mut self, bytes: Option<u64>) -> Self {
        self.budget = bytes;
        self
    }

    /// Sets the segmentation policy.
    pub fn with_segmentation(mut self, policy: SegmentationPolicy) -> Self {
        self.segmentation = policy;
        self
    }

    /// Turns prefetch on or off.
    pub fn with_prefetch(mut self, on: bool) -> Self {
        self.prefetch = on;
        self
    }
}

/// One model runner's execution state: backend, budget, compute workspace, graph-cut
/// tensor cache, plan cache and the parameters it used. Its device bytes (workspace + cut
/// cache) are pushed to the residency manager as the runtime residency of its owner id.
pub struct ExecutionSession {
    pub(crate) id: SessionId,
    pub(crate) config: SessionConfig,
    pub(crate) workspace: ComputeWorkspace,
    pub(crate) cut_cache: CutCache,
    pub(crate) planner: GraphPlanner,
    pub(crate) params_used: BTreeSet<ParamId>,
    pub(crate) started: bool,
    pub(crate) last_reports: Vec<SegmentReport>,
    pub(crate) executions: u64,
}

impl fmt::Debug for ExecutionSession {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExecutionSession")
            .field("id", &self.id)
            .field("name", &self.config.name)
            .field("backend", &self.config.backend.name())
            .field("budget", &self.config.budget)
            .field("workspace", &self.workspace)
            .field("cut_cache", &self.cut_cache)
            .field("started", &self.started)
            .finish()
    }
}

impl ExecutionSession {
    pub(crate) fn new(id: SessionId, config: SessionConfig) -> ExecutionSession {
        let buft = config.backend.buffer_type();
        ExecutionSession {
            id,
            workspace: ComputeWorkspace::new(buft),
            cut_cache: CutCache::new(buft),
            planner: GraphPlanner::new(buft, PlanOptions::default(), 8),
            params_used: BTreeSet::new(),
            started: false,
            last_reports: Vec::new(),
            executions: 0,
            config,
        }
    }

    /// The session's id.
    pub fn id(&self) -> SessionId {
        self.id
    }

    /// Its name.
    pub fn name(&self) -> &str {
        &self.config.name
    }

    /// Its compute backend.
    pub fn backend(&self) -> &Arc<Backend> {
        &self.config.backend
    }

    /// The compute backend's id in the manager.
    pub fn backend_id(&self) -> BackendId {
        self.config.backend_id
    }

    /// Its budget.
    pub fn budget(&self) -> Option<u64> {
        self.config.budget
    }

    /// Changes its budget (takes effect at the next execution).
    pub fn set_budget(&mut self, bytes: Option<u64>) {
        self.config.budget = bytes;
    }

    /// Whether it is started.
    pub fn is_started(&self) -> bool {
        self.started
    }

    /// The compute workspace.
    pub fn workspace(&self) -> &ComputeWorkspace {
        &self.workspace
    }

    /// Bytes of the cut cache.
    pub fn cut_cache_bytes(&self) -> u64 {
        self.cut_cache.bytes() as u64
    }

    /// Device bytes it holds besides weights: workspace + cut cache.
    pub fn resident_bytes(&self) -> u64 {
        self.workspace.bytes() + self.cut_cache_bytes()
    }

    /// Every parameter it has used.
    pub fn params_used(&self) -> impl Iterator<Item = ParamId> + '_ {
        self.params_used.iter().copied()
    }

    /// The segment reports of its last successful execution.
    pub fn last_reports(&self) -> &[SegmentReport] {
        &self.last_reports
    }

    /// Number of successful executions.
    pub fn executions(&self) -> u64 {
        self.executions
    }

    /// Pushes its runtime residency to the manager.
    pub(crate) fn sync<M: DeviceResidencyManager>(&self, manager: &mut M) {
        manager.update_runtime_residency(
            self.id.owner(),
            self.config.backend_id,
            self.resident_bytes(),
        );
    }

    /// Releases its workspace and cut cache (it is idle: not executing); returns the bytes
    /// freed.
    pub(crate) fn release_idle<M: DeviceResidencyManager>(&mut self, manager: &mut M) -> u64 {
        let bytes = self.resident_bytes();
        self.workspace.release();
        self.cut_cache.clear();
        self.sync(manager);
        bytes
    }
}
