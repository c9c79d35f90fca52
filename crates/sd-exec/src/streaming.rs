//! [`StreamingOptions`]: how a session streams weights through a budget, one struct that
//! the engine's sessions, the runtime's options and the benchmark share.

/// How a session streams weights under a budget (part of
/// [`SessionConfig`](crate::SessionConfig); `sd_pipeline`'s `RuntimeOptions` carries one for
/// every session it creates). The defaults are the measured best of each switch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StreamingOptions {
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
    /// them). Default: on: on an H100 (`sd-bench unet --pool-sized-segments on|off`, three
    /// interleaved rounds, seventeenth session) SD1.5 at 0.75 of its weights 60.3-61.1 ms
    /// a step against 62.3-67.5 (13 segments instead of 11, 1.25 GB streamed instead of
    /// 1.36), at 0.5 70.5-72.9 against 72.6-73.9; SD1.5 at 0.25 and SDXL at 0.5 plan the
    /// same segments either way. (An earlier measurement found no gain; it ran with a
    /// resident set that kept nothing whenever three of the largest segments overfilled
    /// the pool.)
    pub pool_sized_segments: bool,
    /// With [`pool_sized_segments`](Self::pool_sized_segments), the share of the room for
    /// weights a merged segment's weights stay within: `1 / segment_weight_share` of it.
    /// Default: 4 (a quarter).
    pub segment_weight_share: usize,
    /// Whether a segmented plan with a staging pool is refined further (finer marks inside
    /// the segments whose weights exceed `1 / segment_weight_share` of the pool's room for
    /// weights), so that the resident set's streaming window is smaller and more weights
    /// stay on the device from step to step. Default: off: on an H100 (`sd-bench unet
    /// --refine-for-residency on --segment-weight-share 16`, two interleaved rounds,
    /// twenty-second session, docs/benchmarks.md) it streams 23% fewer bytes a step at 0.75
    /// and 0.5 of SD1.5's weights, 16% fewer at 0.5 of SDXL's, and every step is slower
    /// (SD1.5 0.75: 55.0-62.7 ms against 45.3-45.7; 0.5: 61.8-76.1 against 52.0-55.1; SDXL
    /// 0.5: 220.0 against 159.3): three times the segments, and each costs the host its
    /// capacity checks, prefetch and kernel launches.
    pub refine_for_residency: bool,
    /// Whether automatic segmentation may run consecutive cut groups as one segment while
    /// a segment stays within a third of the budget (fewer, larger segments: less
    /// per-segment overhead, with room left for the prefetched next segment and a resident
    /// set). [`SegmentationPolicy::Always`](crate::SegmentationPolicy::Always) never merges.
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
    /// [`refine_for_pool`](StreamingOptions::refine_for_pool) a plan whose pool holds fewer of its
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
    /// With [`async_compute`](StreamingOptions::async_compute), the most segments queued on the device
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
    /// Whether the last segments of a segmented execution also prefetch the first segments'
    /// streamed weights for the next execution of the same graph (the next step of a
    /// sampling loop), as far as there is room beside the segments still to run, so that
    /// the next step starts without uploading its first segment while the device waits.
    /// What is prefetched stays staged (evictable like any staged weight) when the
    /// execution ends. Default: on.
    pub next_pass_prefetch: bool,
    /// With [`reuse_graphs`](Self::reuse_graphs) in a segmented run, the cut cache keeps
    /// the buffers of every size a step holds at once (its spare quota, which the staging
    /// pool leaves room for), and each cut takes back the buffer it had the step before:
    /// from the third step on, every kept segment graph reads and writes the same
    /// addresses as in the step before (which ggml's CUDA backend needs to replay it as a
    /// CUDA graph), and no cut buffer is allocated or freed inside a step. Off (the
    /// default), spares are kept only within the largest segment's live cuts, the largest
    /// freed first. Off by default: on the H100 the weights still moved between steps
    /// (see [`sd_residency::ModelManager::set_stable_placement`]), so no graph replayed,
    /// and the quota's room came out of the staging pool (`docs/benchmarks.md`, fifteenth
    /// session).
    pub stable_cuts: bool,
    /// Whether the resident set weighs each segment's streamed share by the compute before
    /// it: a segment may stream in proportion to the matrix-product work of the segment
    /// that runs while its prefetch does (`sd_tensor::ggml::node_flops`), and keeps the rest
    /// resident, instead of every segment streaming the same cap. A UNet's deep blocks hold
    /// most of its weights and little of its compute: under the same cap their uploads
    /// outlast the short segments before them. Default: off: on an H100
    /// (`scripts/device/aware_ab.sh`, docs/benchmarks.md) SD1.5 at 0.75 / 0.25 of its weights
    /// and SDXL at 0.5 / 0.25 took as long, SD1.5 at 0.5 4% longer.
    pub compute_aware_residency: bool,
    /// Whether each segment's report carries when the device finished it
    /// ([`SegmentTimes::done`](crate::SegmentTimes::done)) for segments queued without
    /// waiting: a thread of the session waits on their events in turn. For timelines of a
    /// step (`sd-bench unet --timeline on`); default off.
    pub timeline: bool,
    /// How many of the next pass's first segments the last segments of a pass may prefetch
    /// ([`next_pass_prefetch`](Self::next_pass_prefetch)), as far as there is room. A
    /// UNet's last segments compute long on few weights: the link is otherwise idle then.
    /// Default: 2 (8 took as long on an H100: SD1.5 at 0.75 / 0.5 / 0.25 of its weights,
    /// SDXL at 0.5; docs/benchmarks.md, nineteenth session).
    pub next_pass_segments: usize,
    /// How many segments' prefetches preparing one segment may add to the queue (the
    /// scheduling is host work the segment's launch waits for). Default: 2 (4 took as long
    /// or 1-3% longer on an H100).
    pub prefetches_per_segment: usize,
    /// Whether a prefetch beyond the next segment may evict weights of segments after its
    /// target (furthest next use first), not only weights used already in this pass. On:
    /// a step whose pool holds the last segments' weights from the step before (to be
    /// evicted before their use anyway where the pool is small) prefetches the deep
    /// segments early instead of leaving the link idle. Default: off (on an H100, with 8
    /// next-pass segments, as long as without, within 1-5%: the pool's room moves the link
    /// time rather than shrinking it).
    pub evict_later_uses: bool,
}

impl Default for StreamingOptions {
    /// Each field's documented default.
    fn default() -> Self {
        StreamingOptions {
            prefetch_depth: usize::MAX,
            resident_set: true,
            pool_sized_segments: true,
            segment_weight_share: 4,
            refine_for_residency: false,
            merge_segments: true,
            staging_pool: true,
            refine_for_pool: true,
            stream_window: 3,
            reuse_graphs: true,
            async_compute: true,
            segments_in_flight: 2,
            evict_in_flight: true,
            next_pass_prefetch: true,
            stable_cuts: false,
            compute_aware_residency: false,
            timeline: false,
            next_pass_segments: 2,
            prefetches_per_segment: 2,
            evict_later_uses: false,
        }
    }
}
