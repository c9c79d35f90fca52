//! [`ExecutionSession`]: the state one model runner keeps in the engine.

use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::sync::Arc;

use sd_graphcut::{CutCache, GraphPlanner, PlanOptions};
use sd_residency::{BackendId, DeviceResidencyManager, OwnerId, ParamId};
use sd_tensor::ggml::Backend;

pub use crate::streaming::StreamingOptions;
use crate::task::SegmentReport;
use crate::workspace::ComputeWorkspace;

/// Plans a session caches: one graph's whole, block, refined (one per refinement round)
/// and merged plans, for a few graphs (a UNet at two sizes, a VAE's tiles and edges).
pub(crate) const PLAN_CACHE_PLANS: usize = 24;

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
    /// budget (stable-diffusion.cpp's rule).
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
    /// Whether to prefetch later segments' weights while a segment computes (also needs
    /// the manager's switch).
    pub prefetch: bool,
    /// Whether the device's budget also keeps room for the operator temporaries a GPU
    /// runtime allocates outside the graph's buffers beyond what the measured runtime
    /// reserve covers ([`crate::reserve::backend_temporaries`] of each graph, less
    /// [`crate::reserve::RUNTIME_POOL_MARGIN_BYTES`]; see
    /// [`sd_residency::DeviceResidencyManager::reserve_backend_temporaries`]). For real
    /// GPUs with a measured reserve; default off (the CPU and the simulated device
    /// allocate nothing behind the engine's back).
    pub runtime_temporaries: bool,
    /// How weights stream under a budget (staging pool, window, prefetch, segments in
    /// flight, graph reuse).
    pub streaming: StreamingOptions,
    /// Extra devices for layer split (`diffusion=cuda0&cuda1`): with any, a graph with cuts
    /// runs segment by segment, each segment on the device its weights are assigned to
    /// (contiguous ranges of segments per device, in list order, the primary first).
    pub split: Vec<SplitDevice>,
}

/// One extra device of a layer-split session.
#[derive(Clone, Debug)]
pub struct SplitDevice {
    /// Its compute backend.
    pub backend: Arc<Backend>,
    /// The backend's id in the residency manager.
    pub backend_id: BackendId,
    /// The most bytes the session may hold on it (`None`: the device's memory).
    pub budget: Option<u64>,
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
            runtime_temporaries: false,
            streaming: StreamingOptions::default(),
            split: Vec::new(),
        }
    }

    /// Adds an extra device for layer split.
    pub fn with_split_device(
        mut self,
        backend: Arc<Backend>,
        backend_id: BackendId,
        budget: Option<u64>,
    ) -> Self {
        self.split.push(SplitDevice {
            backend,
            backend_id,
            budget,
        });
        self
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

    /// Sets [`StreamingOptions::prefetch_depth`] (0 is taken as 1).
    pub fn with_prefetch_depth(mut self, segments: usize) -> Self {
        self.streaming.prefetch_depth = segments.max(1);
        self
    }

    /// Sets [`StreamingOptions::resident_set`].
    pub fn with_resident_set(mut self, on: bool) -> Self {
        self.streaming.resident_set = on;
        self
    }

    /// Sets [`SessionConfig::runtime_temporaries`].
    pub fn with_runtime_temporaries(mut self, on: bool) -> Self {
        self.runtime_temporaries = on;
        self
    }

    /// Sets [`StreamingOptions::staging_pool`].
    pub fn with_staging_pool(mut self, on: bool) -> Self {
        self.streaming.staging_pool = on;
        self
    }

    /// Sets [`StreamingOptions::reuse_graphs`].
    pub fn with_graph_reuse(mut self, on: bool) -> Self {
        self.streaming.reuse_graphs = on;
        self
    }

    /// Sets [`StreamingOptions::async_compute`].
    pub fn with_async_compute(mut self, on: bool) -> Self {
        self.streaming.async_compute = on;
        self
    }

    /// Sets [`StreamingOptions::segments_in_flight`] (at least 1).
    pub fn with_segments_in_flight(mut self, n: usize) -> Self {
        self.streaming.segments_in_flight = n.max(1);
        self
    }

    /// Sets [`StreamingOptions::refine_for_pool`].
    pub fn with_refine_for_pool(mut self, on: bool) -> Self {
        self.streaming.refine_for_pool = on;
        self
    }

    /// Sets [`StreamingOptions::evict_in_flight`].
    pub fn with_evict_in_flight(mut self, on: bool) -> Self {
        self.streaming.evict_in_flight = on;
        self
    }

    /// Sets [`StreamingOptions::stream_window`] (at least 1).
    pub fn with_stream_window(mut self, segments: usize) -> Self {
        self.streaming.stream_window = segments.max(1);
        self
    }

    /// Sets [`StreamingOptions::compute_aware_residency`].
    pub fn with_compute_aware_residency(mut self, on: bool) -> Self {
        self.streaming.compute_aware_residency = on;
        self
    }

    /// Sets [`StreamingOptions::stable_cuts`].
    pub fn with_stable_cuts(mut self, on: bool) -> Self {
        self.streaming.stable_cuts = on;
        self
    }

    /// Sets [`StreamingOptions::merge_segments`].
    pub fn with_segment_merging(mut self, on: bool) -> Self {
        self.streaming.merge_segments = on;
        self
    }

    /// Sets every [`StreamingOptions`] switch at once.
    pub fn with_streaming(mut self, streaming: StreamingOptions) -> Self {
        self.streaming = streaming;
        self
    }
}

/// One model runner's execution state: backend, budget, compute workspace, graph-cut
/// tensor cache, plan cache and the parameters it used. Its device bytes (workspace + cut
/// cache) are pushed to the residency manager as the runtime residency of its owner id.
pub struct ExecutionSession {
    pub(crate) id: SessionId,
    pub(crate) config: SessionConfig,
    /// Per device (the primary first, then the split devices): workspace and cut cache.
    pub(crate) slots: Vec<DeviceSlot>,
    /// Layer split: the device index each parameter was assigned to (sticky: the first
    /// graph that uses a parameter decides).
    pub(crate) split_assignment: HashMap<ParamId, usize>,
    pub(crate) planner: GraphPlanner,
    /// Plan choices by graph and limit (see `execution::Choice`), so that a graph run again
    /// under the same limit is planned once.
    pub(crate) choices: HashMap<crate::execution::ChoiceKey, crate::execution::Choice>,
    /// The plans of the last executions, most recent last, for tasks that run the same
    /// graph again.
    pub(crate) kept_prepared: Vec<crate::execution::KeptPrepared>,
    /// The parameters pinned by the segment now running (unpinned after a panic).
    pub(crate) pinned_now: Vec<ParamId>,
    /// The parameters pinned by the segments in flight (asynchronous compute), oldest
    /// segment's first, until each is done (unpinned after a failure).
    pub(crate) pinned_in_flight: Vec<ParamId>,
    /// Prefetches that evicted weights while segments were in flight, counted since the
    /// session started (see [`StreamingOptions::evict_in_flight`]).
    pub(crate) evicting_prefetches: usize,
    pub(crate) params_used: BTreeSet<ParamId>,
    pub(crate) started: bool,
    pub(crate) last_reports: Vec<SegmentReport>,
    pub(crate) executions: u64,
    /// With [`StreamingOptions::timeline`](crate::StreamingOptions::timeline): the thread
    /// that notes when queued segments finish (started on first use).
    pub(crate) watcher: Option<crate::execution::watcher::DoneWatcher>,
}

impl fmt::Debug for ExecutionSession {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExecutionSession")
            .field("id", &self.id)
            .field("name", &self.config.name)
            .field("backend", &self.config.backend.name())
            .field("budget", &self.config.budget)
            .field("slots", &self.slots)
            .field("started", &self.started)
            .finish()
    }
}

impl ExecutionSession {
    pub(crate) fn new(id: SessionId, config: SessionConfig) -> ExecutionSession {
        let buft = config.backend.buffer_type();
        let mut slots = vec![DeviceSlot::new(
            config.backend.clone(),
            config.backend_id,
            config.budget,
        )];
        for d in &config.split {
            slots.push(DeviceSlot::new(d.backend.clone(), d.backend_id, d.budget));
        }
        ExecutionSession {
            id,
            slots,
            split_assignment: HashMap::new(),
            pinned_now: Vec::new(),
            pinned_in_flight: Vec::new(),
            evicting_prefetches: 0,
            planner: GraphPlanner::new(buft, PlanOptions::default(), PLAN_CACHE_PLANS),
            choices: HashMap::new(),
            kept_prepared: Vec::new(),
            params_used: BTreeSet::new(),
            started: false,
            last_reports: Vec::new(),
            executions: 0,
            watcher: None,
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
        self.slots[0].budget = bytes;
    }

    /// Whether it splits graphs across several devices.
    pub fn is_layer_split(&self) -> bool {
        self.slots.len() > 1
    }

    /// The device index (0: primary) layer split assigned `param` to.
    pub fn split_device_of(&self, param: ParamId) -> Option<usize> {
        self.split_assignment.get(&param).copied()
    }

    /// Whether it is started.
    pub fn is_started(&self) -> bool {
        self.started
    }

    /// The compute workspace on the primary device.
    pub fn workspace(&self) -> &ComputeWorkspace {
        &self.slots[0].workspace
    }

    /// Bytes of the cut caches (all devices).
    pub fn cut_cache_bytes(&self) -> u64 {
        self.slots.iter().map(|s| s.cut_cache.bytes() as u64).sum()
    }

    /// Device bytes it holds besides weights, on all devices: workspaces + cut caches.
    pub fn resident_bytes(&self) -> u64 {
        self.slots.iter().map(DeviceSlot::resident_bytes).sum()
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

    /// Pushes its runtime residency (per device) to the manager.
    pub(crate) fn sync<M: DeviceResidencyManager>(&self, manager: &mut M) {
        for s in &self.slots {
            manager.update_runtime_residency(self.id.owner(), s.backend_id, s.resident_bytes());
        }
    }

    /// Releases its workspaces and cut caches on `backend` (it is idle: not executing);
    /// returns the bytes freed.
    pub(crate) fn release_idle<M: DeviceResidencyManager>(
        &mut self,
        manager: &mut M,
        backend: BackendId,
    ) -> u64 {
        let mut bytes = 0;
        for s in self.slots.iter_mut().filter(|s| s.backend_id == backend) {
            let before = s.resident_bytes();
            s.release();
            bytes += before - s.resident_bytes();
        }
        self.sync(manager);
        bytes
    }

    /// Releases every workspace and cut cache.
    pub(crate) fn release_all(&mut self) {
        for s in &mut self.slots {
            s.release();
        }
    }

    /// Drops every runner cache entry.
    pub(crate) fn clear_runner_cache(&mut self) {
        for s in &mut self.slots {
            s.runner_cache.clear();
        }
    }

    /// Bytes of its runner cache.
    pub fn runner_cache_bytes(&self) -> u64 {
        self.slots
            .iter()
            .map(|s| s.runner_cache.bytes() as u64)
            .sum()
    }

    /// Clears the cut caches (they live for one graph), spares too.
    pub(crate) fn clear_cut_caches(&mut self) {
        for s in &mut self.slots {
            s.cut_cache.clear();
        }
    }

    /// Removes the cut caches' entries, keeping their buffers as spares within each
    /// cache's spare limit (for the next execution of the same plan).
    pub(crate) fn drop_cut_entries(&mut self) {
        for s in &mut self.slots {
            s.cut_cache.retain(|_| false);
        }
    }

    /// Whether any device of the session is `backend`.
    pub(crate) fn uses_backend(&self, backend: BackendId) -> bool {
        self.slots.iter().any(|s| s.backend_id == backend)
    }
}

/// What a session keeps on one of its devices.
pub(crate) struct DeviceSlot {
    pub backend: Arc<Backend>,
    pub backend_id: BackendId,
    pub budget: Option<u64>,
    pub workspace: ComputeWorkspace,
    pub cut_cache: CutCache,
    /// The runner cache: named tensors the runner keeps on this device across executions
    /// (only the primary slot's is used). Counted in the resident bytes; released by `end`
    /// and `clear_cache`, never by idle reclamation or a failed execution.
    pub runner_cache: CutCache,
}

impl fmt::Debug for DeviceSlot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceSlot")
            .field("backend", &self.backend.name())
            .field("budget", &self.budget)
            .field("workspace", &self.workspace)
            .field("cut_cache", &self.cut_cache)
            .field("runner_cache", &self.runner_cache)
            .finish()
    }
}

impl DeviceSlot {
    fn new(backend: Arc<Backend>, backend_id: BackendId, budget: Option<u64>) -> DeviceSlot {
        let buft = backend.buffer_type();
        DeviceSlot {
            backend,
            backend_id,
            budget,
            workspace: ComputeWorkspace::new(buft),
            cut_cache: CutCache::new(buft),
            runner_cache: CutCache::new(buft),
        }
    }

    /// Workspace + cut cache bytes.
    pub fn resident_bytes(&self) -> u64 {
        self.workspace.bytes() + self.cut_cache.bytes() as u64 + self.runner_cache.bytes() as u64
    }

    fn release(&mut self) {
        self.workspace.release();
        self.cut_cache.clear();
    }
}
