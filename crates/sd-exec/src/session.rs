//! [`ExecutionSession`]: the state one model runner keeps in the engine.

use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::sync::Arc;

use sd_graphcut::{CutCache, GraphPlanner, PlanOptions};
use sd_residency::{BackendId, DeviceResidencyManager, OwnerId, ParamId};
use sd_tensor::ggml::Backend;

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
    /// How many segments ahead weights may be prefetched (at least 1: the next segment).
    /// Prefetches are queued in segment order while the budget has room for them next to
    /// every segment in between (whose weights they never evict); a deep queue keeps the
    /// link busy through segments with much weight and little compute. Default: no limit
    /// but room ([`usize::MAX`]).
    pub prefetch_depth: usize,
    /// Whether a segmented run with a staging pool keeps a fixed set of segments' weights
    /// on the device from step to step and streams the others through the rest of the
    /// pool (see the engine's `resident_set`); off: every weight is evictable, the one
    /// used longest ago first. Default: on.
    pub resident_set: bool,
    /// Whether automatic segmentation, merging cut groups under a limit with a staging
    /// pool, also keeps each merged segment's weights within a quarter of the room for
    /// weights, so that the resident set's streaming window fits (smaller segments, more of
    /// them). Default: off: on an H100 it streamed 0.05-0.1 GB a step less for SD1.5 at
    /// 0.75 and 0.5 of the weights but took as long or longer (more segments, more host
    /// work each), and left SDXL's segments as they were (`sd-bench --pool-sized-segments`).
    pub pool_sized_segments: bool,
    /// Whether automatic segmentation may run consecutive cut groups as one segment while
    /// a segment stays within a third of the budget (fewer, larger segments: less
    /// per-segment overhead, with room left for the prefetched next segment and a resident
    /// set). [`SegmentationPolicy::Always`] never merges.
    pub merge_segments: bool,
    /// Whether a segmented run under a limit stages its weights in a staging pool: one
    /// device buffer allocated once (and kept from step to step) from which each segment's
    /// weight copies are sub-allocated, instead of a device allocation per staged group
    /// (see [`sd_residency::DeviceResidencyManager::set_staging_pool`]). Default: on.
    pub staging_pool: bool,
    /// Whether a segmented plan whose segments all fit the limit but leave a staging pool
    /// too little room for the largest segment's weights is refined further (finer cuts
    /// inside the segments whose weights exceed that room) so that the pool is used: without
    /// it every streamed segment allocates and frees device buffers inside every step.
    /// Default: on (SD1.5 at 64x64 latents under a quarter of its weights: 11 device
    /// allocations a step instead of 81 on the simulated device, and 8-17% faster steps
    /// on an H200 and an H100, docs/benchmarks.md).
    pub refine_for_pool: bool,
    /// How many segments' streamed weights a staging pool is to hold at once: the segment
    /// computing, the one queued behind it and the one whose prefetch runs meanwhile. With
    /// [`refine_for_pool`](Self::refine_for_pool) a plan whose pool holds fewer of its
    /// largest segments is refined (finer cuts inside the segments over the pool's share of
    /// one) while every segment fits; merging keeps merged segments within that share; the
    /// resident set leaves a window of this many streamed segments (at least 2). At 1 the
    /// pool need only hold the largest segment, and a segment whose weights fill more than
    /// half of it cannot be prefetched while the one before it computes. Default: 3: on an
    /// H100 (`sd-bench unet --stream-window 1|2|3`, docs/benchmarks.md), SDXL at half its
    /// weights 240 ms a step against 301 ms at 1 (6 of 14 segments staged synchronously
    /// there, 2 of 24 here), SD1.5 at 0.75 / 0.5 of its weights 4-10% faster than at 1 and
    /// 2, SDXL at a quarter 6% faster.
    pub stream_window: usize,
    /// Whether the device's budget also keeps room for the operator temporaries a GPU
    /// runtime allocates outside the graph's buffers beyond what the measured runtime
    /// reserve covers ([`crate::reserve::backend_temporaries`] of each graph, less
    /// [`crate::reserve::RUNTIME_POOL_MARGIN_BYTES`]; see
    /// [`sd_residency::DeviceResidencyManager::reserve_backend_temporaries`]). For real
    /// GPUs with a measured reserve; default off (the CPU and the simulated device
    /// allocate nothing behind the engine's back).
    pub runtime_temporaries: bool,
    /// Whether each segment's ggml graph (a graph run whole: its one segment) is kept in
    /// the workspace for the next execution of the same plan (the next step of a sampling
    /// loop), which runs it again as it is when nothing it is bound to changed: nothing
    /// built or allocated, its outputs computed into the same cut-cache entries, views of
    /// weights that moved pointed at their new place, and the same graph for the backend
    /// (ggml's CUDA backend replays it as a CUDA graph when nothing moved). Every kept
    /// graph is laid out in the one workspace buffer; they all go when it grows or is
    /// released, or when another plan runs. A graph run whole also keeps its output
    /// entries. Default: on.
    pub reuse_graphs: bool,
    /// Whether a segmented run queues each segment's compute and prepares the next
    /// segment on the host while it runs (capacity, staging, building, allocating,
    /// prefetch scheduling), waiting for it only before queueing the next one, on devices
    /// whose backend queues work (events and queued copies: a GPU; the CPU backend computes
    /// at the call either way). The segment in flight keeps its weights pinned and its cut
    /// inputs cached until it is done; anything that would free or overwrite memory it
    /// uses waits for it first. Not with layer split. Default: on: budgeted SD1.5 and SDXL
    /// UNet steps on an H100 were 3-6% faster in each interleaved pair
    /// (`sd-bench unet --async-compute on|off`, docs/benchmarks.md).
    pub async_compute: bool,
    /// With [`async_compute`](Self::async_compute), the most segments queued on the device
    /// and not waited for: at 1 the host waits for the segment in flight before queueing the
    /// next one (its inputs are written after it is done); at 2 or more the next segment's
    /// inputs are written in the device's queue behind it and the segment queued at once,
    /// so that the device always has work queued while the host prepares the one after
    /// (each segment in flight keeps its weights pinned until it is done). Default: 2: SDXL
    /// UNet steps on an H100 under 0.25 / 0.5 of the weights were 26% / 4% faster than with
    /// 1 in the same call, SD1.5 steps within the rounds' spread (`sd-bench unet
    /// --segments-in-flight 1|2`, docs/benchmarks.md).
    pub segments_in_flight: usize,
    /// With segments in flight, whether the next segments' prefetches may evict weights
    /// right away (never those of a segment in flight: they are pinned until it is done,
    /// so no queued kernel reads memory an eviction frees), so that their copies start
    /// while the segment before the current one still computes. Off: a prefetch that needs
    /// an eviction waits until every segment before the current one is done, and evicts
    /// what it would have with one segment at a time. A prefetch that finds no room beside
    /// the segments in flight (their weights pinned, the staging pool without a free run
    /// long enough beside them) waits for them as without this. Default: on: budgeted SD1.5
    /// UNet steps on an H100 4-15% faster, SDXL at half its weights 5-10% (`sd-bench unet
    /// --evict-in-flight on|off`, docs/benchmarks.md).
    pub evict_in_flight: bool,
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
            merge_segments: true,
            prefetch: true,
            prefetch_depth: usize::MAX,
            resident_set: true,
            pool_sized_segments: false,
            staging_pool: true,
            runtime_temporaries: false,
            reuse_graphs: true,
            async_compute: true,
            segments_in_flight: 2,
            refine_for_pool: true,
            stream_window: 3,
            evict_in_flight: true,
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

    /// Sets [`SessionConfig::prefetch_depth`] (0 is taken as 1).
    pub fn with_prefetch_depth(mut self, segments: usize) -> Self {
        self.prefetch_depth = segments.max(1);
        self
    }

    /// Sets [`SessionConfig::resident_set`].
    pub fn with_resident_set(mut self, on: bool) -> Self {
        self.resident_set = on;
        self
    }

    /// Sets [`SessionConfig::runtime_temporaries`].
    pub fn with_runtime_temporaries(mut self, on: bool) -> Self {
        self.runtime_temporaries = on;
        self
    }

    /// Sets [`SessionConfig::staging_pool`].
    pub fn with_staging_pool(mut self, on: bool) -> Self {
        self.staging_pool = on;
        self
    }

    /// Sets [`SessionConfig::reuse_graphs`].
    pub fn with_graph_reuse(mut self, on: bool) -> Self {
        self.reuse_graphs = on;
        self
    }

    /// Sets [`SessionConfig::async_compute`].
    pub fn with_async_compute(mut self, on: bool) -> Self {
        self.async_compute = on;
        self
    }

    /// Sets [`SessionConfig::segments_in_flight`] (at least 1).
    pub fn with_segments_in_flight(mut self, n: usize) -> Self {
        self.segments_in_flight = n.max(1);
        self
    }

    /// Sets [`SessionConfig::refine_for_pool`].
    pub fn with_refine_for_pool(mut self, on: bool) -> Self {
        self.refine_for_pool = on;
        self
    }

    /// Sets [`SessionConfig::evict_in_flight`].
    pub fn with_evict_in_flight(mut self, on: bool) -> Self {
        self.evict_in_flight = on;
        self
    }

    /// Sets [`SessionConfig::stream_window`] (at least 1).
    pub fn with_stream_window(mut self, segments: usize) -> Self {
        self.stream_window = segments.max(1);
        self
    }

    /// Sets [`SessionConfig::merge_segments`].
    pub fn with_segment_merging(mut self, on: bool) -> Self {
        self.merge_segments = on;
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
    /// The parameters pinned by the segment now running (unpinned after a panic).
    pub(crate) pinned_now: Vec<ParamId>,
    /// The parameters pinned by the segments in flight (asynchronous compute), oldest
    /// segment's first, until each is done (unpinned after a failure).
    pub(crate) pinned_in_flight: Vec<ParamId>,
    /// Prefetches that evicted weights while segments were in flight, counted since the
    /// session started (see [`SessionConfig::evict_in_flight`]).
    pub(crate) evicting_prefetches: usize,
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
