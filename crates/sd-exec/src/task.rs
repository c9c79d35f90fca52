//! [`ComputeTask`] (what model code hands the engine) and [`ComputeResult`] (what comes back).

use std::time::Duration;

use sd_graphcut::CutMarks;
use sd_tensor::ggml::{GTensor, Graph};

/// One graph to compute: the graph, its cut marks, the output to read back, host data for
/// its inputs and the weights it uses.
///
/// Weights are the manager's registered descriptors used directly as graph leaves; the
/// engine also treats as a weight every leaf the manager resolves as a parameter.
#[derive(Debug)]
pub struct ComputeTask {
    /// A description for logs and errors.
    pub description: String,
    /// The graph (built in a no_alloc context; nothing in it needs memory yet except
    /// weights, which the engine stages).
    pub graph: Graph,
    /// Cut marks: where the graph may be split into segments. Empty: never segmented.
    pub marks: CutMarks,
    /// The tensor whose data is returned (it must be a graph output: flagged as output or
    /// the last node).
    pub output: GTensor,
    /// Host data for input leaves: `(tensor, bytes)` with exactly `tensor.nbytes()` bytes.
    pub inputs: Vec<(GTensor, Vec<u8>)>,
    /// Weight leaves (registered parameters) the graph uses.
    pub weights: Vec<GTensor>,
    /// Input leaves whose data comes from the session's runner cache: `(tensor, entry
    /// name)`, copied on the device, never through the host.
    pub cached_inputs: Vec<(GTensor, String)>,
}

impl ComputeTask {
    /// A task computing `graph` and returning `output`, with no cuts, inputs or weights yet.
    pub fn new(description: impl Into<String>, graph: Graph, output: GTensor) -> ComputeTask {
        ComputeTask {
            description: description.into(),
            graph,
            marks: CutMarks::new(),
            output,
            inputs: Vec::new(),
            weights: Vec::new(),
            cached_inputs: Vec::new(),
        }
    }

    /// Sets the cut marks.
    pub fn with_marks(mut self, marks: CutMarks) -> ComputeTask {
        self.marks = marks;
        self
    }

    /// Adds host data for an input leaf.
    pub fn with_input(mut self, tensor: &GTensor, bytes: Vec<u8>) -> ComputeTask {
        self.inputs.push((tensor.clone(), bytes));
        self
    }

    /// Feeds an input leaf from the runner cache entry `name` (see
    /// [`crate::ExecutionEngine::cache_store`]); the entry must have the leaf's type and shape.
    pub fn with_cached_input(mut self, tensor: &GTensor, name: impl Into<String>) -> ComputeTask {
        self.cached_inputs.push((tensor.clone(), name.into()));
        self
    }

    /// Adds weight leaves.
    pub fn with_weights<'a>(mut self, weights: impl IntoIterator<Item = &'a GTensor>) -> Self {
        self.weights.extend(weights.into_iter().cloned());
        self
    }
}

/// What one segment (or the whole graph, as a single segment) used.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegmentReport {
    /// Position in the plan.
    pub index: usize,
    /// The segment's name (its cut group, or `<final>`).
    pub name: String,
    /// The device (session slot: 0 is the primary, then the layer-split devices) it ran on.
    pub device: usize,
    /// Parameters the segment used.
    pub params: usize,
    /// Bytes of its weights on the compute device (aligned allocation sizes).
    pub weight_bytes: u64,
    /// The compute buffer (workspace) bytes it needed.
    pub compute_bytes: u64,
    /// Bytes in the cut cache's entries right after it computed (before pruning).
    pub cache_bytes: u64,
    /// Bytes of cut-cache spares held beside them (buffers of earlier entries kept for the
    /// next step's same cuts, within the room the staging pool leaves; see
    /// `sd_graphcut::CutCache::set_spare_limit`). Not part of [`footprint`](Self::footprint),
    /// which is what the plan counts per segment.
    pub spare_bytes: u64,
    /// Bytes of cut outputs copied to its device from another device (layer split).
    pub copied_bytes: u64,
    /// Whether its weights had been prefetched while earlier segments computed.
    pub prefetched: bool,
    /// Later segments whose weights were on their way to the device (prefetches in
    /// flight) while it computed.
    pub prefetches_ahead: usize,
    /// Outputs it computed straight into cut-cache storage (no copy after computing).
    pub direct_outputs: usize,
    /// Whether it ran the ggml graph kept from the previous execution of the same graph
    /// (nothing built or allocated).
    pub graph_reused: bool,
    /// Whether that kept graph ran with every node and source where it was last time (its
    /// weights staged at the same offsets, its cuts in the same entries): ggml's CUDA
    /// backend replays such a graph as the CUDA graph it captured, one launch instead of
    /// one per kernel (see [`sd_residency::ModelManager::set_stable_placement`]).
    pub graph_unmoved: bool,
    /// Whether its preparation on the host (capacity, staging, graph, prefetches) ran
    /// while the segment before it computed (asynchronous compute).
    pub overlapped: bool,
    /// Segments still queued on the device ahead of it when it was queued (asynchronous
    /// compute with [`segments_in_flight`](crate::StreamingOptions::segments_in_flight) above
    /// 1: its inputs were written in the device's queue behind them).
    pub queued_behind: usize,
    /// Of `cache_bytes`, the cut-cache entries kept only for the segments still in flight
    /// ahead of it (cuts they read and nothing after them does): the plan's need for this
    /// segment does not count them; a segment that needs their room waits for those
    /// segments first.
    pub held_for_in_flight: u64,
    /// Prefetches this segment scheduled that evicted weights while segments were in
    /// flight ([`StreamingOptions::evict_in_flight`](crate::StreamingOptions::evict_in_flight)).
    pub evicting_prefetches: usize,
    /// How long the host waited, before preparing it, for its prefetched weights to land
    /// (part of [`ExecTiming::wait`]; zero for weights on a copy stream, which the device
    /// waits for in its queue).
    pub prefetch_wait: std::time::Duration,
    /// When its work happened.
    pub times: SegmentTimes,
}

/// When one segment's work happened, on the calling thread and on its device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SegmentTimes {
    /// Its preparation began (room, weights, graph).
    pub prepared: std::time::Instant,
    /// How long its synchronous staging took (weights not prefetched).
    pub staging: std::time::Duration,
    /// Its graph was handed to the backend.
    pub launched: std::time::Instant,
    /// The backend returned: the segment is queued, or done when computed synchronously.
    pub returned: std::time::Instant,
    /// When the device finished it (after `launched`; a device may finish before the call
    /// returns): `returned` when computed synchronously; for a segment
    /// queued without waiting, seen by the session's watcher with
    /// [`StreamingOptions::timeline`](crate::StreamingOptions::timeline) on, else `None`.
    pub done: Option<std::time::Instant>,
}

impl SegmentReport {
    /// Weights + workspace + cut cache: what the segment held on the device at its peak.
    pub fn footprint(&self) -> u64 {
        self.weight_bytes + self.compute_bytes + self.cache_bytes
    }
}

/// The outcome of a successful [`ExecutionEngine::execute`](crate::ExecutionEngine::execute).
#[derive(Clone, Debug, PartialEq)]
pub struct ComputeResult {
    /// The output tensor's bytes, in its layout.
    pub output: Vec<u8>,
    /// The output's dimensions (ggml order, innermost first).
    pub ne: [usize; 4],
    /// Whether the graph ran in segments (false: whole, as one segment).
    pub segmented: bool,
    /// One report per segment run, in order.
    pub segments: Vec<SegmentReport>,
    /// Where the execution's time went.
    pub timing: ExecTiming,
    /// Weight bytes uploaded to compute devices during the execution (staging and prefetch
    /// copies; the task's inputs are not counted): what streaming cost this run.
    pub weight_upload_bytes: u64,
    /// Whether the plan was one the session kept from a recent execution: the same task
    /// graph run again (its [`revision`](sd_tensor::ggml::Graph::revision) unchanged) under
    /// the same limit and marks, so nothing was captured or planned.
    pub plan_kept: bool,
}

/// Where the wall-clock time of one execution went, measured on the calling thread. The
/// parts are disjoint; `overhead` is what is left of `total` (building and allocating
/// segment graphs, the cut cache, reading the output back, bookkeeping).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExecTiming {
    /// Choosing the plan: capturing the graph, planning (or finding the cached choice).
    pub plan: Duration,
    /// Making room: capacity checks, evictions, the staging pool.
    pub capacity: Duration,
    /// Loading, staging and uploading the segments' weights (synchronous copies).
    pub staging: Duration,
    /// Activating prefetched weights (joining a transfer thread's copies; copies queued on
    /// a copy stream are only ordered before the compute here).
    pub wait: Duration,
    /// Scheduling prefetches: room for them, loading, placing and queueing their copies.
    pub prefetch: Duration,
    /// Waiting on the host, just before computing a segment, for its weights' uploads
    /// queued on the device's copy stream: the part of the asynchronous uploads that the
    /// previous segment's compute did not hide (0 without a copy stream).
    pub upload_wait: Duration,
    /// Building the segments' ggml graphs from the captured graph (the copies of its
    /// nodes, bound to weights, cut-cache entries and input copies).
    pub build: Duration,
    /// Placing the segments' graphs in the compute workspace and their cut outputs in the
    /// cut cache (device allocations when an entry or the workspace is new or grows), and
    /// storing the cut outputs that could not be placed there; for a graph kept from the
    /// last execution, checking and binding it again instead.
    pub allocate: Duration,
    /// Uploading the task's inputs and computing the segment graphs (with asynchronous
    /// compute: queueing them).
    pub compute: Duration,
    /// Waiting on the host for segments queued without waiting (asynchronous compute):
    /// the part of their compute that the next segment's preparation did not hide.
    pub compute_wait: Duration,
    /// The rest of `total`.
    pub overhead: Duration,
    /// The whole execution.
    pub total: Duration,
    /// Segments run.
    pub segments: usize,
}

impl ExecTiming {
    /// Fills `overhead` from `total` and the measured parts.
    pub fn finish(&mut self) {
        let parts = self.plan
            + self.capacity
            + self.staging
            + self.wait
            + self.prefetch
            + self.upload_wait
            + self.build
            + self.allocate
            + self.compute
            + self.compute_wait;
        self.overhead = self.total.saturating_sub(parts);
    }

    /// Milliseconds of a duration, for logs.
    fn ms(d: Duration) -> f64 {
        d.as_secs_f64() * 1e3
    }

    /// Logs the parts at debug level.
    pub fn log(&self, task: &str) {
        tracing::debug!(
            task,
            total_ms = Self::ms(self.total),
            plan_ms = Self::ms(self.plan),
            capacity_ms = Self::ms(self.capacity),
            staging_ms = Self::ms(self.staging),
            wait_ms = Self::ms(self.wait),
            prefetch_ms = Self::ms(self.prefetch),
            upload_wait_ms = Self::ms(self.upload_wait),
            build_ms = Self::ms(self.build),
            allocate_ms = Self::ms(self.allocate),
            compute_ms = Self::ms(self.compute),
            compute_wait_ms = Self::ms(self.compute_wait),
            overhead_ms = Self::ms(self.overhead),
            segments = self.segments,
            "execution timing"
        );
    }
}

impl ComputeResult {
    /// The output as f32 values (little-endian); `None` if its size is not a multiple of 4.
    pub fn output_f32(&self) -> Option<Vec<f32>> {
        let chunks = self.output.chunks_exact(4);
        if !chunks.remainder().is_empty() {
            return None;
        }
        Some(
            chunks
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        )
    }

    /// The largest compute buffer of any segment.
    pub fn peak_compute_bytes(&self) -> u64 {
        self.segments
            .iter()
            .map(|s| s.compute_bytes)
            .max()
            .unwrap_or(0)
    }
}

/// What [`ExecutionEngine::plan`](crate::ExecutionEngine::plan) chose for a task, without
/// running it: the segments it would run and the device bytes each needs at its peak.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlanSummary {
    /// Whether it would run in segments.
    pub segmented: bool,
    /// Per segment: its name and its planned peak bytes (weights, compute buffer, live cuts
    /// and graph outputs).
    pub segments: Vec<(String, u64)>,
    /// The tightest limit the plan was made for (`None`: no budget and no device size).
    pub limit: Option<u64>,
    /// Cuts inside blocks the plan uses (fine marks, see `CutMarks::mark_fine`).
    pub fine_cuts: usize,
    /// Per segment, what its planned peak is made of (same order as `segments`).
    pub details: Vec<SegmentPlan>,
    /// The smallest limit this task fits at its finest granularity (every cut mark on): the
    /// largest planned peak of a segment then. A limit below it is
    /// [`ExecError::BudgetTooSmall`](crate::ExecError::BudgetTooSmall) naming the same
    /// number; without cut marks, the whole graph's peak.
    pub minimum: u64,
    /// Host bytes copied to the device as the task's inputs at each run.
    pub input_bytes: u64,
    /// Bytes of the output read back at each run.
    pub output_bytes: u64,
}

/// One segment of a [`PlanSummary`]: the parts of its planned peak.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegmentPlan {
    /// The segment's name (its cut group, or `<final>`).
    pub name: String,
    /// The device (session slot: 0 is the primary, then layer-split devices) it runs on.
    pub device: usize,
    /// Parameters it uses.
    pub params: usize,
    /// Bytes of its weights on the device (aligned allocation sizes): what
    /// [`SegmentReport::weight_bytes`] reports when it runs.
    pub weight_bytes: u64,
    /// Its own compute buffer: what [`SegmentReport::compute_bytes`] reports.
    pub compute_bytes: u64,
    /// The session's workspace while it runs (sized by the plan's largest compute buffer).
    pub workspace_bytes: u64,
    /// Cut outputs held in the cut cache while it runs (read by it or by later segments).
    pub cut_bytes: u64,
    /// Graph outputs (not cuts) it produces.
    pub output_bytes: u64,
    /// Its planned peak: weights + workspace + cuts + outputs, plus the device's
    /// allocation rounding of each buffer.
    pub need: u64,
}

impl PlanSummary {
    /// The largest planned peak of one segment.
    pub fn peak(&self) -> u64 {
        self.segments.iter().map(|s| s.1).max().unwrap_or(0)
    }
}
