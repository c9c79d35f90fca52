//! The engine on a simulated device (CPU backend as host): a small UNet-like model and a
//! transformer stack give bit-identical output whole and segmented under a tight budget
//! (with and without prefetch); the SimDevice's own high-water mark never exceeds the
//! budget; a second session reclaims the first's idle workspace before its weights; an
//! impossible budget fails before running, naming the segment and the minimum budget, and
//! the session stays usable; weight uploads queued on a copy stream of a device with
//! queued copies and events give the same bits within the budget, the staging pool fixed.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use sd_exec::{
    ComputeResult, ComputeTask, EngineOptions, ExecError, ExecutionEngine, ReclaimEvent,
    SegmentationPolicy, SessionConfig, SessionId, StreamingOptions,
};
use sd_formats::files::TensorCatalog;
use sd_graphcut::CutMarks;
use sd_residency::{
    BackendId, Component, DeviceResidencyManager, ModelManager, ParamSpec, ResidencyMode, SourceId,
};
use sd_tensor::ggml::{Backend, Context, GTensor, Graph, SimDevice, SimOptions};
use sd_tensor::DType;
use sd_testutil::{f32_bytes as bytes_of, SafetensorsWriter, StTensor};

fn rnd(n: usize, seed: u64) -> Vec<f32> {
    sd_testutil::rnd_scaled(n, seed, 0.3)
}

const C: usize = 16;
const D: usize = 32;
const T: usize = 16;
const LAYERS: usize = 6;

/// (name, ne) of every weight of both models.
fn weight_specs() -> Vec<(String, Vec<usize>)> {
    let mut v: Vec<(String, Vec<usize>)> = vec![
        ("unet.k_in".into(), vec![3, 3, 4, C]),
        ("unet.b_in".into(), vec![1, 1, C, 1]),
        ("unet.k_down".into(), vec![3, 3, C, C]),
        ("unet.wq".into(), vec![C, C]),
        ("unet.wk".into(), vec![C, C]),
        ("unet.wv".into(), vec![C, C]),
        ("unet.wo".into(), vec![C, C]),
        ("unet.wt".into(), vec![C, C]),
        ("unet.k_up1".into(), vec![3, 3, 2 * C, C]),
        ("unet.k_up0".into(), vec![3, 3, 2 * C, C]),
        ("unet.k_out".into(), vec![3, 3, C, 4]),
    ];
    for i in 0..4 {
        v.push((format!("unet.k_res{i}"), vec![3, 3, C, C]));
    }
    for l in 0..LAYERS {
        for w in ["wq", "wk", "wv", "wo"] {
            v.push((format!("tf.{l}.{w}"), vec![D, D]));
        }
        v.push((format!("tf.{l}.w1"), vec![D, 2 * D]));
        v.push((format!("tf.{l}.w2"), vec![2 * D, D]));
    }
    v.into_iter()
        .map(|(n, ne)| (format!("model.diffusion_model.{n}.weight"), ne))
        .collect()
}

/// Writes the model into a fresh temporary folder, removed when the returned guard drops.
fn write_model() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.safetensors");
    let tensors = weight_specs()
        .into_iter()
        .enumerate()
        .map(|(i, (name, ne))| {
            let n: usize = ne.iter().product();
            let shape: Vec<u64> = ne.iter().rev().map(|&d| d as u64).collect();
            StTensor::f32(&name, &shape, &rnd(n, 1000 + i as u64))
        });
    SafetensorsWriter::new()
        .tensors(tensors)
        .write(&path)
        .unwrap();
    (dir, path)
}

struct Rig {
    sim: SimDevice,
    engine: ExecutionEngine<ModelManager>,
    gpu: BackendId,
    backend: Arc<Backend>,
    w: HashMap<String, GTensor>,
    _wctx: Context,
    _dir: tempfile::TempDir,
}

fn rig(name: &str, prefetch: bool) -> Rig {
    rig_with(name, prefetch, SimOptions::default())
}

fn rig_with(name: &str, prefetch: bool, options: SimOptions) -> Rig {
    let sim = SimDevice::new(name, 64 << 20, options).unwrap();
    let mut loader = TensorCatalog::new();
    let (dir, path) = write_model();
    loader.add_file(path, None).unwrap();
    let mut mm = ModelManager::new(loader);
    mm.set_device_reserve(0);
    mm.set_load_threads(1);
    mm.set_segmented_compute(true);
    mm.set_prefetch(prefetch);
    let cpu = mm.add_backend(Arc::new(Backend::cpu(1).unwrap())).unwrap();
    let backend = Arc::new(sim.backend().unwrap());
    let gpu = mm.add_backend(backend.clone()).unwrap();
    let wctx = Context::new_descriptors(256, 1, 0).unwrap();
    let mut descs = Vec::new();
    let mut w = HashMap::new();
    for (name, ne) in weight_specs() {
        let t = wctx.new_tensor(DType::F32, &ne).unwrap();
        let short = name
            .trim_start_matches("model.diffusion_model.")
            .trim_end_matches(".weight")
            .to_string();
        t.set_name(&short);
        w.insert(short, t.clone());
        descs.push((name, t));
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
    let engine = ExecutionEngine::new(
        mm,
        EngineOptions {
            planning_headroom: 0,
        },
    );
    Rig {
        sim,
        engine,
        gpu,
        backend,
        w,
        _wctx: wctx,
        _dir: dir,
    }
}

impl Rig {
    fn session(
        &mut self,
        budget: Option<u64>,
        policy: SegmentationPolicy,
        prefetch: bool,
    ) -> SessionId {
        let id = self.engine.create_session(
            SessionConfig::new("test", self.backend.clone(), self.gpu)
                .with_budget(budget)
                .with_segmentation(policy)
                .with_prefetch(prefetch),
        );
        self.engine.start(id).unwrap();
        id
    }
}

/// The UNet-like graph: conv in, res blocks (group norm, silu, conv, timestep embedding),
/// a strided down conv, attention in the middle, up path with skip concatenations.
fn unet(w: &HashMap<String, GTensor>) -> ComputeTask {
    let ctx = Context::new_descriptors(512, 512, 1).unwrap();
    let g = |n: &str| w[&format!("unet.{n}")].clone();
    let x = ctx.new_tensor(DType::F32, &[8, 8, 4, 1]).unwrap();
    x.set_name("x");
    let t_in = ctx.new_tensor(DType::F32, &[C, 1]).unwrap();
    t_in.set_name("t_in");
    let mut marks = CutMarks::new();
    let temb = ctx.silu(&ctx.mul_mat(&g("wt"), &t_in).unwrap()).unwrap();
    marks.mark(&temb, "time_embed", "emb").unwrap();
    let temb4 = ctx.reshape(&temb, &[1, 1, C, 1]).unwrap();
    let conv = |k: &GTensor, h: &GTensor, s: usize| {
        ctx.conv_2d(k, h, (s, s), (1, 1), (1, 1), true).unwrap()
    };
    let res = |h: &GTensor, k: &GTensor| {
        let s = ctx.silu(&ctx.group_norm(h, 4, 1e-5).unwrap()).unwrap();
        let c = ctx.add(&conv(k, &s, 1), &temb4).unwrap();
        ctx.add(h, &c).unwrap()
    };
    let attn = |h: &GTensor| {
        let (ww, hh) = (h.ne()[0], h.ne()[1]);
        let t = ww * hh;
        let tokens = ctx.reshape(h, &[t, C, 1]).unwrap();
        let xt = ctx.cont(&ctx.transpose(&tokens).unwrap()).unwrap();
        let q = ctx.mul_mat(&g("wq"), &xt).unwrap();
        let k = ctx.mul_mat(&g("wk"), &xt).unwrap();
        let v = ctx.mul_mat(&g("wv"), &xt).unwrap();
        let probs = ctx
            .soft_max_ext(&ctx.mul_mat(&k, &q).unwrap(), None, 0.25)
            .unwrap();
        let vt = ctx.cont(&ctx.transpose(&v).unwrap()).unwrap();
        let out = ctx
            .mul_mat(&g("wo"), &ctx.mul_mat(&vt, &probs).unwrap())
            .unwrap();
        let back = ctx.cont(&ctx.transpose(&out).unwrap()).unwrap();
        ctx.add(h, &ctx.reshape(&back, &[ww, hh, C, 1]).unwrap())
            .unwrap()
    };
    let h0 = ctx.add(&conv(&g("k_in"), &x, 1), &g("b_in")).unwrap();
    marks.mark(&h0, "in", "h").unwrap();
    let s0 = res(&h0, &g("k_res0"));
    marks.mark(&s0, "down0", "h").unwrap();
    let s1 = res(&conv(&g("k_down"), &s0, 2), &g("k_res1"));
    marks.mark(&s1, "down1", "h").unwrap();
    let m = attn(&s1);
    marks.mark(&m, "mid", "h").unwrap();
    let u1 = res(
        &conv(&g("k_up1"), &ctx.concat(&m, &s1, 2).unwrap(), 1),
        &g("k_res2"),
    );
    marks.mark(&u1, "up1", "h").unwrap();
    let up = ctx.upscale(&u1, 2).unwrap();
    let u0 = res(
        &conv(&g("k_up0"), &ctx.concat(&up, &s0, 2).unwrap(), 1),
        &g("k_res3"),
    );
    marks.mark(&u0, "up0", "h").unwrap();
    let out = conv(
        &g("k_out"),
        &ctx.silu(&ctx.group_norm(&u0, 4, 1e-5).unwrap()).unwrap(),
        1,
    );
    out.set_name("out");
    out.set_output();
    let mut graph = Graph::new(&ctx, 512).unwrap();
    graph.build_forward_expand(&out).unwrap();
    let weights = weights_of(w, "unet.");
    ComputeTask::new("unet", graph, out)
        .with_marks(marks)
        .with_input(&x, bytes_of(&rnd(8 * 8 * 4, 7)))
        .with_input(&t_in, bytes_of(&rnd(C, 8)))
        .with_weights(&weights)
}

/// Pre-norm transformer layer `l` (attention, then a GELU feed-forward) on `h`.
fn tf_layer(ctx: &Context, w: &HashMap<String, GTensor>, l: usize, h: &GTensor) -> GTensor {
    let g = |n: &str| w[&format!("tf.{l}.{n}")].clone();
    let n = ctx.norm(h, 1e-5).unwrap();
    let q = ctx.mul_mat(&g("wq"), &n).unwrap();
    let k = ctx.mul_mat(&g("wk"), &n).unwrap();
    let v = ctx.mul_mat(&g("wv"), &n).unwrap();
    let probs = ctx
        .soft_max_ext(&ctx.mul_mat(&k, &q).unwrap(), None, 0.2)
        .unwrap();
    let vt = ctx.cont(&ctx.transpose(&v).unwrap()).unwrap();
    let a = ctx
        .mul_mat(&g("wo"), &ctx.mul_mat(&vt, &probs).unwrap())
        .unwrap();
    let h = ctx.add(h, &a).unwrap();
    let f = ctx
        .mul_mat(
            &g("w2"),
            &ctx.gelu(&ctx.mul_mat(&g("w1"), &ctx.norm(&h, 1e-5).unwrap()).unwrap())
                .unwrap(),
        )
        .unwrap();
    ctx.add(&h, &f).unwrap()
}

/// The transformer's `LAYERS` layers over `T` input tokens (seed `seed`) as task `name`,
/// `mark` marking the cuts after each layer.
fn layer_stack(
    w: &HashMap<String, GTensor>,
    name: &str,
    seed: u64,
    mut mark: impl FnMut(&mut CutMarks, usize, &GTensor),
) -> ComputeTask {
    let ctx = Context::new_descriptors(1024, 1024, 1).unwrap();
    let x = ctx.new_tensor(DType::F32, &[D, T]).unwrap();
    x.set_name("tokens");
    let mut marks = CutMarks::new();
    let mut h = x.clone();
    for l in 0..LAYERS {
        h = tf_layer(&ctx, w, l, &h);
        mark(&mut marks, l, &h);
    }
    let out = ctx.scale(&h, 1.0).unwrap();
    out.set_output();
    let mut graph = Graph::new(&ctx, 1024).unwrap();
    graph.build_forward_expand(&out).unwrap();
    let weights = weights_of(w, "tf.");
    ComputeTask::new(name, graph, out)
        .with_marks(marks)
        .with_input(&x, bytes_of(&rnd(D * T, seed)))
        .with_weights(&weights)
}

/// A pre-norm transformer stack; each layer's output is a cut.
fn transformer(w: &HashMap<String, GTensor>) -> ComputeTask {
    layer_stack(w, "transformer", 9, |marks, l, h| {
        marks.mark(h, &format!("layer{l}"), "h").unwrap()
    })
}

/// The transformer's layers as three blocks, most of the weights in the middle one: layer
/// 0, then layers 1-4 (a fine cut after each of the first three), then layer 5.
fn blocks(w: &HashMap<String, GTensor>) -> ComputeTask {
    layer_stack(w, "blocks", 12, |marks, l, h| match l {
        0 => marks.mark(h, "block0", "h").unwrap(),
        1..=3 => {
            marks.set_scope("block1");
            marks
                .mark_fine(h, sd_graphcut::LEVEL_LAYER, &format!("layer{l}"))
                .unwrap();
        }
        4 => marks.mark(h, "block1", "h").unwrap(),
        _ => marks.mark(h, "block2", "h").unwrap(),
    })
}

/// A lopsided graph: five MLP layers on one token (most of the weights, little else) as one
/// block with a fine cut after each layer, then a wide tensor (many tokens, one small
/// weight, the narrow block's output added to each) kept live until the end. The wide segments' live cut outgrows the narrow
/// block's weights, so a staging pool beside the wide segments' needs cannot hold the
/// narrow block whole.
fn lopsided(w: &HashMap<String, GTensor>) -> ComputeTask {
    const WIDE: usize = 256;
    let ctx = Context::new_descriptors(256, 256, 1).unwrap();
    let b = ctx.new_tensor(DType::F32, &[D, 1]).unwrap();
    b.set_name("token");
    let a = ctx.new_tensor(DType::F32, &[D, WIDE]).unwrap();
    a.set_name("tokens");
    let mut marks = CutMarks::new();
    marks.set_scope("narrow");
    let mut n = b.clone();
    for l in 1..LAYERS {
        let g = |k: &str| w[&format!("tf.{l}.{k}")].clone();
        let attn = ctx
            .mul_mat(&g("wo"), &ctx.mul_mat(&g("wv"), &n).unwrap())
            .unwrap();
        let qk = ctx
            .mul_mat(&g("wq"), &ctx.mul_mat(&g("wk"), &attn).unwrap())
            .unwrap();
        let f = ctx
            .mul_mat(
                &g("w2"),
                &ctx.gelu(&ctx.mul_mat(&g("w1"), &qk).unwrap()).unwrap(),
            )
            .unwrap();
        n = ctx.add(&n, &f).unwrap();
        if l + 1 < LAYERS {
            marks
                .mark_fine(&n, sd_graphcut::LEVEL_LAYER, &format!("layer{l}"))
                .unwrap();
        }
    }
    marks.mark(&n, "narrow", "h").unwrap();
    // (Reading the narrow block's output: the wide segments come after it.)
    let wide = ctx.add(&ctx.scale(&a, 0.5).unwrap(), &n).unwrap();
    marks.mark(&wide, "wide0", "h").unwrap();
    let wide1 = ctx.mul_mat(&w["tf.0.wq"], &wide).unwrap();
    marks.mark(&wide1, "wide1", "h").unwrap();
    let out = ctx.add(&wide1, &wide).unwrap();
    out.set_output();
    let mut graph = Graph::new(&ctx, 256).unwrap();
    graph.build_forward_expand(&out).unwrap();
    let weights = weights_of(w, "tf.");
    ComputeTask::new("lopsided", graph, out)
        .with_marks(marks)
        .with_input(&b, bytes_of(&rnd(D, 10)))
        .with_input(&a, bytes_of(&rnd(D * WIDE, 11)))
        .with_weights(&weights)
}

/// The weights whose names start with `prefix` (a builder's task weights).
fn weights_of(w: &HashMap<String, GTensor>, prefix: &str) -> Vec<GTensor> {
    w.iter()
        .filter(|(k, _)| k.starts_with(prefix))
        .map(|(_, t)| t.clone())
        .collect()
}

type Builder = fn(&HashMap<String, GTensor>) -> ComputeTask;

/// One step of [`budgeted_steps`].
struct BudgetedStep {
    /// Segments the step ran.
    segments: usize,
    /// Of those, the ones whose weights were prefetched.
    prefetched: usize,
    /// Weight bytes uploaded during the step.
    uploaded: u64,
}

/// Runs `build` for `steps` steps (a sampling loop) in a session of a fresh rig `tag`
/// with prefetch, `budget` and `streaming`; every step's output must equal `whole`'s, and
/// the device must see no fault and never exceed the budget. `None` where the budget is
/// below the smallest that runs.
fn budgeted_steps(
    tag: &str,
    build: Builder,
    whole: &ComputeResult,
    budget: u64,
    streaming: StreamingOptions,
    steps: usize,
) -> Option<Vec<BudgetedStep>> {
    let mut r = rig(tag, true);
    let id = r.engine.create_session(
        SessionConfig::new("test", r.backend.clone(), r.gpu)
            .with_budget(Some(budget))
            .with_prefetch(true)
            .with_streaming(streaming),
    );
    r.engine.start(id).unwrap();
    let mut out = Vec::with_capacity(steps);
    for step in 0..steps {
        let before = r.engine.manager().upload_bytes();
        let res = r.engine.execute(id, &build(&r.w)).ok()?;
        assert_eq!(
            res.output, whole.output,
            "{tag}, budget {budget}, step {step}: differs from the whole graph"
        );
        out.push(BudgetedStep {
            segments: res.segments.len(),
            prefetched: res.segments.iter().filter(|s| s.prefetched).count(),
            uploaded: r.engine.manager().upload_bytes() - before,
        });
    }
    assert_eq!(r.sim.stats().faults, 0, "{tag}: device faults");
    assert!(
        r.sim.peak_bytes() <= budget,
        "{tag}: peak {} > budget {budget}",
        r.sim.peak_bytes()
    );
    r.engine.end(id).unwrap();
    Some(out)
}

fn run(
    name: &str,
    build: Builder,
    budget: Option<u64>,
    policy: SegmentationPolicy,
    prefetch: bool,
) -> (ComputeResult, u64) {
    let mut r = rig(name, prefetch);
    let id = r.session(budget, policy, prefetch);
    let res = r.engine.execute(id, &build(&r.w)).unwrap();
    let peak = r.sim.peak_bytes();
    // A second run of the same graph gives the same bytes (cached plan, reused workspace).
    let again = r.engine.execute(id, &build(&r.w)).unwrap();
    assert_eq!(again.output, res.output, "{name}: second run differs");
    assert!(
        r.sim.peak_bytes() <= budget.unwrap_or(u64::MAX),
        "{name}: peak after second run"
    );
    r.engine.end(id).unwrap();
    (res, peak)
}

fn check_model(tag: &str, build: Builder) {
    let (whole, whole_peak) = run(
        &format!("{tag}_WHOLE"),
        build,
        None,
        SegmentationPolicy::Never,
        false,
    );
    assert!(!whole.segmented);
    assert_eq!(whole.segments.len(), 1);
    let (seg, _) = run(
        &format!("{tag}_ALWAYS"),
        build,
        None,
        SegmentationPolicy::Always,
        false,
    );
    assert!(seg.segmented);
    assert_eq!(
        seg.output, whole.output,
        "{tag}: segmented differs from whole"
    );
    let footprint = seg.segments.iter().map(|s| s.footprint()).max().unwrap();
    // A budget that holds the largest segment but not the whole graph.
    let budget = footprint + 4096;
    assert!(
        budget < whole_peak,
        "{tag}: budget {budget} not tight (whole peak {whole_peak})"
    );
    for prefetch in [false, true] {
        let (tight, peak) = run(
            &format!("{tag}_TIGHT{prefetch}"),
            build,
            Some(budget),
            SegmentationPolicy::Auto,
            prefetch,
        );
        assert!(tight.segmented, "{tag}: not segmented under {budget}");
        // Every segment's cut outputs (and the final output) are computed straight into
        // cut-cache storage, none copied there afterwards.
        let direct: Vec<usize> = tight.segments.iter().map(|s| s.direct_outputs).collect();
        assert!(
            direct.iter().all(|&n| n > 0),
            "{tag}: outputs computed into the cache per segment {direct:?}"
        );
        assert_eq!(
            tight.output, whole.output,
            "{tag}: tight (prefetch {prefetch}) differs"
        );
        assert!(
            peak <= budget,
            "{tag}: device peak {peak} > budget {budget} (prefetch {prefetch})"
        );
        if prefetch {
            println!(
                "{tag}: prefetched segments {}",
                tight.segments.iter().filter(|s| s.prefetched).count()
            );
        }
    }
    println!(
        "{tag}: whole peak {whole_peak} B, segment budget {budget} B, {} segments",
        seg.segments.len()
    );
}

#[test]
fn unet_whole_and_segmented_are_bit_identical_within_budget() {
    check_model("UNET", unet);
}

#[test]
fn transformer_whole_and_segmented_are_bit_identical_within_budget() {
    check_model("TF", transformer);
}

#[test]
fn impossible_budget_fails_naming_segment_and_session_stays_usable() {
    let (reference, _) = run("IMP_REF", unet, None, SegmentationPolicy::Never, false);
    let (seg, _) = run("IMP_SEG", unet, None, SegmentationPolicy::Always, false);
    let largest = seg
        .segments
        .iter()
        .map(|s| s.weight_bytes + s.compute_bytes)
        .max()
        .unwrap();
    let mut r = rig("IMP", false);
    let id = r.session(Some(largest / 2), SegmentationPolicy::Auto, false);
    let err = r.engine.execute(id, &unet(&r.w)).unwrap_err();
    assert!(err.is_out_of_memory(), "{err}");
    let msg = err.to_string();
    // Found while planning, before anything ran: no granularity fits, and the error
    // names the segment and the minimum budget.
    let ExecError::BudgetTooSmall(short) = &err else {
        panic!("not a planning error: {msg}");
    };
    assert!(short.minimum > largest / 2, "{msg}");
    assert!(
        msg.contains("segment") && msg.contains("minimum budget"),
        "{msg}"
    );
    assert_eq!(r.sim.stats().graph_computes, 0, "{msg}");
    assert!(
        r.sim.peak_bytes() <= largest / 2,
        "peak {} > {}",
        r.sim.peak_bytes(),
        largest / 2
    );
    println!("{msg}");
    // Usable afterwards.
    r.engine.session_mut(id).unwrap().set_budget(None);
    let ok = r.engine.execute(id, &unet(&r.w)).unwrap();
    assert_eq!(ok.output, reference.output);
}

#[test]
fn second_session_reclaims_first_sessions_idle_workspace_then_weights() {
    let mut r = rig("EVICT", false);
    let a = r.session(None, SegmentationPolicy::Never, false);
    let b = r.session(None, SegmentationPolicy::Auto, false);
    let ua = r.engine.execute(a, &unet(&r.w)).unwrap();
    let a_bytes = r.engine.session(a).unwrap().resident_bytes();
    assert!(a_bytes > 0, "session A keeps an idle workspace");
    let after_a = r.sim.live_bytes();
    // A device budget that cannot hold A's leftovers and B's transformer at once.
    let (tf, _) = run(
        "EVICT_TF",
        transformer,
        None,
        SegmentationPolicy::Never,
        false,
    );
    let budget = tf.segments[0].footprint() + 4096;
    assert!(after_a + tf.segments[0].footprint() > budget);
    let dev = r.sim.device();
    r.engine.manager_mut().set_device_budget(&dev, Some(budget));
    r.sim.reset_peak();
    r.engine.take_reclaim_log();
    let out = r.engine.execute(b, &transformer(&r.w)).unwrap();
    assert_eq!(out.output, tf.output);
    assert!(
        r.sim.peak_bytes() <= budget.max(after_a),
        "peak {}",
        r.sim.peak_bytes()
    );
    let log = r.engine.take_reclaim_log();
    assert!(!log.is_empty());
    assert_eq!(
        log[0],
        ReclaimEvent::ReleasedWorkspace {
            session: a,
            bytes: a_bytes
        },
        "{log:?}"
    );
    assert!(r.engine.session(a).unwrap().workspace().is_released());
    // Only A's (unet) weights were evicted.
    let unet_params: Vec<_> =
        r.w.iter()
            .filter(|(k, _)| k.starts_with("unet."))
            .map(|(_, t)| r.engine.manager().resolve_param(t.id()).unwrap())
            .collect();
    let evicted: Vec<_> = log
        .iter()
        .filter_map(|e| match e {
            ReclaimEvent::EvictedBlock { params, .. } => Some(params.clone()),
            _ => None,
        })
        .flatten()
        .collect();
    assert!(!evicted.is_empty(), "{log:?}");
    assert!(evicted.iter().all(|p| unet_params.contains(p)), "{log:?}");
    // A still works afterwards (reclaiming B's idle state in turn).
    r.engine.manager_mut().set_device_budget(&dev, None);
    assert_eq!(r.engine.execute(a, &unet(&r.w)).unwrap().output, ua.output);
}

/// Two simulated devices for layer split: the weights are registered on the first, the
/// session splits them across both.
struct SplitRig {
    sims: [SimDevice; 2],
    engine: ExecutionEngine<ModelManager>,
    w: HashMap<String, GTensor>,
    id: SessionId,
    _wctx: Context,
    _dir: tempfile::TempDir,
}

fn split_rig(name: &str, budgets: [Option<u64>; 2], prefetch: bool) -> SplitRig {
    let Rig {
        sim,
        mut engine,
        gpu,
        backend,
        w,
        _wctx,
        _dir,
    } = rig(&format!("{name}_0"), prefetch);
    let sim1 = SimDevice::new(&format!("{name}_1"), 64 << 20, SimOptions::default()).unwrap();
    let backend1 = Arc::new(sim1.backend().unwrap());
    let gpu1 = engine.manager_mut().add_backend(backend1.clone()).unwrap();
    let id = engine.create_session(
        SessionConfig::new("split", backend, gpu)
            .with_budget(budgets[0])
            .with_prefetch(prefetch)
            .with_split_device(backend1, gpu1, budgets[1]),
    );
    engine.start(id).unwrap();
    SplitRig {
        sims: [sim, sim1],
        engine,
        w,
        id,
        _wctx,
        _dir,
    }
}

/// Runs `build` split across two simulated devices with `budgets` (twice: the second run
/// reuses the sticky assignment); checks the output against `reference` and each device's
/// own peak against its budget; returns the first run's result.
fn check_split(
    tag: &str,
    build: Builder,
    reference: &ComputeResult,
    budgets: [u64; 2],
    prefetch: bool,
    resident_weights: Option<u64>,
) -> ComputeResult {
    let mut r = split_rig(tag, budgets.map(Some), prefetch);
    let first = r.engine.execute(r.id, &build(&r.w)).unwrap();
    let h2d = |r: &SplitRig| -> u64 { r.sims.iter().map(|s| s.stats().host_to_device_bytes).sum() };
    let before = h2d(&r);
    let second = r.engine.execute(r.id, &build(&r.w)).unwrap();
    if let Some(weights) = resident_weights {
        // Resident split: the second run uploads inputs only, no weights.
        let moved = h2d(&r) - before;
        assert!(
            moved < weights / 4,
            "{tag}: second run moved {moved} B host->device (weights {weights} B)"
        );
    }
    for (run, res) in [("first", &first), ("second", &second)] {
        assert_eq!(
            res.output, reference.output,
            "{tag}: {run} split run differs from whole"
        );
    }
    for (d, sim) in r.sims.iter().enumerate() {
        assert!(
            sim.peak_bytes() <= budgets[d],
            "{tag}: device {d} peak {} > budget {}",
            sim.peak_bytes(),
            budgets[d]
        );
        assert!(sim.peak_bytes() > 0, "{tag}: device {d} unused");
    }
    let devices: Vec<usize> = first.segments.iter().map(|s| s.device).collect();
    assert!(
        devices.windows(2).all(|w| w[0] <= w[1]),
        "{tag}: device ranges not contiguous: {devices:?}"
    );
    assert!(devices.contains(&0) && devices.contains(&1), "{devices:?}");
    let copied: u64 = first.segments.iter().map(|s| s.copied_bytes).sum();
    assert!(copied > 0, "{tag}: no activation crossed devices");
    // Every weight was assigned to the device of the segments using it.
    let session = r.engine.session(r.id).unwrap();
    assert!(session.is_layer_split());
    let m = r.engine.manager();
    for (name, t) in &r.w {
        if let Some(p) = m.resolve_param(t.id()) {
            if let Some(d) = session.split_device_of(p) {
                assert!(devices.contains(&d), "{tag}: {name} on unused device {d}");
            }
        }
    }
    r.engine.end(r.id).unwrap();
    println!(
        "{tag}: devices {devices:?}, copied {copied} B, peaks {} / {} B of {budgets:?}",
        r.sims[0].peak_bytes(),
        r.sims[1].peak_bytes()
    );
    first
}

fn check_layer_split(tag: &str, build: Builder) {
    let (whole, _) = run(
        &format!("{tag}_LS_WHOLE"),
        build,
        None,
        SegmentationPolicy::Never,
        false,
    );
    let (seg, _) = run(
        &format!("{tag}_LS_SEG"),
        build,
        None,
        SegmentationPolicy::Always,
        false,
    );
    let weights: u64 = seg.segments.iter().map(|s| s.weight_bytes).sum();
    let footprint = seg.segments.iter().map(|s| s.footprint()).max().unwrap();
    let workspace = seg
        .segments
        .iter()
        .map(|s| s.compute_bytes + s.cache_bytes)
        .max()
        .unwrap();
    // Resident split: each device holds about 60% of the weights, so neither holds all.
    let resident = weights * 6 / 10 + workspace + 16384;
    assert!(resident < weights + workspace, "{tag}: budget not tight");
    for prefetch in [false, true] {
        check_split(
            &format!("{tag}_LS_RES{prefetch}"),
            build,
            &whole,
            [resident, resident],
            prefetch,
            Some(weights),
        );
    }
    // Streaming split: both devices far smaller than the weights.
    let tight = footprint * 2 + 8192;
    if tight < weights {
        check_split(
            &format!("{tag}_LS_STREAM"),
            build,
            &whole,
            [tight, tight],
            true,
            None,
        );
    }
}

#[test]
fn unet_layer_split_across_two_devices_equals_whole_within_budgets() {
    check_layer_split("UNET", unet);
}

#[test]
fn transformer_layer_split_across_two_devices_equals_whole_within_budgets() {
    check_layer_split("TF", transformer);
}

/// Repeated steps under a budget of about half the weights (a sampling loop): the eviction
/// order (furthest next use first) keeps a resident set from step to step and streams only
/// the rest, where least-recently-used or reverse-segment orders evict exactly what the next
/// step needs first and re-upload every weight each step.
#[test]
fn repeated_steps_keep_a_resident_set_under_a_half_weight_budget() {
    let (seg, _) = run(
        "SIM_CYCLIC_PROBE",
        transformer,
        None,
        SegmentationPolicy::Always,
        false,
    );
    let mut r = rig("SIM_CYCLIC", false);
    let weights: u64 =
        r.w.iter()
            .filter(|(k, _)| k.starts_with("tf."))
            .map(|(_, t)| t.nbytes() as u64)
            .sum();
    let footprint = seg.segments.iter().map(|s| s.footprint()).max().unwrap();
    // Half the weights besides the largest segment, with a little slack for alignment.
    let budget = weights / 2 + footprint + 8192;
    // A streaming window of two segments (the one computing and the next): a wider window
    // leaves the resident set less of this small pool.
    let id = r.engine.create_session(
        SessionConfig::new("test", r.backend.clone(), r.gpu)
            .with_budget(Some(budget))
            .with_prefetch(false)
            .with_stream_window(2),
    );
    r.engine.start(id).unwrap();
    let h2d = |r: &Rig| r.sim.stats().host_to_device_bytes;
    let mut per_step = Vec::new();
    for _ in 0..4 {
        let before = h2d(&r);
        let out = r.engine.execute(id, &transformer(&r.w)).unwrap();
        assert!(out.segmented);
        assert_eq!(out.output, seg.output, "budgeted step differs");
        per_step.push(h2d(&r) - before);
    }
    assert!(r.sim.peak_bytes() <= budget, "peak over budget");
    // Steady state: what does not fit is streamed, what fits stays. Here two of the six
    // layers (plus the small input) per step; reverse segment order re-uploads three.
    for (i, moved) in per_step.iter().enumerate().skip(1) {
        assert!(
            *moved < weights * 7 / 16,
            "step {i} moved {moved} B of {weights} B weights under budget {budget} \
             (per step: {per_step:?})"
        );
    }
    println!("weights {weights} B, budget {budget} B, host->device per step {per_step:?}");
    r.engine.end(id).unwrap();
}

/// With `next_pass_prefetch`, the last segments of a step prefetch the first layer's weights
/// for the next step: after each step they are staged on the device (without it the
/// streaming window has moved on, and the next step uploads them while the device waits),
/// with the whole graph's bits, the same bytes streamed in a steady step (the resident set
/// kept, the rest streamed once a step either way), within the budget, no device fault.
#[test]
fn last_segments_prefetch_the_next_steps_first_segment() {
    let (whole, _) = run(
        "NEXT_REF",
        transformer,
        None,
        SegmentationPolicy::Never,
        false,
    );
    let (seg, _) = run(
        "NEXT_PROBE",
        transformer,
        None,
        SegmentationPolicy::Always,
        false,
    );
    let weights = weight_bytes(&rig("NEXT_W", false), "tf.");
    let footprint = seg.segments.iter().map(|s| s.footprint()).max().unwrap();
    // The first layer's parameters, by name.
    let first_layer = |r: &Rig| -> Vec<sd_residency::ParamId> {
        (0..256)
            .map(sd_residency::ParamId)
            .filter(|&p| {
                r.engine
                    .manager()
                    .param_info(p)
                    .is_some_and(|i| i.name.contains(".tf.0."))
            })
            .collect()
    };
    // (budget, first layer staged after each step with / without, bytes a step with / without)
    let mut rows = Vec::new();
    for i in 0..12u64 {
        let budget = footprint + 4096 + i * weights / 16;
        let steps = |next: bool| -> Option<(bool, Vec<u64>)> {
            let mut r = rig(&format!("NEXT_{i}_{next}"), true);
            let id = r.engine.create_session(
                SessionConfig::new("test", r.backend.clone(), r.gpu)
                    .with_budget(Some(budget))
                    .with_prefetch(true)
                    .with_streaming(StreamingOptions {
                        next_pass_prefetch: next,
                        ..StreamingOptions::default()
                    }),
            );
            r.engine.start(id).unwrap();
            let ids = first_layer(&r);
            assert_eq!(ids.len(), 6, "the first layer's six weights");
            let mut staged_after_each = true;
            let mut moved = Vec::new();
            for step in 0..3 {
                let before = r.sim.stats().host_to_device_bytes;
                let out = r.engine.execute(id, &transformer(&r.w)).ok()?;
                moved.push(r.sim.stats().host_to_device_bytes - before);
                let tag = format!("budget {budget} next {next} step {step}");
                assert!(out.segmented, "{tag}: not segmented");
                assert_eq!(
                    out.output, whole.output,
                    "{tag}: differs from the whole graph"
                );
                staged_after_each &= ids.iter().all(|&p| {
                    let info = r.engine.manager().param_info(p).unwrap();
                    info.staged || info.resident_on_compute
                });
            }
            assert_eq!(r.sim.stats().faults, 0, "budget {budget}: device faults");
            assert!(
                r.sim.peak_bytes() <= budget,
                "budget {budget} next {next}: peak {} over the budget",
                r.sim.peak_bytes()
            );
            r.engine.end(id).unwrap();
            Some((staged_after_each, moved))
        };
        let (Some(on), Some(off)) = (steps(true), steps(false)) else {
            continue;
        };
        rows.push((budget, on.0, off.0, on.1, off.1));
    }
    for r in &rows {
        println!(
            "budget {} B: first layer staged after each step: with {} without {}; bytes a step with {:?} without {:?}",
            r.0, r.1, r.2, r.3, r.4
        );
    }
    // Where the window has moved past the first layer by the end of a step, the next-pass
    // prefetch has it staged again, streaming no more in the steady state.
    assert!(
        rows.iter().any(|(_, on, off, ..)| *on && !*off),
        "no budget where only the next-pass prefetch kept the first layer staged: {rows:?}"
    );
    for (budget, _, _, on, off) in &rows {
        assert_eq!(
            on[2], off[2],
            "budget {budget}: bytes of a steady step differ"
        );
    }
}

/// Under a budget just below the whole graph, consecutive cut groups run as one segment
/// while a segment stays within a third of the budget (the UNet's small groups merge; the
/// transformer's layers, each over a sixth of the weights, cannot), with the same bits as
/// the whole graph, within budget; with merging off, every cut group is its own segment.
fn check_merged(tag: &str, build: Builder, expect_merges: bool) {
    let (whole, whole_peak) = run(
        &format!("{tag}_MWHOLE"),
        build,
        None,
        SegmentationPolicy::Never,
        false,
    );
    let (fine, _) = run(
        &format!("{tag}_MFINE"),
        build,
        None,
        SegmentationPolicy::Always,
        false,
    );
    let groups = fine.segments.len();
    let budget = whole_peak * 9 / 10;
    for (merge, prefetch) in [(true, false), (true, true), (false, true)] {
        let mut r = rig(&format!("{tag}_M{merge}{prefetch}"), prefetch);
        let id = r.engine.create_session(
            SessionConfig::new("test", r.backend.clone(), r.gpu)
                .with_budget(Some(budget))
                .with_prefetch(prefetch)
                .with_segment_merging(merge),
        );
        r.engine.start(id).unwrap();
        for step in 0..2 {
            let res = r.engine.execute(id, &build(&r.w)).unwrap();
            assert!(res.segmented, "{tag}: not segmented under {budget}");
            assert_eq!(res.output, whole.output, "{tag}: merge {merge} step {step}");
            let n = res.segments.len();
            if merge && expect_merges {
                assert!(
                    n < groups && n >= 2,
                    "{tag}: {n} segments for {groups} cut groups under {budget} B"
                );
            } else {
                assert_eq!(n, groups, "{tag}: merge {merge}");
            }
            println!(
                "{tag}: merge {merge} prefetch {prefetch}: {n} segments ({:?})",
                res.segments
                    .iter()
                    .map(|s| s.name.as_str())
                    .collect::<Vec<_>>()
            );
        }
        assert!(
            r.sim.peak_bytes() <= budget,
            "{tag}: peak {} > budget {budget}",
            r.sim.peak_bytes()
        );
        r.engine.end(id).unwrap();
    }
}

#[test]
fn unet_merged_segments_equal_whole_within_budget() {
    check_merged("SIM_UNET", unet, true);
}

#[test]
fn transformer_merged_segments_equal_whole_within_budget() {
    check_merged("SIM_TF", transformer, false);
}

/// The runner cache: an input stored once on the device feeds later executions by a
/// device-side copy (the same bits as the host input, fewer bytes host->device), counts in
/// the session's resident bytes, survives idle reclamation, and goes with `clear_cache`; a
/// task reading a missing entry fails naming it, and the session stays usable.
#[test]
fn runner_cache_feeds_inputs_on_the_device_and_counts_in_the_budget() {
    let mut r = rig("SIM_RUNNER", false);
    let id = r.session(None, SegmentationPolicy::Always, false);
    let reference = transformer(&r.w);
    let host_in = reference.inputs[0].1.clone();
    let want = r.engine.execute(id, &reference).unwrap();

    let like = reference.inputs[0].0.clone();
    r.engine.cache_store(id, "tokens", &like, &host_in).unwrap();
    let cached = r.engine.session(id).unwrap().runner_cache_bytes();
    assert!(
        cached >= host_in.len() as u64,
        "runner cache holds {cached} B"
    );
    assert!(r.engine.session(id).unwrap().resident_bytes() >= cached);

    // The same graph with its input taken from the cache instead of the host.
    let from_cache = |r: &Rig| {
        let mut t = transformer(&r.w);
        let (leaf, _) = t.inputs.remove(0);
        t.with_cached_input(&leaf, "tokens")
    };
    let before = r.sim.stats().host_to_device_bytes;
    let got = r.engine.execute(id, &from_cache(&r)).unwrap();
    let cached_h2d = r.sim.stats().host_to_device_bytes - before;
    assert_eq!(got.output, want.output, "cached input gives other bits");
    let before = r.sim.stats().host_to_device_bytes;
    r.engine.execute(id, &transformer(&r.w)).unwrap();
    let host_h2d = r.sim.stats().host_to_device_bytes - before;
    assert!(
        cached_h2d + host_in.len() as u64 <= host_h2d,
        "cached run moved {cached_h2d} B host->device, host-input run {host_h2d} B"
    );

    // A second session's work reclaims idle workspaces, not the runner cache.
    let other = r.session(None, SegmentationPolicy::Always, false);
    r.engine.execute(other, &unet(&r.w)).unwrap();
    assert!(r.engine.cache_entry(id, "tokens").is_some());

    // A missing entry: a clear error, and the session still works.
    let mut t = transformer(&r.w);
    let (leaf, _) = t.inputs.remove(0);
    let err = r
        .engine
        .execute(id, &t.with_cached_input(&leaf, "nothing"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("'nothing'"), "{err}");
    assert_eq!(
        r.engine.execute(id, &from_cache(&r)).unwrap().output,
        want.output
    );

    r.engine.clear_cache(id).unwrap();
    assert!(r.engine.cache_entry(id, "tokens").is_none());
    assert_eq!(r.engine.session(id).unwrap().runner_cache_bytes(), 0);
    r.engine.end(id).unwrap();
    r.engine.end(other).unwrap();
}

/// Bytes of the weights whose short names start with `prefix`.
fn weight_bytes(r: &Rig, prefix: &str) -> u64 {
    r.w.iter()
        .filter(|(k, _)| k.starts_with(prefix))
        .map(|(_, t)| t.nbytes() as u64)
        .sum()
}

/// Per step of a UNet sampling loop under a budget of about half its weights: the
/// device allocations, the host->device bytes, the staging pool's size; and the
/// device peak. With `pool` off, every staged group is a buffer of its own.
fn pooled_steps(
    tag: &str,
    budget: u64,
    pool: bool,
    prefetch: bool,
    want: &[u8],
) -> (Vec<u64>, Vec<u64>, Vec<Option<u64>>, u64) {
    let mut r = rig(&format!("POOL_{tag}_{pool}_{prefetch}"), prefetch);
    let id = r.engine.create_session(
        SessionConfig::new("test", r.backend.clone(), r.gpu)
            .with_budget(Some(budget))
            .with_prefetch(prefetch)
            .with_staging_pool(pool),
    );
    r.engine.start(id).unwrap();
    let (mut allocs, mut h2d, mut pools) = (Vec::new(), Vec::new(), Vec::new());
    for step in 0..4 {
        let before = r.sim.stats();
        let out = r.engine.execute(id, &unet(&r.w)).unwrap();
        let after = r.sim.stats();
        assert!(out.segmented, "{tag}: not segmented under {budget}");
        assert_eq!(out.output, want, "{tag}: pool {pool} step {step} differs");
        allocs.push(after.allocations - before.allocations);
        h2d.push(after.host_to_device_bytes - before.host_to_device_bytes);
        // The engine's own count of streamed weight bytes is the device's, less the inputs.
        let inputs = (8 * 8 * 4 + C) as u64 * 4;
        assert_eq!(
            out.weight_upload_bytes + inputs,
            after.host_to_device_bytes - before.host_to_device_bytes,
            "{tag}: pool {pool} prefetch {prefetch} step {step}"
        );
        pools.push(r.engine.manager().staging_pool_bytes(r.gpu).map(|p| p.0));
    }
    let peak = r.sim.peak_bytes();
    r.engine.end(id).unwrap();
    assert_eq!(
        r.engine.manager().staging_pool_bytes(r.gpu),
        None,
        "{tag}: the pool goes with the session"
    );
    (allocs, h2d, pools, peak)
}

/// Streaming a UNet step by step under a budget of about half its weights: with the
/// staging pool, the pool is allocated once (first step) and never grown or reallocated,
/// streamed weights are sub-allocated from it (fewer device allocations per step than one
/// buffer per staged group, the same bytes uploaded), and the output is the whole graph's
/// bit for bit, within the budget, with and without prefetch.
#[test]
fn staging_pool_is_allocated_once_and_cuts_device_allocations_per_step() {
    let (whole, _) = run("POOL_REF", unet, None, SegmentationPolicy::Never, false);
    let (seg, _) = run("POOL_PROBE", unet, None, SegmentationPolicy::Always, false);
    let weights = weight_bytes(&rig("POOL_W", false), "unet.");
    let footprint = seg.segments.iter().map(|s| s.footprint()).max().unwrap();
    let budget = weights / 2 + footprint + 8192;
    for prefetch in [false, true] {
        let (a_pool, h_pool, pools, peak_pool) =
            pooled_steps("UNET", budget, true, prefetch, &whole.output);
        let (a_plain, h_plain, none, peak_plain) =
            pooled_steps("UNET", budget, false, prefetch, &whole.output);
        println!(
            "prefetch {prefetch}: weights {weights} B, budget {budget} B, pool {:?}; \
             device allocations per step {a_pool:?} with the pool, {a_plain:?} without; \
             host->device per step {h_pool:?} / {h_plain:?}; peak {peak_pool} / {peak_plain}",
            pools[0]
        );
        assert!(none.iter().all(Option::is_none), "pool off: {none:?}");
        let size = pools[0].expect("a staging pool under this budget");
        assert!(
            size > 0 && size <= budget,
            "pool {size} B, budget {budget} B"
        );
        // Allocated once, never grown or reallocated.
        assert!(pools.iter().all(|p| *p == Some(size)), "{pools:?}");
        assert!(peak_pool <= budget, "peak {peak_pool} > budget {budget}");
        assert!(peak_plain <= budget, "peak {peak_plain} > budget {budget}");
        // Weights are streamed every step (the budget holds about half of them) ...
        for (i, h) in h_pool.iter().enumerate().skip(1) {
            assert!(*h > 0, "step {i} uploaded nothing: {h_pool:?}");
        }
        // ... with fewer device allocations per step than a buffer per staged group.
        for i in 1..4 {
            assert!(
                a_pool[i] < a_plain[i],
                "step {i}: {} allocations with the pool, {} without",
                a_pool[i],
                a_plain[i]
            );
        }
    }
}

/// Budgets under which every segment fits but the staging pool (the limit less the largest
/// non-weight need) would not hold the largest segment's weights: the plan is refined
/// further (`StreamingOptions::refine_for_pool`) so that a pool is used. Scanning budgets
/// from the segments' largest footprint up by all the weights, wherever the plan without
/// that refinement has a pool the refined one has it too, and at least one budget gains a
/// pool by it; there the steps allocate fewer device buffers, and every run equals the
/// whole graph bit for bit within its budget.
#[test]
fn plans_are_refined_so_that_a_staging_pool_holds_every_segment() {
    let (whole, _) = run("RFP_REF", lopsided, None, SegmentationPolicy::Never, false);
    let (seg, _) = run(
        "RFP_PROBE",
        lopsided,
        None,
        SegmentationPolicy::Always,
        false,
    );
    let weights = weight_bytes(&rig("RFP_W", false), "tf.");
    let footprint = seg.segments.iter().map(|s| s.footprint()).max().unwrap();
    // (budget, pool without, pool with, allocations in step 3 without, with)
    let mut rows = Vec::new();
    for i in 0..32u64 {
        let budget = footprint + 4096 + i * weights / 32;
        let one = |refine: bool| -> Option<(Option<u64>, u64)> {
            let mut r = rig(&format!("RFP_{i}_{refine}"), true);
            let id = r.engine.create_session(
                SessionConfig::new("test", r.backend.clone(), r.gpu)
                    .with_budget(Some(budget))
                    .with_prefetch(true)
                    .with_refine_for_pool(refine),
            );
            r.engine.start(id).unwrap();
            let mut allocs = 0;
            let mut pool = None;
            for step in 0..3 {
                let before = r.sim.stats();
                // (Below the smallest budget that runs: none.)
                let out = r.engine.execute(id, &lopsided(&r.w)).ok()?;
                let tag = format!("budget {budget} refine {refine} step {step}");
                assert_eq!(
                    out.output, whole.output,
                    "{tag}: differs from the whole graph"
                );
                allocs = r.sim.stats().allocations - before.allocations;
                pool = r.engine.manager().staging_pool_bytes(r.gpu).map(|p| p.0);
            }
            assert!(
                r.sim.peak_bytes() <= budget,
                "refine {refine}: peak {} > budget {budget}",
                r.sim.peak_bytes()
            );
            r.engine.end(id).unwrap();
            Some((pool, allocs))
        };
        // (Below the smallest budget that runs, neither runs.)
        let (Some((without, a_without)), Some((with, a_with))) = (one(false), one(true)) else {
            continue;
        };
        rows.push((budget, without, with, a_without, a_with));
    }
    for r in &rows {
        println!(
            "budget {} B: pool {:?} / {:?} refined; allocations a step {} / {}",
            r.0, r.1, r.2, r.3, r.4
        );
    }
    for &(budget, without, with, a_without, a_with) in &rows {
        if without.is_some() {
            assert_eq!(
                with, without,
                "budget {budget}: the refinement changed a pooled plan"
            );
        }
        if without.is_none() && with.is_some() {
            assert!(
                a_with < a_without,
                "budget {budget}: {a_with} allocations a step refined, {a_without} without"
            );
        }
    }
    assert!(
        rows.iter().any(|r| r.1.is_none() && r.2.is_some()),
        "no budget gained a pool by the refinement: {rows:?}"
    );
}

/// A staging pool that holds the largest segment but not a window of them cannot take the
/// next segment's prefetch while a large one computes. Scanning budgets from the
/// segments' largest footprint up by all the weights, a window of three segments
/// (`StreamingOptions::stream_window`) refines the large middle block under some budget into
/// more segments, more of them prefetched, than a window of one; every run equals the
/// whole graph bit for bit within its budget, without device faults.
#[test]
fn plans_are_refined_so_that_the_staging_pool_holds_a_window_of_segments() {
    let (whole, _) = run("WIN_REF", blocks, None, SegmentationPolicy::Never, false);
    let (seg, _) = run("WIN_PROBE", blocks, None, SegmentationPolicy::Always, false);
    let weights = weight_bytes(&rig("WIN_W", false), "tf.");
    let footprint = seg.segments.iter().map(|s| s.footprint()).max().unwrap();
    // (budget, (segments, prefetched) in step 3 with a window of 1, of 3)
    let mut rows = Vec::new();
    for i in 0..32u64 {
        let budget = footprint + 4096 + i * weights / 32;
        let one = |window: usize| -> Option<(usize, usize)> {
            let streaming = StreamingOptions {
                stream_window: window,
                ..StreamingOptions::default()
            };
            let tag = format!("WIN_{i}_{window}");
            let steps = budgeted_steps(&tag, blocks, &whole, budget, streaming, 3)?;
            steps.last().map(|s| (s.segments, s.prefetched))
        };
        let (Some(one_segment), Some(three)) = (one(1), one(3)) else {
            continue;
        };
        rows.push((budget, one_segment, three));
    }
    for r in &rows {
        println!(
            "budget {} B: (segments, prefetched) window 1 {:?}, window 3 {:?}",
            r.0, r.1, r.2
        );
    }
    assert!(
        rows.iter().any(|(_, a, b)| b.0 > a.0 && b.1 > a.1),
        "no budget where the window refined the plan and prefetched more: {rows:?}"
    );
}

/// Refining for the resident set (`StreamingOptions::refine_for_residency`): at some budget
/// where the coarse plan already fits with a staging pool, cutting the block that holds
/// most of the weights at its finer marks leaves a smaller streaming window, so more
/// weights stay on the device from step to step and fewer bytes are uploaded a step; the
/// output is the whole graph's and the device never exceeds the budget either way.
#[test]
fn refining_for_the_resident_set_streams_fewer_bytes_a_step() {
    let (whole, _) = run("RES_REF", blocks, None, SegmentationPolicy::Never, false);
    let (seg, _) = run("RES_PROBE", blocks, None, SegmentationPolicy::Always, false);
    let weights = weight_bytes(&rig("RES_W", false), "tf.");
    let footprint = seg.segments.iter().map(|s| s.footprint()).max().unwrap();
    // (budget, (segments, bytes uploaded in step 4) without, with)
    let mut rows = Vec::new();
    for i in 0..24u64 {
        let budget = footprint + 4096 + i * weights / 24;
        let one = |refine: bool| -> Option<(usize, u64)> {
            // (A window of one segment: the pool need only hold the largest, so that
            // refining for the pool leaves the coarse plan to refine here.)
            let streaming = StreamingOptions {
                refine_for_residency: refine,
                segment_weight_share: 8,
                stream_window: 1,
                ..StreamingOptions::default()
            };
            let tag = format!("RES_{i}_{refine}");
            let steps = budgeted_steps(&tag, blocks, &whole, budget, streaming, 4)?;
            steps.last().map(|s| (s.segments, s.uploaded))
        };
        let (Some(plain), Some(refined)) = (one(false), one(true)) else {
            continue;
        };
        rows.push((budget, plain, refined));
    }
    for r in &rows {
        println!(
            "budget {} B: (segments, bytes a step) plain {:?}, refined {:?}",
            r.0, r.1, r.2
        );
    }
    assert!(
        rows.iter().any(|(_, a, b)| b.0 > a.0 && b.1 < a.1),
        "no budget where refining for the resident set streamed fewer bytes: {rows:?}"
    );
}

/// A session that needs the device reclaims another (idle) session's staging pool, with
/// the weights staged in it, after that session's idle workspace; the first session
/// works again afterwards (and gets a pool again).
#[test]
fn another_session_reclaims_an_idle_staging_pool() {
    let (whole, _) = run("RPOOL_REF", unet, None, SegmentationPolicy::Never, false);
    let (seg, _) = run("RPOOL_PROBE", unet, None, SegmentationPolicy::Always, false);
    let (tf, _) = run(
        "RPOOL_TF",
        transformer,
        None,
        SegmentationPolicy::Never,
        false,
    );
    let mut r = rig("RPOOL", false);
    let weights = weight_bytes(&r, "unet.");
    let footprint = seg.segments.iter().map(|s| s.footprint()).max().unwrap();
    // The UNet streams under its session budget; the transformer, run whole, fits the
    // device budget but not next to the UNet's pool.
    let unet_budget = weights / 2 + footprint + 8192;
    let budget = tf.segments[0].footprint() + 4096;
    let dev = r.sim.device();
    r.engine.manager_mut().set_device_budget(&dev, Some(budget));
    let a = r.session(Some(unet_budget), SegmentationPolicy::Auto, false);
    let b = r.session(None, SegmentationPolicy::Never, false);
    let ua = r.engine.execute(a, &unet(&r.w)).unwrap();
    assert!(ua.segmented);
    assert_eq!(ua.output, whole.output);
    let (size, _) = r
        .engine
        .manager()
        .staging_pool_bytes(r.gpu)
        .expect("the streaming UNet has a pool");
    assert!(size + tf.segments[0].footprint() > budget);
    r.engine.take_reclaim_log();
    let out = r.engine.execute(b, &transformer(&r.w)).unwrap();
    assert_eq!(out.output, tf.output);
    let log = r.engine.take_reclaim_log();
    assert!(
        log.contains(&ReclaimEvent::ReleasedStagingPool {
            session: a,
            bytes: size
        }),
        "{log:?}"
    );
    assert_eq!(r.engine.manager().staging_pool_bytes(r.gpu), None);
    assert!(r.sim.peak_bytes() <= budget, "peak {}", r.sim.peak_bytes());
    let again = r.engine.execute(a, &unet(&r.w)).unwrap();
    assert_eq!(again.output, whole.output);
    assert!(r.engine.manager().staging_pool_bytes(r.gpu).is_some());
    assert!(r.sim.peak_bytes() <= budget, "peak {}", r.sim.peak_bytes());
}

/// Every execution reports where its time went: the parts are measured, add up to at
/// most the total, and the rest is the engine's overhead.
#[test]
fn execution_timing_is_reported() {
    for policy in [SegmentationPolicy::Never, SegmentationPolicy::Always] {
        let mut r = rig(&format!("TIMING_{policy:?}"), false);
        let id = r.session(None, policy, false);
        for step in 0..2 {
            let res = r.engine.execute(id, &unet(&r.w)).unwrap();
            let t = res.timing;
            assert_eq!(t.segments, res.segments.len());
            assert!(t.compute > std::time::Duration::ZERO, "{t:?}");
            assert!(t.plan > std::time::Duration::ZERO, "{t:?}");
            // The whole graph's second run reuses the first run's ggml graph; segments
            // reuse theirs where the cut cache still holds cuts of their layout.
            let reused = res.segments.iter().filter(|s| s.graph_reused).count();
            if policy == SegmentationPolicy::Never {
                assert_eq!(reused, step, "{policy:?} step {step}");
            } else if step == 0 {
                assert_eq!(reused, 0, "{policy:?} step {step}");
            }
            if reused == res.segments.len() {
                assert_eq!(t.build, std::time::Duration::ZERO, "{t:?}");
            } else {
                assert!(t.build > std::time::Duration::ZERO, "{t:?}");
                assert!(t.allocate > std::time::Duration::ZERO, "{t:?}");
            }
            let parts = t.plan
                + t.capacity
                + t.staging
                + t.wait
                + t.prefetch
                + t.upload_wait
                + t.build
                + t.allocate
                + t.compute
                + t.overhead;
            assert_eq!(parts, t.total, "{t:?}");
            assert!(t.total >= t.compute + t.plan, "{t:?}");
            println!("{policy:?}: {t:?}");
        }
        r.engine.end(id).unwrap();
    }
}

/// Streaming a UNet step by step under a budget of about half its weights on a device
/// with queued copies and events (`SimOptions::async_transfers`: a queued copy takes effect
/// only when something orders after it, so a compute not ordered after its weights'
/// uploads would read stale memory): prefetch uploads go to the copy stream (queued copies
/// counted), the output is the whole graph's bit for bit every step, the device peak stays
/// within the budget, the staging pool keeps its size from step to step and the queued
/// uploads allocate no device memory (the same allocations per step as the synchronous
/// path, which the same device runs with async uploads off).
#[test]
fn async_uploads_on_a_copy_stream_equal_whole_within_budget_with_a_fixed_pool() {
    let (whole, _) = run("ASYNC_REF", unet, None, SegmentationPolicy::Never, false);
    let (seg, _) = run("ASYNC_PROBE", unet, None, SegmentationPolicy::Always, false);
    let weights = weight_bytes(&rig("ASYNC_W", false), "unet.");
    let footprint = seg.segments.iter().map(|s| s.footprint()).max().unwrap();
    let budget = weights / 2 + footprint + 8192;
    let inputs = (8 * 8 * 4 + C) as u64 * 4;
    // Chosen by capability: a device without queued copies and events has no copy stream.
    let mut plain = rig("ASYNC_PLAIN", true);
    assert!(!plain.engine.manager_mut().uploads_async(plain.gpu));
    let mut allocs: HashMap<bool, Vec<u64>> = HashMap::new();
    for async_on in [true, false] {
        let mut r = rig_with(
            &format!("ASYNC_{async_on}"),
            true,
            SimOptions {
                async_transfers: true,
                ..SimOptions::default()
            },
        );
        r.engine.manager_mut().set_async_uploads(async_on);
        assert_eq!(r.engine.manager_mut().uploads_async(r.gpu), async_on);
        let id = r.engine.create_session(
            SessionConfig::new("test", r.backend.clone(), r.gpu)
                .with_budget(Some(budget))
                .with_prefetch(true)
                .with_staging_pool(true)
                // Counting the copy stream's copies: with asynchronous compute the
                // segments' inputs are queued writes too (covered by
                // `async_compute_overlaps_preparation_without_races`).
                .with_async_compute(false),
        );
        r.engine.start(id).unwrap();
        let mut pool = None;
        for step in 0..4 {
            let before = r.sim.stats();
            let out = r.engine.execute(id, &unet(&r.w)).unwrap();
            let after = r.sim.stats();
            let tag = format!("async {async_on} step {step}");
            assert!(out.segmented, "{tag}: not segmented under {budget}");
            assert_eq!(
                out.output, whole.output,
                "{tag}: differs from the whole graph"
            );
            let prefetched = out.segments.iter().filter(|s| s.prefetched).count();
            assert!(prefetched > 0, "{tag}: nothing prefetched");
            let overlapped = out.segments.iter().filter(|s| s.overlapped).count();
            println!(
                "{tag}: {prefetched} of {} segments prefetched, {overlapped} prepared while the one before computed; {:?}",
                out.segments.len(),
                out.timing
            );
            let queued = after.queued_host_to_device_copies - before.queued_host_to_device_copies;
            if async_on {
                assert!(queued > 0, "{tag}: no upload was queued");
            } else {
                assert_eq!(queued, 0, "{tag}: uploads queued with async uploads off");
            }
            // Every queued copy took effect within the step, and is counted as streamed.
            assert_eq!(
                out.weight_upload_bytes + inputs,
                after.host_to_device_bytes - before.host_to_device_bytes,
                "{tag}"
            );
            assert_eq!(after.faults, 0, "{tag}: device faults");
            let size = r.engine.manager().staging_pool_bytes(r.gpu).map(|p| p.0);
            assert!(size.is_some(), "{tag}: no staging pool");
            match pool {
                None => pool = size,
                Some(_) => assert_eq!(size, pool, "{tag}: the pool changed size"),
            }
            allocs
                .entry(async_on)
                .or_default()
                .push(after.allocations - before.allocations);
        }
        assert!(
            r.sim.peak_bytes() <= budget,
            "async {async_on}: peak {} > budget {budget}",
            r.sim.peak_bytes()
        );
        r.engine.end(id).unwrap();
    }
    println!("device allocations per step: {allocs:?}");
    assert_eq!(
        allocs[&true][1..],
        allocs[&false][1..],
        "queued uploads allocate no device memory of their own"
    );
}

/// Asynchronous compute (`StreamingOptions::async_compute`): each segment is queued and the
/// next one prepared on the host while it runs. On a device with queued work whose
/// graphs stay in flight until the host waits for them (the simulated device counts every
/// access that would race with one), a UNet streamed at budgets from a half to a tenth of
/// its weights (copy stream and transfer threads) equals the whole graph bit for bit every
/// step with no fault and within the budget, as the same run without it does; the
/// segments after the first are prepared under the compute of the one before. With two or
/// three segments in flight (`StreamingOptions::segments_in_flight`), segments are queued
/// behind the one still computing, their inputs written in the device's queue: same bits,
/// no fault, the same bytes streamed (prefetches that need an eviction wait for the
/// segments in flight: `StreamingOptions::evict_in_flight` off). With it on (the default):
/// same bits, no fault, within the budget, and prefetches that evict under segments in
/// flight.
#[test]
fn async_compute_overlaps_preparation_without_races() {
    let (whole, _) = run("ACOMP_REF", unet, None, SegmentationPolicy::Never, false);
    let (seg, _) = run("ACOMP_PROBE", unet, None, SegmentationPolicy::Always, false);
    let weights = weight_bytes(&rig("ACOMP_W", false), "unet.");
    let footprint = seg.segments.iter().map(|s| s.footprint()).max().unwrap();
    let mut evicted_in_flight = 0;
    for (fraction, copy_stream) in [(2, true), (2, false), (4, true), (10, true), (10, false)] {
        let budget = weights / fraction + footprint + 8192;
        let mut uploads = Vec::new();
        let mut evicting = Vec::new();
        // (async compute, segments in flight, prefetches evicting in flight)
        for (async_compute, depth, evict) in [
            (true, 1, false),
            (true, 2, false),
            (true, 3, false),
            (false, 1, false),
            (true, 2, true),
            (true, 3, true),
        ] {
            let tag = format!(
                "1/{fraction} copy stream {copy_stream} async {async_compute} in flight {depth} evict {evict}"
            );
            let mut r = rig_with(
                &format!("ACOMP_{fraction}_{copy_stream}_{async_compute}_{depth}_{evict}"),
                true,
                SimOptions {
                    async_transfers: true,
                    ..SimOptions::default()
                },
            );
            r.engine.manager_mut().set_async_uploads(copy_stream);
            let id = r.engine.create_session(
                SessionConfig::new("test", r.backend.clone(), r.gpu)
                    .with_budget(Some(budget))
                    .with_prefetch(true)
                    .with_async_compute(async_compute)
                    .with_segments_in_flight(depth)
                    .with_evict_in_flight(evict),
            );
            r.engine.start(id).unwrap();
            let mut streamed = 0;
            for step in 0..3 {
                let out = r.engine.execute(id, &unet(&r.w)).unwrap();
                let tag = format!("{tag} step {step}");
                assert!(out.segmented, "{tag}: not segmented");
                assert_eq!(
                    out.output, whole.output,
                    "{tag}: differs from the whole graph"
                );
                assert_eq!(r.sim.stats().faults, 0, "{tag}: device faults");
                let overlapped = out.segments.iter().filter(|s| s.overlapped).count();
                let behind = out.segments.iter().filter(|s| s.queued_behind > 0).count();
                if async_compute {
                    assert!(overlapped > 0, "{tag}: no segment prepared under another");
                } else {
                    assert_eq!(overlapped, 0, "{tag}");
                }
                let evicting: usize = out.segments.iter().map(|s| s.evicting_prefetches).sum();
                if !evict {
                    assert_eq!(
                        evicting, 0,
                        "{tag}: a prefetch evicted under segments in flight"
                    );
                }
                evicted_in_flight += evicting;
                if step == 2 {
                    println!("{tag}: {overlapped} prepared under another, {behind} queued behind another, {evicting} prefetches evicting under them, of {}", out.segments.len());
                }
                if depth > 1 {
                    // Queued behind the segment in flight, inputs written in the queue.
                    assert!(behind > 0, "{tag}: no segment queued behind another");
                } else {
                    assert_eq!(behind, 0, "{tag}");
                }
                streamed = out.weight_upload_bytes;
            }
            assert!(
                r.sim.peak_bytes() <= budget,
                "{tag}: peak {} > budget {budget}",
                r.sim.peak_bytes()
            );
            if evict {
                evicting.push(streamed);
            } else {
                uploads.push(streamed);
            }
            r.engine.end(id).unwrap();
        }
        println!("1/{fraction}, copy stream {copy_stream}: bytes streamed a step (async 1, 2, 3 in flight, sync): {uploads:?}; evicting in flight (2, 3): {evicting:?}");
        // The segments in flight change no eviction: what needs room waits for them.
        assert!(
            uploads.iter().all(|u| *u == uploads[0]),
            "1/{fraction}: streamed bytes differ: {uploads:?}"
        );
    }
    assert!(
        evicted_in_flight > 0,
        "no prefetch evicted under segments in flight"
    );
}

/// A transformer stack streamed layer by layer with the staging pool: the next layer's
/// weights are prefetched into the pool while a layer computes, even when the budget
/// outside the pool holds only what a segment itself needs (a prefetch into the pool takes
/// nothing from it; it used to be refused for the current segment's outputs counted again,
/// so big DiTs streamed with no overlap at all). Same bits, within the budget.
#[test]
fn pooled_prefetch_needs_only_pool_room() {
    let (whole, _) = run(
        "PPF_REF",
        transformer,
        None,
        SegmentationPolicy::Never,
        false,
    );
    let (seg, _) = run(
        "PPF_PROBE",
        transformer,
        None,
        SegmentationPolicy::Always,
        false,
    );
    let weights = weight_bytes(&rig("PPF_W", false), "tf.");
    let footprint = seg.segments.iter().map(|s| s.footprint()).max().unwrap();
    // Room for about two layers' weights in the pool, besides a segment's own needs.
    let budget = footprint + 2 * weights / LAYERS as u64 + 4096;
    let mut r = rig("PPF", true);
    let id = r.engine.create_session(
        SessionConfig::new("test", r.backend.clone(), r.gpu)
            .with_budget(Some(budget))
            .with_segmentation(SegmentationPolicy::Always)
            .with_prefetch(true)
            .with_staging_pool(true),
    );
    r.engine.start(id).unwrap();
    let mut last = None;
    for step in 0..3 {
        let out = r.engine.execute(id, &transformer(&r.w)).unwrap();
        assert_eq!(out.output, whole.output, "step {step} differs");
        last = Some(out);
    }
    let last = last.unwrap();
    let prefetched = last.segments.iter().filter(|s| s.prefetched).count();
    let peak = r.sim.peak_bytes();
    println!(
        "weights {weights} B, budget {budget} B, pool {:?}, {} segments, {prefetched} prefetched, peak {peak} B",
        r.engine.manager().staging_pool_bytes(r.gpu),
        last.segments.len()
    );
    assert!(r.engine.manager().staging_pool_bytes(r.gpu).is_some());
    assert!(peak <= budget, "peak {peak} > budget {budget}");
    // The layers after the first are prefetched while the one before computes (the first
    // layer and the weightless final segment have nothing before them or nothing to fetch;
    // one layer may find the pool too fragmented). Before the fix: 1 of 7.
    assert!(
        prefetched + 3 >= last.segments.len(),
        "{prefetched} of {} segments prefetched",
        last.segments.len()
    );
    r.engine.end(id).unwrap();
}

/// A device whose allocator rounds every buffer up to a unit (as `cudaMalloc` rounds to
/// 2 MiB pages): once the runtime measurement has found and recorded the unit, streamed
/// steps (prefetch, with and without the staging pool) stay within the budget in the
/// device's own rounded bytes, with the whole graph's bits. Counting exact sizes, as before,
/// the same runs go over it.
#[test]
fn buffers_count_at_the_allocation_granularity_of_the_device() {
    const G: usize = 16 << 10;
    let (whole, _) = run(
        "GRAN_REF",
        transformer,
        None,
        SegmentationPolicy::Never,
        false,
    );
    let rounding = |name: &str| {
        rig_with(
            name,
            true,
            SimOptions {
                allocation_granularity: G,
                ..SimOptions::default()
            },
        )
    };
    let mut r = rounding("GRAN_WHOLE");
    let id = r.session(None, SegmentationPolicy::Never, false);
    r.engine.execute(id, &transformer(&r.w)).unwrap();
    let whole_peak = r.sim.peak_bytes();
    r.engine.end(id).unwrap();
    let budget = whole_peak * 3 / 5;
    let mut over_when_exact = Vec::new();
    for recorded in [true, false] {
        for pool in [false, true] {
            let tag = format!("GRAN_{recorded}_{pool}");
            let mut r = rounding(&tag);
            if recorded {
                let reserve = sd_exec::reserve::measure_runtime_reserve(&r.backend)
                    .unwrap()
                    .unwrap();
                assert_eq!(reserve.granularity, G as u64, "{tag}: measured unit");
                r.sim.reset_peak();
            }
            let id = r.engine.create_session(
                SessionConfig::new("test", r.backend.clone(), r.gpu)
                    .with_budget(Some(budget))
                    .with_prefetch(true)
                    .with_staging_pool(pool),
            );
            r.engine.start(id).unwrap();
            for step in 0..3 {
                let out = r.engine.execute(id, &transformer(&r.w)).unwrap();
                assert!(out.segmented, "{tag}: not segmented under {budget}");
                assert_eq!(out.output, whole.output, "{tag}: step {step} differs");
            }
            let peak = r.sim.peak_bytes();
            println!("{tag}: whole {whole_peak} B, budget {budget} B, peak {peak} B");
            if recorded {
                assert!(peak <= budget, "{tag}: peak {peak} > budget {budget}");
            } else {
                over_when_exact.push(peak > budget);
            }
            r.engine.end(id).unwrap();
        }
    }
    assert!(
        over_when_exact.iter().any(|o| *o),
        "exact-size accounting stayed inside the budget: the test shows nothing"
    );
}

/// The UNet-like graph with its input `x` drawn from `seed`.
fn unet_with_x(w: &HashMap<String, GTensor>, seed: u64) -> ComputeTask {
    let mut task = unet(w);
    task.inputs[0].1 = bytes_of(&rnd(8 * 8 * 4, seed));
    task
}

/// The whole UNet-like graph's output for each seed's input, each from a fresh session
/// (built once, never reused); checks that the inputs change the output.
fn fresh_whole_outputs(tag: &str, seeds: &[u64]) -> Vec<Vec<u8>> {
    let mut fresh = rig(tag, false);
    let want: Vec<Vec<u8>> = seeds
        .iter()
        .map(|&s| {
            let id = fresh.session(None, SegmentationPolicy::Never, false);
            let out = fresh.engine.execute(id, &unet_with_x(&fresh.w, s)).unwrap();
            assert!(!out.segments[0].graph_reused);
            fresh.engine.end(id).unwrap();
            out.output
        })
        .collect();
    assert_ne!(want[0], want[1], "the inputs change the output");
    want
}

/// A graph run whole (resident weights) and run again, step after step of a sampling loop
/// with new inputs each time: from the second run on the engine runs the ggml graph it
/// kept (nothing built, no device allocation or free inside the step), and every output is
/// the bits a fresh session computes for the same inputs. Another graph in between, or the
/// workspace reclaimed, makes it build again (and still right).
#[test]
fn a_whole_graph_run_again_reuses_its_graph_and_allocates_nothing() {
    let with_x = unet_with_x;
    let seeds = [7u64, 11, 13, 7];
    let want = fresh_whole_outputs("REUSE_REF", &seeds);

    let mut r = rig("REUSE", false);
    let id = r.session(None, SegmentationPolicy::Never, false);
    for (i, &s) in seeds.iter().enumerate() {
        let before = r.sim.stats();
        let out = r.engine.execute(id, &with_x(&r.w, s)).unwrap();
        let after = r.sim.stats();
        assert_eq!(out.output, want[i], "run {i} (seed {s})");
        assert_eq!(out.segments.len(), 1);
        assert_eq!(out.segments[0].graph_reused, i > 0, "run {i}");
        if i > 0 {
            assert_eq!(
                (
                    after.allocations - before.allocations,
                    after.frees - before.frees
                ),
                (0, 0),
                "run {i}: device allocations/frees inside a step"
            );
            assert_eq!(out.timing.build, std::time::Duration::ZERO);
        }
    }
    // Another graph in the same session's workspace: the UNet's kept graph is gone.
    let tf = r.engine.execute(id, &transformer(&r.w)).unwrap();
    assert!(!tf.segments[0].graph_reused);
    let out = r.engine.execute(id, &with_x(&r.w, 11)).unwrap();
    assert!(
        !out.segments[0].graph_reused,
        "built again after another graph"
    );
    assert_eq!(out.output, want[1]);
    let out = r.engine.execute(id, &with_x(&r.w, 13)).unwrap();
    assert!(out.segments[0].graph_reused);
    assert_eq!(out.output, want[2]);
    // The weights leave the device and come back elsewhere (a buffer holds their old
    // place meanwhile): the kept graph runs again, the views of them pointed at their new
    // place (the output is still the fresh session's).
    let weights: Vec<GTensor> = r.w.values().cloned().collect();
    let ids: Vec<_> = weights
        .iter()
        .filter_map(|t| r.engine.manager().resolve_param(t.id()))
        .collect();
    // Where the device puts the restaged weights depends on its free list (the host's
    // allocator): block the freed place with buffers as large as all the weights and as
    // each of them until a restaging lands elsewhere (each run in between, weights in
    // place, reuses the graph too).
    let bytes: usize = weights.iter().map(|t| t.nbytes()).sum();
    let mut blockers = Vec::new();
    let mut moved = false;
    for _ in 0..16 {
        let before: Vec<usize> = weights.iter().map(|t| t.data_addr()).collect();
        r.engine
            .manager_mut()
            .release_compute_backend_params(&ids)
            .unwrap();
        blockers.push(r.backend.buffer_type().alloc(bytes).unwrap());
        for t in &weights {
            blockers.push(r.backend.buffer_type().alloc(t.nbytes()).unwrap());
        }
        let out = r.engine.execute(id, &with_x(&r.w, 7)).unwrap();
        assert_eq!(out.output, want[0]);
        moved = weights
            .iter()
            .zip(&before)
            .any(|(t, a)| t.is_allocated() && t.data_addr() != *a);
        assert!(out.segments[0].graph_reused, "moved: {moved}");
        if moved {
            break;
        }
    }
    assert!(moved, "no weight moved: the check above tests nothing");
    drop(blockers);
    r.engine.end(id).unwrap();
    assert_eq!(r.sim.stats().live_buffers, 0, "nothing left on the device");
}

/// Prefetching several segments ahead (the default depth: as far as the budget has room),
/// against only the next segment (depth 1), on a device with transfer threads and on one
/// with a copy stream, over steps of a UNet sampling loop under a budget of about 60% of
/// its weights: more than one later segment's weights are in flight at once (depth 1:
/// never more than one), every step's output is the whole graph's bit for bit, the device
/// peak stays within the budget, and the weights streamed per step are the bytes the
/// device received (no copy lost or doubled by the deeper queue). With the run's resident
/// set (the default) a deep queue streams no more per step than without it, where it
/// evicts the weights the next step needs first; and without a staging pool (each staged
/// group a buffer of its own) the deep queue never takes the room a segment needs.
#[test]
fn prefetch_runs_several_segments_ahead_within_budget_and_equals_whole() {
    let (whole, _) = run("DEEP_REF", unet, None, SegmentationPolicy::Never, false);
    let (seg, _) = run("DEEP_PROBE", unet, None, SegmentationPolicy::Always, false);
    let weights = weight_bytes(&rig("DEEP_W", false), "unet.");
    let footprint = seg.segments.iter().map(|s| s.footprint()).max().unwrap();
    let budget = weights * 3 / 5 + footprint + 8192;
    let inputs = (8 * 8 * 4 + C) as u64 * 4;
    // (depth, staging pool, resident set)
    let cases = [
        (Some(1), true, true),
        (None, true, true),
        (None, true, false),
        (None, false, true),
    ];
    for async_on in [false, true] {
        let mut ahead = HashMap::new();
        let mut streamed = HashMap::new();
        for case @ (depth, pool, resident) in cases {
            let tag = format!("async {async_on} depth {depth:?} pool {pool} resident {resident}");
            let mut r = rig_with(
                &format!("DEEP_{async_on}_{depth:?}_{pool}_{resident}"),
                true,
                SimOptions {
                    async_transfers: async_on,
                    ..SimOptions::default()
                },
            );
            r.engine.manager_mut().set_async_uploads(async_on);
            assert_eq!(r.engine.manager_mut().uploads_async(r.gpu), async_on);
            // (A streaming window of two segments: a wider one leaves the resident set
            // less of this small pool than the least recently used weights keep.)
            let mut config = SessionConfig::new("test", r.backend.clone(), r.gpu)
                .with_budget(Some(budget))
                .with_segmentation(SegmentationPolicy::Always)
                .with_prefetch(true)
                .with_staging_pool(pool)
                .with_resident_set(resident)
                .with_stream_window(2);
            if let Some(d) = depth {
                config = config.with_prefetch_depth(d);
            }
            let id = r.engine.create_session(config);
            r.engine.start(id).unwrap();
            let mut h2d = Vec::new();
            let mut most = 0;
            for step in 0..4 {
                let before = r.sim.stats();
                let out = r.engine.execute(id, &unet(&r.w)).unwrap();
                let after = r.sim.stats();
                assert!(out.segmented, "{tag}: not segmented");
                assert_eq!(out.output, whole.output, "{tag} step {step}: differs");
                assert_eq!(after.faults, 0, "{tag}: device faults");
                assert_eq!(
                    out.weight_upload_bytes + inputs,
                    after.host_to_device_bytes - before.host_to_device_bytes,
                    "{tag} step {step}"
                );
                h2d.push(out.weight_upload_bytes);
                let m = out.segments.iter().map(|s| s.prefetches_ahead).max();
                most = most.max(m.unwrap_or(0));
            }
            let peak = r.sim.peak_bytes();
            println!(
                "{tag}: weights {weights} B, budget {budget} B, peak {peak} B; \
                 streamed per step {h2d:?}; most segments in flight {most}"
            );
            assert!(peak <= budget, "{tag}: peak {peak} > budget {budget}");
            assert!(h2d[1..].iter().all(|h| *h > 0), "{tag}: nothing streamed");
            ahead.insert(case, most);
            streamed.insert(case, h2d[3]);
            r.engine.end(id).unwrap();
        }
        assert_eq!(ahead[&cases[0]], 1, "async {async_on}: depth 1 {ahead:?}");
        assert!(
            ahead[&cases[1]] >= 2,
            "async {async_on}: never more than one segment ahead {ahead:?}"
        );
        assert!(
            streamed[&cases[1]] <= streamed[&cases[2]],
            "async {async_on}: the resident set streams more {streamed:?}"
        );
    }
}

/// A segmented run under a budget of about half the weights (staging pool, prefetch),
/// step after step with new inputs: from the third step on every segment runs the ggml
/// graph it kept (nothing built: the first step grows the workspace, the second builds
/// again the graphs whose memory that growth took), its outputs computed into the cut-cache
/// entries the next segments' kept graphs read, and every output is the bits the whole
/// graph computes for the same inputs, within the budget, with one and two segments in
/// flight. With graph reuse off nothing is reused and the outputs are the same.
#[test]
fn segment_graphs_are_kept_from_step_to_step() {
    let with_x = unet_with_x;
    let seeds = [7u64, 11, 13, 17, 7, 19];
    let want = fresh_whole_outputs("KEEP_REF", &seeds);
    let (seg, _) = run("KEEP_PROBE", unet, None, SegmentationPolicy::Always, false);
    let weights = weight_bytes(&rig("KEEP_W", false), "unet.");
    let footprint = seg.segments.iter().map(|s| s.footprint()).max().unwrap();
    let budget = weights / 2 + footprint + 8192;
    for (reuse, depth) in [(true, 1), (true, 2), (false, 2)] {
        let mut r = rig(&format!("KEEP_{reuse}_{depth}"), true);
        let id = r.engine.create_session(
            SessionConfig::new("test", r.backend.clone(), r.gpu)
                .with_budget(Some(budget))
                .with_prefetch(true)
                .with_graph_reuse(reuse)
                .with_segments_in_flight(depth),
        );
        r.engine.start(id).unwrap();
        for (i, &s) in seeds.iter().enumerate() {
            let tag = format!("reuse {reuse}, {depth} in flight, step {i}");
            let out = r.engine.execute(id, &with_x(&r.w, s)).unwrap();
            assert!(out.segmented, "{tag}: not segmented under {budget}");
            assert!(
                out.segments.len() > 2,
                "{tag}: {} segments",
                out.segments.len()
            );
            assert_eq!(out.output, want[i], "{tag}: differs from the whole graph");
            let reused = out.segments.iter().filter(|s| s.graph_reused).count();
            println!(
                "{tag}: {reused} of {} segments reused, build {:?}",
                out.segments.len(),
                out.timing.build
            );
            if !reuse || i == 0 {
                assert_eq!(reused, 0, "{tag}");
            } else if i >= 2 {
                assert_eq!(reused, out.segments.len(), "{tag}");
                assert_eq!(out.timing.build, std::time::Duration::ZERO, "{tag}");
            }
        }
        assert!(
            r.sim.peak_bytes() <= budget,
            "peak {} > budget {budget}",
            r.sim.peak_bytes()
        );
        r.engine.end(id).unwrap();
    }
}

/// Stable placement (`ModelManager::set_stable_placement`, `StreamingOptions::stable_cuts`):
/// streamed through a staging pool at a quarter and a half of its weights, a UNet's weights
/// go back to the pool offsets and its cuts to the cut-cache buffers they had the step
/// before, so that from the fourth step on (with pool-sized segments at half the weights the
/// resident set settles a step after the plan's first re-plan: 53.6 instead of 55.9 kB
/// streamed from the third step) every segment's kept graph runs with every node
/// and source where it was the step before (what ggml's CUDA backend needs to replay its
/// captured CUDA graph) and nothing is allocated on the device inside a step; every output
/// is the whole graph's bits, within the budget. Off, cuts move from step to step.
#[test]
fn stable_placement_keeps_segment_graphs_at_their_addresses() {
    let with_x = unet_with_x;
    let seeds = [7u64, 11, 13, 17, 19, 23, 29];
    let want = fresh_whole_outputs("STABLE_REF", &seeds);
    let (seg, _) = run(
        "STABLE_PROBE",
        unet,
        None,
        SegmentationPolicy::Always,
        false,
    );
    let weights = weight_bytes(&rig("STABLE_W", false), "unet.");
    let footprint = seg.segments.iter().map(|s| s.footprint()).max().unwrap();
    let mut moved_without = 0;
    for (fraction, stable) in [(4, true), (2, true), (4, false), (2, false)] {
        let budget = weights / fraction + footprint + 8192;
        let mut r = rig(&format!("STABLE_{fraction}_{stable}"), true);
        r.engine.manager_mut().set_stable_placement(stable);
        let id = r.engine.create_session(
            SessionConfig::new("test", r.backend.clone(), r.gpu)
                .with_budget(Some(budget))
                .with_prefetch(true)
                .with_staging_pool(true)
                .with_streaming(StreamingOptions {
                    stable_cuts: stable,
                    ..StreamingOptions::default()
                }),
        );
        r.engine.start(id).unwrap();
        for (i, &s) in seeds.iter().enumerate() {
            let tag = format!("1/{fraction} of the weights, stable {stable}, step {i}");
            let before = r.sim.stats();
            let out = r.engine.execute(id, &with_x(&r.w, s)).unwrap();
            let allocations = r.sim.stats().allocations - before.allocations;
            assert!(out.segmented, "{tag}: not segmented under {budget}");
            assert!(
                out.weight_upload_bytes > 0 || i == 0,
                "{tag}: nothing streamed"
            );
            assert_eq!(out.output, want[i], "{tag}: differs from the whole graph");
            let n = out.segments.len();
            let unmoved = out.segments.iter().filter(|s| s.graph_unmoved).count();
            println!(
                "{tag}: {unmoved} of {n} segment graphs unmoved ({} reused), {} bytes streamed, {allocations} device allocations",
                out.segments.iter().filter(|s| s.graph_reused).count(),
                out.weight_upload_bytes
            );
            assert!(unmoved <= out.segments.iter().filter(|s| s.graph_reused).count());
            if i == 0 {
                assert_eq!(unmoved, 0, "{tag}");
            } else if stable && i >= 3 {
                assert_eq!(unmoved, n, "{tag}");
                assert_eq!(allocations, 0, "{tag}: device allocations inside a step");
            }
            if !stable && i >= 3 {
                moved_without += n - unmoved;
            }
        }
        assert!(
            r.sim.peak_bytes() <= budget,
            "peak {} > budget {budget}",
            r.sim.peak_bytes()
        );
        r.engine.end(id).unwrap();
    }
    assert!(
        moved_without > 0,
        "first fit never moved a segment's graph: the test shows nothing"
    );
}

/// A resident set weighed by the compute before each segment
/// (`StreamingOptions::compute_aware_residency`): step after step of a sampling loop at
/// 7/16 and half of a small UNet's weights, the whole graph's bits, within the budget,
/// part of the weights kept on the device (less than every weight streamed a steady step).
#[test]
fn compute_aware_residency_keeps_the_budget_and_the_bits() {
    let seeds = [7u64, 11, 13, 17];
    let want = fresh_whole_outputs("AWARE_REF", &seeds);
    let (seg, _) = run("AWARE_PROBE", unet, None, SegmentationPolicy::Always, false);
    let weights = weight_bytes(&rig("AWARE_W", false), "unet.");
    let footprint = seg.segments.iter().map(|s| s.footprint()).max().unwrap();
    for sixteenths in [7, 8] {
        let budget = weights * sixteenths / 16 + footprint + 8192;
        let mut r = rig(&format!("AWARE_{sixteenths}"), true);
        let id = r.engine.create_session(
            SessionConfig::new("test", r.backend.clone(), r.gpu)
                .with_budget(Some(budget))
                .with_prefetch(true)
                .with_staging_pool(true)
                .with_compute_aware_residency(true),
        );
        r.engine.start(id).unwrap();
        for (i, &s) in seeds.iter().enumerate() {
            let tag = format!("{sixteenths}/16 of the weights, step {i}");
            let out = r.engine.execute(id, &unet_with_x(&r.w, s)).unwrap();
            assert!(out.segmented, "{tag}: not segmented under {budget}");
            assert_eq!(out.output, want[i], "{tag}: differs from the whole graph");
            println!(
                "{tag}: {} bytes streamed of {weights}",
                out.weight_upload_bytes
            );
            if i > 0 {
                assert!(out.weight_upload_bytes > 0, "{tag}: nothing streamed");
                assert!(
                    out.weight_upload_bytes < weights,
                    "{tag}: every weight streamed ({} bytes)",
                    out.weight_upload_bytes
                );
            }
        }
        assert!(
            r.sim.peak_bytes() <= budget,
            "peak {} > budget {budget}",
            r.sim.peak_bytes()
        );
        r.engine.end(id).unwrap();
    }
}

/// `StreamingOptions::timeline` and the manager's upload log, under a budget of about half
/// the weights with segments queued without waiting: every segment's report says when it
/// was prepared, launched, returned and done on the device (prepared, launched and returned
/// in that order, done after the launch), the devices' ends in segment order; the transfer threads' jobs say when they were queued, started
/// and finished, and copied no more than the manager counted. Off, queued segments have
/// no device end. The output stays the whole graph's.
#[test]
fn a_step_timeline_orders_each_segments_work() {
    let (whole, _) = run("TL_REF", unet, None, SegmentationPolicy::Never, false);
    let (seg, _) = run("TL_PROBE", unet, None, SegmentationPolicy::Always, false);
    let weights = weight_bytes(&rig("TL_W", false), "unet.");
    let footprint = seg.segments.iter().map(|s| s.footprint()).max().unwrap();
    let budget = weights / 2 + footprint + 8192;
    for timeline in [true, false] {
        let tag = format!("timeline {timeline}");
        let mut r = rig_with(
            &format!("TL_{timeline}"),
            true,
            SimOptions {
                async_transfers: true,
                ..SimOptions::default()
            },
        );
        r.engine.manager_mut().set_upload_log(timeline);
        let id = r.engine.create_session(
            SessionConfig::new("test", r.backend.clone(), r.gpu)
                .with_budget(Some(budget))
                .with_prefetch(true)
                .with_streaming(StreamingOptions {
                    timeline,
                    ..StreamingOptions::default()
                }),
        );
        r.engine.start(id).unwrap();
        for step in 0..3 {
            let uploaded = r.engine.manager().upload_bytes();
            let out = r.engine.execute(id, &unet(&r.w)).unwrap();
            let uploaded = r.engine.manager().upload_bytes() - uploaded;
            let tag = format!("{tag} step {step}");
            assert!(out.segmented, "{tag}: not segmented");
            assert_eq!(out.output, whole.output, "{tag}: differs from whole");
            let queued = out.segments.iter().filter(|s| s.queued_behind > 0).count();
            assert!(queued > 0, "{tag}: nothing queued behind a segment");
            let mut last_done = None;
            for s in &out.segments {
                let t = s.times;
                assert!(t.prepared <= t.launched, "{tag}: segment {}", s.index);
                assert!(t.launched <= t.returned, "{tag}: segment {}", s.index);
                match t.done {
                    Some(done) => {
                        // (A device may finish before the host's call returns: the
                        // simulated one computes inside it.)
                        assert!(t.launched <= done, "{tag}: segment {}", s.index);
                        assert!(last_done <= Some(done), "{tag}: segment {}", s.index);
                        last_done = Some(done);
                    }
                    None => assert!(!timeline, "{tag}: segment {} not seen done", s.index),
                }
            }
            if !timeline {
                assert!(
                    out.segments.iter().any(|s| s.times.done.is_none()),
                    "{tag}: a queued segment's end is known without the watcher"
                );
            }
            let spans = r.engine.manager_mut().take_upload_spans();
            let copied: u64 = spans.iter().map(|u| u.bytes).sum();
            assert!(
                copied <= uploaded,
                "{tag}: {copied} logged, {uploaded} counted"
            );
            if timeline && step > 0 {
                assert!(!spans.is_empty(), "{tag}: no transfer job logged");
            }
            for u in &spans {
                assert!(
                    u.queued <= u.started && u.started <= u.finished,
                    "{tag}: {u:?}"
                );
            }
        }
        r.engine.end(id).unwrap();
    }
}

/// A task run again (a sampling loop that keeps its step's graph and feeds it new inputs)
/// keeps its plan: from the second execution on nothing is captured or planned
/// (`ComputeResult::plan_kept`), the new inputs are read, and each step equals a task built
/// afresh with them, bit for bit, within a budget that segments it. A task built afresh
/// (the same structure in a new graph) and a graph changed since its last run are planned
/// again.
#[test]
fn a_task_run_again_keeps_its_plan_and_reads_its_new_inputs() {
    let feed = |task: &mut ComputeTask, seed: u64| {
        task.inputs[0].1 = bytes_of(&rnd(8 * 8 * 4, seed));
        task.inputs[1].1 = bytes_of(&rnd(C, seed + 1));
    };
    let seeds = [7u64, 20, 30];
    let mut r = rig("KEPT_REF", false);
    let id = r.session(None, SegmentationPolicy::Never, false);
    let refs: Vec<Vec<u8>> = seeds
        .iter()
        .map(|&seed| {
            let mut t = unet(&r.w);
            feed(&mut t, seed);
            r.engine.execute(id, &t).unwrap().output
        })
        .collect();
    r.engine.end(id).unwrap();
    assert_ne!(refs[0], refs[1], "the inputs change the output");
    let (seg, _) = run("KEPT_PROBE", unet, None, SegmentationPolicy::Always, false);
    let weights = weight_bytes(&rig("KEPT_W", false), "unet.");
    let footprint = seg.segments.iter().map(|s| s.footprint()).max().unwrap();
    let budget = weights / 2 + footprint + 8192;

    let mut r = rig("KEPT", true);
    let id = r.session(Some(budget), SegmentationPolicy::Auto, true);
    let mut task = unet(&r.w);
    for round in 0..2 {
        for (step, &seed) in seeds.iter().enumerate() {
            feed(&mut task, seed);
            let out = r.engine.execute(id, &task).unwrap();
            assert!(out.segmented, "not segmented under {budget}");
            assert_eq!(out.plan_kept, round + step > 0, "round {round} step {step}");
            assert_eq!(out.output, refs[step], "round {round} step {step} differs");
        }
    }
    // The same structure built again: a new graph, planned again (from the cached choice).
    let fresh = r.engine.execute(id, &unet(&r.w)).unwrap();
    assert!(!fresh.plan_kept);
    assert_eq!(fresh.output, refs[0]);
    // A graph changed after its run: planned again, and what it computes is read.
    let mut grown = unet(&r.w);
    assert!(!r.engine.execute(id, &grown).unwrap().plan_kept);
    let ctx = grown.graph.context().clone();
    let doubled = ctx.scale(&grown.output, 2.0).unwrap();
    doubled.set_output();
    grown.graph.build_forward_expand(&doubled).unwrap();
    grown.output = doubled;
    let out = r.engine.execute(id, &grown).unwrap();
    assert!(!out.plan_kept, "a changed graph keeps no plan");
    let twice: Vec<u8> = refs[0]
        .chunks(4)
        .flat_map(|b| (f32::from_le_bytes([b[0], b[1], b[2], b[3]]) * 2.0).to_le_bytes())
        .collect();
    assert_eq!(out.output, twice);
    assert!(
        r.sim.peak_bytes() <= budget,
        "peak over the budget {budget}"
    );
    r.engine.end(id).unwrap();
}
