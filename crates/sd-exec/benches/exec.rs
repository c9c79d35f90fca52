//! The execution engine on a simulated device (`SimDevice`, arithmetic on the CPU): a
//! transformer stack whose weights are 4x the session budget, run whole (no budget),
//! segmented, and segmented with prefetch (the summary adds segmented without a budget). Criterion times the steps; a summary then
//! reports per step the time, the bytes moved host->device (the SimDevice's counters) and
//! the ratio of the step time to `max(compute time, bytes moved / copy bandwidth)`, where
//! the compute time is the whole (weights resident) step and the copy bandwidth is
//! measured in the same run with a large `write_bytes` into a SimDevice tensor.
//!
//! `cargo bench -p sd-exec --bench exec` (or `cargo xtask bench exec`); set
//! `SD_BENCH_THREADS` (default 1) for the SimDevice's arithmetic threads: on a loaded
//! machine, ggml's spinning thread barriers dominate the short segment graphs.
// `criterion_group!` defines public functions without docs.
#![allow(missing_docs)]

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use sd_exec::{
    ComputeTask, EngineOptions, ExecutionEngine, SegmentationPolicy, SessionConfig, SessionId,
};
use sd_formats::files::TensorCatalog;
use sd_graphcut::CutMarks;
use sd_residency::{Component, ModelManager, ParamSpec, ResidencyMode, SourceId};
use sd_tensor::ggml::{Backend, Context, GTensor, Graph, SimDevice, SimOptions};
use sd_tensor::DType;
use sd_testutil::{f32_bytes as bytes_of, SafetensorsWriter, StTensor};

fn rnd(n: usize, seed: u64) -> Vec<f32> {
    sd_testutil::rnd_scaled(n, seed, 0.06)
}

/// Model width (every linear is `D x D` f32: 256 KiB).
const D: usize = 256;
/// Tokens per step.
const T: usize = 16;
/// Layers; each has six linears (q, k, v, o, two MLP), so 1.5 MiB of weights per layer.
const LAYERS: usize = 16;
const LINEARS: [&str; 6] = ["wq", "wk", "wv", "wo", "w1", "w2"];

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn weight_names() -> Vec<String> {
    (0..LAYERS)
        .flat_map(|l| LINEARS.iter().map(move |w| format!("tf.{l}.{w}")))
        .collect()
}

/// Writes the model's safetensors file; returns its path and the weights' total bytes.
fn write_model() -> (PathBuf, u64) {
    let dir = std::env::temp_dir().join(format!("sd-exec-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("model.safetensors");
    let tensors: Vec<StTensor> = weight_names()
        .iter()
        .enumerate()
        .map(|(i, name)| {
            StTensor::f32(
                &format!("model.diffusion_model.{name}.weight"),
                &[D as u64, D as u64],
                &rnd(D * D, 1000 + i as u64),
            )
        })
        .collect();
    let bytes = tensors.iter().map(|t| t.bytes.len() as u64).sum();
    SafetensorsWriter::new()
        .tensors(tensors)
        .write(&path)
        .unwrap();
    (path, bytes)
}

/// One engine over a fresh SimDevice with the model registered (params on the CPU).
struct Rig {
    sim: SimDevice,
    engine: ExecutionEngine<ModelManager>,
    session: SessionId,
    task: ComputeTask,
    _wctx: Context,
    _tctx: Context,
}

fn rig(path: &PathBuf, (budget, policy, prefetch): Config, threads: usize) -> Rig {
    let sim = SimDevice::new(
        "BENCH",
        1 << 30,
        SimOptions {
            threads,
            ..SimOptions::default()
        },
    )
    .unwrap();
    let mut loader = TensorCatalog::new();
    loader.add_file(path, None).unwrap();
    let mut mm = ModelManager::new(loader);
    mm.set_device_reserve(0);
    mm.set_load_threads(1);
    mm.set_segmented_compute(true);
    mm.set_prefetch(prefetch);
    let cpu = mm.add_backend(Arc::new(Backend::cpu(1).unwrap())).unwrap();
    let backend = Arc::new(sim.backend().unwrap());
    let gpu = mm.add_backend(backend.clone()).unwrap();
    let wctx = Context::new_descriptors(LAYERS * LINEARS.len() + 8, 1, 0).unwrap();
    let mut descs = Vec::new();
    let mut w = HashMap::new();
    for name in weight_names() {
        let t = wctx.new_tensor(DType::F32, &[D, D]).unwrap();
        t.set_name(&name);
        w.insert(name.clone(), t.clone());
        descs.push((format!("model.diffusion_model.{name}.weight"), t));
    }
    mm.register_params(
        ParamSpec {
            component: Component::Diffusion,
            mode: ResidencyMode::ParamBackend,
            params_backend: cpu,
            compute_backend: gpu,
            source: SourceId::MAIN,
        },
        &descs,
    )
    .unwrap();
    let mut engine = ExecutionEngine::new(
        mm,
        EngineOptions {
            planning_headroom: 0,
        },
    );
    let session = engine.create_session(
        SessionConfig::new("bench", backend, gpu)
            .with_budget(budget)
            .with_segmentation(policy)
            .with_prefetch(prefetch),
    );
    engine.start(session).unwrap();
    let (task, tctx) = transformer(&w);
    Rig {
        sim,
        engine,
        session,
        task,
        _wctx: wctx,
        _tctx: tctx,
    }
}

/// A pre-norm transformer stack; each layer's output is a cut.
fn transformer(w: &HashMap<String, GTensor>) -> (ComputeTask, Context) {
    let ctx = Context::new_descriptors(2048, 2048, 1).unwrap();
    let x = ctx.new_tensor(DType::F32, &[D, T]).unwrap();
    x.set_name("tokens");
    let mut marks = CutMarks::new();
    let mut h = x.clone();
    for l in 0..LAYERS {
        let g = |n: &str| w[&format!("tf.{l}.{n}")].clone();
        let n = ctx.norm(&h, 1e-5).unwrap();
        let q = ctx.mul_mat(&g("wq"), &n).unwrap();
        let k = ctx.mul_mat(&g("wk"), &n).unwrap();
        let v = ctx.mul_mat(&g("wv"), &n).unwrap();
        let probs = ctx
            .soft_max_ext(&ctx.mul_mat(&k, &q).unwrap(), None, 0.0625)
            .unwrap();
        let vt = ctx.cont(&ctx.transpose(&v).unwrap()).unwrap();
        let a = ctx
            .mul_mat(&g("wo"), &ctx.mul_mat(&vt, &probs).unwrap())
            .unwrap();
        h = ctx.add(&h, &a).unwrap();
        let f = ctx
            .mul_mat(
                &g("w2"),
                &ctx.gelu(&ctx.mul_mat(&g("w1"), &ctx.norm(&h, 1e-5).unwrap()).unwrap())
                    .unwrap(),
            )
            .unwrap();
        h = ctx.add(&h, &f).unwrap();
        marks.mark(&h, &format!("layer{l}"), "h").unwrap();
    }
    let out = ctx.scale(&h, 1.0).unwrap();
    out.set_output();
    let mut graph = Graph::new(&ctx, 2048).unwrap();
    graph.build_forward_expand(&out).unwrap();
    let weights: Vec<GTensor> = w.values().cloned().collect();
    let task = ComputeTask::new("transformer", graph, out)
        .with_marks(marks)
        .with_input(&x, bytes_of(&rnd(D * T, 9)))
        .with_weights(&weights);
    (task, ctx)
}

impl Rig {
    fn step(&mut self) -> Vec<u8> {
        self.engine
            .execute(self.session, &self.task)
            .unwrap()
            .output
    }
}

/// Budget, segmentation policy, prefetch.
type Config = (Option<u64>, SegmentationPolicy, bool);

/// The configurations timed by criterion (label, config).
fn configs(weights: u64) -> Vec<(&'static str, Config)> {
    let budget = Some(weights / 4);
    vec![
        ("whole", (None, SegmentationPolicy::Never, false)),
        ("segmented", (budget, SegmentationPolicy::Auto, false)),
        (
            "segmented+prefetch",
            (budget, SegmentationPolicy::Auto, true),
        ),
    ]
}

/// Host->device copy bandwidth (bytes/s): best of a few 64 MiB `write_bytes` into a
/// SimDevice tensor.
fn copy_bandwidth() -> f64 {
    const N: usize = 64 << 20;
    let sim = SimDevice::new("BW", 2 * N as u64, SimOptions::default()).unwrap();
    let ctx = Context::new_descriptors(1, 1, 0).unwrap();
    let t = ctx.new_tensor(DType::I8, &[N]).unwrap();
    let _buf = sim.buffer_type().alloc_context_tensors(&ctx).unwrap();
    let src = vec![0x5au8; N];
    let mut best = Duration::MAX;
    for _ in 0..5 {
        let t0 = Instant::now();
        t.write_bytes(0, &src).unwrap();
        best = best.min(t0.elapsed());
    }
    N as f64 / best.as_secs_f64()
}

fn bench_exec(c: &mut Criterion) {
    let threads = env_usize("SD_BENCH_THREADS", 1);
    let (path, weights) = write_model();
    let mut group = c.benchmark_group(format!("exec_tf{LAYERS}x{D}_{threads}t"));
    group.sample_size(10);
    group.warm_up_time(Duration::from_millis(200));
    group.measurement_time(Duration::from_secs(2));
    for (label, config) in configs(weights) {
        let mut r = rig(&path, config, threads);
        r.step();
        group.bench_function(label, |b| b.iter(|| r.step()));
    }
    group.finish();

    // The summary: own timings (median of a few steps) with the device counters.
    let bandwidth = copy_bandwidth();
    const STEPS: usize = 4;
    let mut rows = Vec::new();
    let mut reference: Option<Vec<u8>> = None;
    let mut summary = configs(weights);
    // Segments without a budget (nothing evicted): the engine's per-segment overhead alone.
    summary.insert(
        1,
        (
            "segmented, no budget",
            (None, SegmentationPolicy::Always, false),
        ),
    );
    for (label, config) in summary {
        let budget = config.0;
        let mut r = rig(&path, config, threads);
        let first = r.step();
        match &reference {
            None => reference = Some(first),
            Some(w) => assert_eq!(&first, w, "{label}: output differs from whole"),
        }
        let mut times = Vec::with_capacity(STEPS);
        r.sim.reset_counters();
        r.sim.reset_peak();
        for _ in 0..STEPS {
            let t0 = Instant::now();
            r.step();
            times.push(t0.elapsed().as_secs_f64());
        }
        let stats = r.sim.stats();
        times.sort_by(f64::total_cmp);
        let segments = r
            .engine
            .session(r.session)
            .map_or(0, |s| s.last_reports().len());
        let prefetched = r.engine.session(r.session).map_or(0, |s| {
            s.last_reports().iter().filter(|x| x.prefetched).count()
        });
        rows.push((
            label,
            budget,
            times[STEPS / 2],
            stats.host_to_device_bytes / STEPS as u64,
            stats.peak_bytes,
            segments,
            prefetched,
        ));
    }
    let compute = rows[0].2;
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    println!();
    println!(
        "exec summary: {LAYERS} layers x {} linears {D}x{D} f32 = {:.1} MiB of weights, {T} tokens, {threads} threads",
        LINEARS.len(),
        mib(weights)
    );
    println!(
        "  copy bandwidth (64 MiB write_bytes into a SimDevice tensor): {:.2} GB/s",
        bandwidth / 1e9
    );
    println!(
        "  compute time (whole step, weights resident): {:.2} ms",
        compute * 1e3
    );
    println!(
        "  {:<20} {:>10} {:>9} {:>6} {:>11} {:>10} {:>10} {:>7}",
        "config", "budget MiB", "step ms", "segs", "prefetched", "h2d MiB", "peak MiB", "ratio"
    );
    for (label, budget, t, h2d, peak, segs, pf) in rows {
        let bound = compute.max(h2d as f64 / bandwidth);
        println!(
            "  {:<20} {:>10} {:>9.2} {:>6} {:>11} {:>10.2} {:>10.2} {:>7.2}",
            label,
            budget.map_or("none".to_string(), |b| format!("{:.1}", mib(b))),
            t * 1e3,
            segs,
            pf,
            mib(h2d),
            mib(peak),
            t / bound
        );
    }
    println!("  ratio = step time / max(compute time, h2d bytes / copy bandwidth)");
    let _ = std::fs::remove_dir_all(path.parent().unwrap());
}

criterion_group!(benches, bench_exec);
criterion_main!(benches);
