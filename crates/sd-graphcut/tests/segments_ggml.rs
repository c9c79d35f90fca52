//! Segmented execution on the CPU backend: random graphs and a small UNet-shaped block
//! stack (convolutions, group norm, attention, skip connections crossing cuts) computed
//! monolithically and segment by segment give bit-identical results; the UNet plan carries
//! the skip tensors as live cuts with their bytes per segment; the plan cache does not
//! re-plan alternating shapes; the original graph is left untouched.

use std::collections::HashSet;
use std::sync::Arc;

use proptest::prelude::*;
use sd_graphcut::{
    CapturedGraph, CutCache, CutMarks, CutName, GraphPlanner, HostInputs, InputKind, Plan,
    PlanOptions, SegmentGraph, SegmentKind, SegmentRunner,
};
use sd_tensor::ggml::{Backend, Buffer, BufferType, Context, GTensor, Gallocr, Graph, TensorId};
use sd_tensor::DType;
use sd_testutil::{f32_bytes, rnd};

/// A built graph with its marks, weights and inputs.
struct Net {
    _ctx: Context,
    _data: Buffer,
    graph: Graph,
    marks: CutMarks,
    params: HashSet<TensorId>,
    /// Unallocated external inputs and their host bytes.
    host: Vec<(GTensor, Vec<u8>)>,
}

impl Net {
    fn capture(&self) -> CapturedGraph {
        CapturedGraph::capture(&self.graph, &self.marks, &self.params).unwrap()
    }
}

/// Leaves with data: created in `data_ctx`, allocated together, filled with random values.
struct Leaves {
    ctx: Context,
    list: Vec<(GTensor, bool)>,
}

impl Leaves {
    fn new() -> Leaves {
        Leaves {
            ctx: Context::new_descriptors(64, 1, 0).unwrap(),
            list: Vec::new(),
        }
    }
    fn add(&mut self, name: &str, ne: &[usize], is_param: bool) -> GTensor {
        let t = self.ctx.new_tensor(DType::F32, ne).unwrap();
        t.set_name(name);
        self.list.push((t.clone(), is_param));
        t
    }
    fn allocate(self, seed: u64) -> (Context, Buffer, HashSet<TensorId>) {
        let buf = BufferType::cpu().alloc_context_tensors(&self.ctx).unwrap();
        let mut params = HashSet::new();
        for (i, (t, p)) in self.list.iter().enumerate() {
            let v: Vec<f32> = rnd(t.nelements(), seed + i as u64)
                .iter()
                .map(|x| x * 0.5)
                .collect();
            t.write_f32(&v).unwrap();
            if *p {
                params.insert(t.id());
            }
        }
        (self.ctx, buf, params)
    }
}

// ---------------------------------------------------------------------------------------
// The UNet-shaped block stack.

struct UnetOpts {
    batch: usize,
}

fn unet(o: &UnetOpts) -> Net {
    let n = o.batch;
    let mut lv = Leaves::new();
    let t_in = lv.add("t_in", &[8, n], false);
    let k_in = lv.add("k_in", &[3, 3, 4, 8], true);
    let b_in = lv.add("b_in", &[1, 1, 8, 1], true);
    let k_res: Vec<GTensor> = (0..4)
        .map(|i| lv.add(&format!("k_res{i}"), &[3, 3, 8, 8], true))
        .collect();
    let k_down = lv.add("k_down", &[3, 3, 8, 8], true);
    let wq = lv.add("wq", &[8, 8], true);
    let wk = lv.add("wk", &[8, 8], true);
    let wv = lv.add("wv", &[8, 8], true);
    let wo = lv.add("wo", &[8, 8], true);
    let wt = lv.add("wt", &[8, 8], true);
    let k_up1 = lv.add("k_up1", &[3, 3, 16, 8], true);
    let k_up0 = lv.add("k_up0", &[3, 3, 16, 8], true);
    let k_out = lv.add("k_out", &[3, 3, 8, 4], true);
    let (_wctx, data, params) = lv.allocate(100);

    let ctx = Context::new_descriptors(512, 512, 1).unwrap();
    let x = ctx.new_tensor(DType::F32, &[8, 8, 4, n]).unwrap();
    x.set_name("x");
    let mut marks = CutMarks::new();

    // Timestep embedding: shared by every res block, not cut (recomputed per segment).
    let temb = ctx.silu(&ctx.mul_mat(&wt, &t_in).unwrap()).unwrap();
    temb.set_name("temb");
    let temb4 = ctx.reshape(&temb, &[1, 1, 8, n]).unwrap();

    let conv = |k: &GTensor, h: &GTensor, stride: usize| {
        ctx.conv_2d(k, h, (stride, stride), (1, 1), (1, 1), true)
            .unwrap()
    };
    let res = |h: &GTensor, k: &GTensor| {
        let g = ctx.group_norm(h, 2, 1e-5).unwrap();
        let s = ctx.silu(&g).unwrap();
        let c = conv(k, &s, 1);
        let c = ctx.add(&c, &temb4).unwrap();
        ctx.add(h, &c).unwrap()
    };
    let attn = |h: &GTensor| {
        let (w, hh) = (h.ne()[0], h.ne()[1]);
        let t = w * hh;
        let tokens = ctx.reshape(h, &[t, 8, n]).unwrap();
        let xt = ctx.cont(&ctx.transpose(&tokens).unwrap()).unwrap(); // [8, t, n]
        let q = ctx.mul_mat(&wq, &xt).unwrap();
        let k = ctx.mul_mat(&wk, &xt).unwrap();
        let v = ctx.mul_mat(&wv, &xt).unwrap();
        let scale = 1.0 / (8f32).sqrt();
        // Softmax attention.
        let scores = ctx.mul_mat(&k, &q).unwrap(); // [t_kv, t_q, n]
        let probs = ctx.soft_max_ext(&scores, None, scale).unwrap();
        let vt = ctx.cont(&ctx.transpose(&v).unwrap()).unwrap(); // [t, 8, n]
        let out = ctx.mul_mat(&vt, &probs).unwrap(); // [8, t, n]
                                                     // Fused attention with f16 K/V.
        let q4 = ctx.reshape(&q, &[8, t, 1, n]).unwrap();
        let k4 = ctx
            .cast(&ctx.reshape(&k, &[8, t, 1, n]).unwrap(), DType::F16)
            .unwrap();
        let v4 = ctx
            .cast(&ctx.reshape(&v, &[8, t, 1, n]).unwrap(), DType::F16)
            .unwrap();
        let fa = ctx.flash_attn_ext(&q4, &k4, &v4, None, scale).unwrap(); // [8, 1, t, n]
        let fa = ctx.reshape(&fa, &[8, t, n]).unwrap();
        let both = ctx.add(&out, &fa).unwrap();
        let proj = ctx.mul_mat(&wo, &both).unwrap();
        let back = ctx.cont(&ctx.transpose(&proj).unwrap()).unwrap(); // [t, 8, n]
        let back = ctx.reshape(&back, &[w, hh, 8, n]).unwrap();
        ctx.add(h, &back).unwrap()
    };

    let h0 = ctx.add(&conv(&k_in, &x, 1), &b_in).unwrap();
    h0.set_name("h0");
    marks.mark(&h0, "in", "h").unwrap();
    let s0 = res(&h0, &k_res[0]);
    s0.set_name("skip0");
    marks.mark(&s0, "down0", "h").unwrap();
    let s1 = res(&conv(&k_down, &s0, 2), &k_res[1]);
    s1.set_name("skip1");
    marks.mark(&s1, "down1", "h").unwrap();
    let m = attn(&s1);
    m.set_name("mid");
    marks.mark(&m, "mid", "h").unwrap();
    let u1 = res(
        &conv(&k_up1, &ctx.concat(&m, &s1, 2).unwrap(), 1),
        &k_res[2],
    );
    u1.set_name("u1");
    marks.mark(&u1, "up1", "h").unwrap();
    let up = ctx.upscale(&u1, 2).unwrap();
    let u0 = res(
        &conv(&k_up0, &ctx.concat(&up, &s0, 2).unwrap(), 1),
        &k_res[3],
    );
    u0.set_name("u0");
    marks.mark(&u0, "up0", "h").unwrap();
    let out = conv(
        &k_out,
        &ctx.silu(&ctx.group_norm(&u0, 2, 1e-5).unwrap()).unwrap(),
        1,
    );
    out.set_name("out");
    out.set_output();

    let mut graph = Graph::new(&ctx, 512).unwrap();
    graph.build_forward_expand(&out).unwrap();
    let xv = f32_bytes(&rnd(x.nelements(), 7));
    Net {
        _ctx: ctx,
        _data: data,
        graph,
        marks,
        params,
        host: vec![(x, xv)],
    }
}

// ---------------------------------------------------------------------------------------
// Running both ways.

/// Runs the original graph with one allocator; returns the bytes of the plan's graph outputs.
fn run_monolithic(
    backend: &Backend,
    net: &Net,
    cap: &CapturedGraph,
    plan: &Plan,
) -> (Vec<Vec<u8>>, usize) {
    let mut ga = Gallocr::new(backend.buffer_type()).unwrap();
    let size = ga.reserve(&net.graph).unwrap();
    ga.alloc_graph(&net.graph).unwrap();
    for (t, b) in &net.host {
        // Inputs the graph does not use get no memory.
        if t.is_allocated() {
            t.write_bytes(0, b).unwrap();
        }
    }
    backend.compute(&net.graph).unwrap();
    let out = plan
        .graph_outputs()
        .map(|o| cap.node_tensors()[o.node].read_bytes().unwrap())
        .collect();
    (out, size)
}

/// Runs the plan segment by segment; returns the bytes of the graph outputs.
fn run_segmented(backend: &Backend, net: &Net, cap: &CapturedGraph, plan: &Plan) -> Vec<Vec<u8>> {
    let mut inputs = HostInputs::new();
    for (t, b) in &net.host {
        inputs.insert(t, b).unwrap();
    }
    let mut runner = SegmentRunner::new(backend).unwrap();
    let mut cache = CutCache::new(backend.buffer_type());
    let runs = runner.run(cap, plan, &inputs, &mut cache).unwrap();
    assert_eq!(runs.len(), plan.segments.len());
    // The cache ends with the graph outputs only.
    let outs: Vec<&CutName> = plan.graph_outputs().map(|o| &o.name).collect();
    assert!(cache.names().all(|n| outs.contains(&n)), "{cache:?}");
    plan.graph_outputs()
        .map(|o| {
            cache
                .get(&o.name)
                .expect("graph output cached")
                .read_bytes()
                .unwrap()
        })
        .collect()
}

struct Snapshot(Vec<(TensorId, i32, bool, Vec<TensorId>)>);

fn snapshot(cap: &CapturedGraph) -> Snapshot {
    Snapshot(
        cap.node_tensors()
            .iter()
            .chain(cap.leaf_tensors())
            .map(|t| {
                (
                    t.id(),
                    t.flags(),
                    t.is_allocated(),
                    t.srcs().iter().map(|s| s.id()).collect(),
                )
            })
            .collect(),
    )
}

fn plan_for(backend: &Backend, cap: &CapturedGraph) -> Arc<Plan> {
    let mut planner = GraphPlanner::new(backend.buffer_type(), PlanOptions::default(), 4);
    planner.plan(cap).unwrap()
}

fn check_equivalence(backend: &Backend, net: &Net) -> (Arc<Plan>, usize) {
    let cap = net.capture();
    let plan = plan_for(backend, &cap);
    let before = snapshot(&cap);
    let seg = run_segmented(backend, net, &cap, &plan);
    // The original graph is untouched: same descriptors, nothing bound or allocated.
    let after = snapshot(&cap);
    assert_eq!(before.0, after.0, "original graph modified");
    assert_eq!(net.capture().view().fingerprint(), cap.view().fingerprint());
    let (mono, mono_size) = run_monolithic(backend, net, &cap, &plan);
    assert_eq!(seg.len(), mono.len());
    for ((o, s), m) in plan.graph_outputs().zip(&seg).zip(&mono) {
        assert!(
            s == m,
            "graph output {} (node {}) differs between segmented and monolithic runs",
            o.name,
            o.node
        );
    }
    (plan, mono_size)
}

#[test]
fn unet_plan_carries_skips_and_runs_bit_identically() {
    let backend = Backend::cpu(2).unwrap();
    let net = unet(&UnetOpts { batch: 1 });
    let (plan, mono_size) = check_equivalence(&backend, &net);
    let names: Vec<&str> = plan.segments.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(
        names,
        ["in", "down0", "down1", "mid", "up1", "up0", "<final>"]
    );
    assert_eq!(plan.segments[6].kind, SegmentKind::Final);

    let cut = |g: &str| CutName::new(g, "h").unwrap();
    let (s0, s1, small) = (8 * 8 * 8 * 4, 4 * 4 * 8 * 4, 4 * 4 * 8 * 4);
    // Live cuts and their bytes per segment.
    let expect: [(&[&str], usize); 7] = [
        (&["in"], s0),
        (&["in", "down0"], 2 * s0),
        (&["down0", "down1"], s0 + s1),
        (&["down0", "down1", "mid"], s0 + s1 + small),
        (&["down0", "down1", "mid", "up1"], s0 + s1 + 2 * small),
        (&["down0", "up1", "up0"], 2 * s0 + small),
        (&["up0"], s0),
    ];
    for (k, (groups, bytes)) in expect.iter().enumerate() {
        let seg = &plan.segments[k];
        let mut live: Vec<CutName> = groups.iter().map(|g| cut(g)).collect();
        live.sort();
        let mut got = seg.live_cuts.clone();
        got.sort();
        assert_eq!(got, live, "segment {k} '{}'", seg.name);
        assert_eq!(
            seg.bytes.live_cuts, *bytes,
            "segment {k} '{}' live bytes",
            seg.name
        );
        assert!(seg.bytes.compute_buffer > 0);
        assert!(
            seg.bytes.compute_buffer <= mono_size,
            "segment {k}: {} > monolithic {mono_size}",
            seg.bytes.compute_buffer
        );
    }
    // The first skip passes through mid and up1 without being read there.
    for k in [3, 4] {
        assert!(
            plan.segments[k].carried_cuts().any(|c| *c == cut("down0")),
            "segment {k}"
        );
    }
    // The skip is consumed by the segments that need it.
    assert!(plan.segments[5].consumed_cuts.contains(&cut("down0")));
    assert!(plan.segments[4].consumed_cuts.contains(&cut("down1")));
    // The timestep embedding is shared but not cut: recomputed, and the plan says so.
    let cap = net.capture();
    let temb = cap
        .node_tensors()
        .iter()
        .position(|t| t.name() == "temb")
        .unwrap();
    let r = plan
        .recomputations
        .iter()
        .find(|r| r.node == temb)
        .expect("temb recomputed");
    assert_eq!(r.owner, 1);
    assert_eq!(r.also_in, vec![2, 4, 5]);
    // Inputs are typed.
    let seg0 = &plan.segments[0];
    assert!(seg0.inputs_of(InputKind::External).any(|i| i.name == "x"));
    assert_eq!(seg0.params().count(), 2);
    assert!(plan.segments[1]
        .inputs_of(InputKind::External)
        .any(|i| i.name == "t_in"));
    assert!(plan.segments[1]
        .inputs_of(InputKind::PreviousCut)
        .any(|i| i.name == "h0"));
    println!("{}monolithic compute buffer {mono_size} B", plan.summary());
}

#[test]
fn alternating_cfg_shapes_are_planned_once_each() {
    let backend = Backend::cpu(1).unwrap();
    let mut planner = GraphPlanner::new(backend.buffer_type(), PlanOptions::default(), 4);
    let mut fps = Vec::new();
    for i in 0..10 {
        let net = unet(&UnetOpts { batch: 1 + i % 2 });
        let cap = net.capture();
        let plan = planner.plan(&cap).unwrap();
        assert_eq!(plan.fingerprint, cap.view().fingerprint());
        fps.push(plan.fingerprint);
    }
    assert_eq!(planner.stats().misses, 2);
    assert_eq!(planner.stats().hits, 8);
    assert_ne!(fps[0], fps[1]);
    assert_eq!(fps[0], fps[2]);
}

/// A merged segment (two cut groups run as one) keeps the cut between them in its
/// workspace (no later segment reads it, so it is not bound to the cut cache at run time):
/// the plan measures its compute buffer with that cut allocated there, which is more than
/// when every cut output counts as held elsewhere (before, the run outgrew the planned
/// buffer and, under a budget, the budget).
#[test]
fn merged_segments_measure_their_inner_cuts_in_the_workspace() {
    let backend = Backend::cpu(1).unwrap();
    let buft = backend.buffer_type();
    let mut net = unet(&UnetOpts { batch: 1 });
    net.marks = net
        .marks
        .regrouped(|g| match g {
            "mid" | "up1" => "mid+up1".to_string(),
            other => other.to_string(),
        })
        .unwrap();
    let cap = net.capture();
    let plan = plan_for(&backend, &cap);
    let mut inner = 0;
    for (k, s) in plan.segments.iter().enumerate() {
        let g = SegmentGraph::for_measure(&cap, s, k).unwrap();
        let kept = g.measure_kept(buft, |n| s.future_cuts.contains(n)).unwrap();
        assert_eq!(kept, s.bytes.compute_buffer, "segment {k} '{}'", s.name);
        let has_inner = s
            .outputs
            .iter()
            .any(|o| o.is_cut && !o.graph_output && !s.future_cuts.contains(&o.name));
        if has_inner {
            inner += 1;
            let all_external = g.measure(buft).unwrap();
            assert!(
                kept > all_external,
                "segment {k}: {kept} <= {all_external} with its inner cut held elsewhere"
            );
        }
    }
    assert_eq!(
        inner,
        1,
        "{:?}",
        plan.segments.iter().map(|s| &s.name).collect::<Vec<_>>()
    );
    check_equivalence(&backend, &net);
}

#[test]
fn segment_graphs_measure_and_report_missing_bindings() {
    let backend = Backend::cpu(1).unwrap();
    let net = unet(&UnetOpts { batch: 1 });
    let cap = net.capture();
    let plan = plan_for(&backend, &cap);
    // Measuring again gives the planned size.
    for (k, s) in plan.segments.iter().enumerate() {
        let g = SegmentGraph::for_measure(&cap, s, k).unwrap();
        assert_eq!(
            g.measure(backend.buffer_type()).unwrap(),
            s.bytes.compute_buffer
        );
        assert_eq!(g.graph().n_nodes(), s.internal_nodes.len());
    }
    // Running a segment whose previous cuts are not cached is an error naming the cut.
    let cache = CutCache::host();
    let inputs = HostInputs::new();
    let e = SegmentGraph::for_execution(&cap, &plan, 2, &cache, &inputs)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("down0|h") && e.contains("not in the cut cache"),
        "{e}"
    );
    // A missing host input is an error naming it.
    let e = SegmentGraph::for_execution(&cap, &plan, 0, &cache, &inputs)
        .unwrap_err()
        .to_string();
    assert!(e.contains("'x'") && e.contains("no host data"), "{e}");
    // A plan for another shape is refused.
    let other = unet(&UnetOpts { batch: 2 }).capture();
    assert!(SegmentGraph::for_execution(&other, &plan, 0, &cache, &inputs).is_err());
}

// ---------------------------------------------------------------------------------------
// Random graphs.

#[derive(Clone, Debug)]
struct OpSpec {
    kind: u8,
    a: usize,
    b: usize,
    /// Cut choices for the tensors the op creates (up to 4).
    cuts: [bool; 4],
    new_group: bool,
}

fn op_spec() -> impl Strategy<Value = OpSpec> {
    (
        0u8..11,
        any::<usize>(),
        any::<usize>(),
        prop::array::uniform4(prop::bool::weighted(0.2)),
        any::<bool>(),
    )
        .prop_map(|(kind, a, b, cuts, new_group)| OpSpec {
            kind,
            a,
            b,
            cuts,
            new_group,
        })
}

fn random_net(ops: &[OpSpec], seed: u64) -> Net {
    let mut lv = Leaves::new();
    let x0 = lv.add("x0", &[8, 4], false);
    let w0 = lv.add("w0", &[8, 8], true);
    let w1 = lv.add("w1", &[8, 8], true);
    let (_wctx, data, params) = lv.allocate(seed);
    let ctx = Context::new_descriptors(1024, 1024, 1).unwrap();
    let x1 = ctx.new_tensor(DType::F32, &[8, 4]).unwrap();
    x1.set_name("x1");
    let mut pool: Vec<GTensor> = vec![x0, x1.clone()];
    let mut created: Vec<GTensor> = Vec::new();
    let mut marks = CutMarks::new();
    let mut group = 0usize;
    let mut n_cuts = 0usize;
    for (i, op) in ops.iter().enumerate() {
        let a = pool[op.a % pool.len()].clone();
        let b = pool[op.b % pool.len()].clone();
        let made: Vec<GTensor> = match op.kind {
            0 => vec![ctx.add(&a, &b).unwrap()],
            1 => vec![ctx.mul(&a, &b).unwrap()],
            2 => vec![ctx.sub(&a, &b).unwrap()],
            3 => vec![ctx.scale(&a, 0.75).unwrap()],
            4 => vec![ctx.silu(&a).unwrap()],
            5 => vec![ctx.tanh(&a).unwrap()],
            6 => vec![ctx
                .mul_mat(if op.b % 2 == 0 { &w0 } else { &w1 }, &a)
                .unwrap()],
            7 => {
                // A strided view, made contiguous, reshaped back (a view of the copy).
                let t = ctx.transpose(&a).unwrap();
                let c = ctx.cont(&t).unwrap();
                let r = ctx.reshape(&c, &[8, 4]).unwrap();
                vec![t, c, r]
            }
            8 => vec![ctx.gelu(&a).unwrap()],
            9 => {
                // Views with offsets, a view of a view, and a concat of views.
                let v1 = ctx.view(&a, [8, 2, 1, 1], [32, 64, 64], 64).unwrap();
                let w = ctx.view(&v1, [8, 1, 1, 1], [32, 32, 32], 32).unwrap();
                let v2 = ctx.view(&b, [8, 3, 1, 1], [32, 96, 96], 0).unwrap();
                let r = ctx.concat(&v2, &w, 1).unwrap();
                vec![v1, w, v2, r]
            }
            _ => {
                // A chain through a view of a cut-able node.
                let s = ctx.silu(&a).unwrap();
                let v = ctx.view(&s, [8, 4, 1, 1], [32, 128, 128], 0).unwrap();
                let r = ctx.add(&v, &b).unwrap();
                vec![s, v, r]
            }
        };
        for (j, t) in made.iter().enumerate() {
            t.set_name(&format!("op{i}_{j}"));
            if op.cuts[j] {
                if op.new_group && n_cuts > 0 {
                    group += 1;
                }
                marks
                    .mark(t, &format!("g{group}"), &format!("t{i}_{j}"))
                    .unwrap();
                n_cuts += 1;
            }
        }
        pool.push(made.last().unwrap().clone());
        created.extend(made);
    }
    let mut graph = Graph::new(&ctx, 1024).unwrap();
    for t in &created {
        graph.build_forward_expand(t).unwrap();
    }
    let xv = f32_bytes(&rnd(32, seed ^ 0x55));
    Net {
        _ctx: ctx,
        _data: data,
        graph,
        marks,
        params,
        host: vec![(x1, xv)],
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 40, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn random_graphs_run_bit_identically(ops in prop::collection::vec(op_spec(), 1..24), seed in any::<u64>()) {
        let backend = Backend::cpu(2).unwrap();
        let net = random_net(&ops, seed % 1000);
        let (plan, _) = check_equivalence(&backend, &net);
        prop_assert!(!plan.segments.is_empty());
    }
}

#[test]
fn view_cuts_are_rebased_and_strided_cuts_keep_their_layout() {
    // s = silu(x0); v1 = rows 2..3 of s (cut g0); w = row 1 of v1 (a view of s);
    // r = concat(rows 0..2 of x1, w); t = transpose(r) (strided cut g1); final: cont(t).
    let ops = [
        OpSpec {
            kind: 4,
            a: 0,
            b: 0,
            cuts: [false; 4],
            new_group: false,
        },
        OpSpec {
            kind: 9,
            a: 2,
            b: 1,
            cuts: [true, false, false, false],
            new_group: false,
        },
        OpSpec {
            kind: 7,
            a: 3,
            b: 0,
            cuts: [true, false, false, false],
            new_group: true,
        },
    ];
    let backend = Backend::cpu(2).unwrap();
    let net = random_net(&ops, 5);
    let cap = net.capture();
    let name = |i: usize| cap.node_tensors()[i].name();
    let plan = plan_for(&backend, &cap);
    assert_eq!(plan.segments.len(), 3);
    let g1 = &plan.segments[1];
    // 'w' views s's storage, which only the cached cut v1 carries: s is not recomputed.
    assert!(
        g1.internal_nodes.iter().all(|&i| name(i) != "op0_0"),
        "{:?}",
        g1.internal_nodes
            .iter()
            .map(|&i| name(i))
            .collect::<Vec<_>>()
    );
    assert!(g1.internal_nodes.iter().any(|&i| name(i) == "op1_1"));
    assert!(g1
        .inputs_of(InputKind::PreviousCut)
        .any(|i| i.name == "op1_0"));
    // The strided cut is read by the final segment.
    assert!(plan.segments[2]
        .inputs_of(InputKind::PreviousCut)
        .any(|i| i.name == "op2_0"));
    let t = cap
        .node_tensors()
        .iter()
        .find(|t| t.name() == "op2_0")
        .unwrap();
    assert!(!t.is_contiguous());
    check_equivalence(&backend, &net);
}

/// A case proptest found: a cut on a view of a view, in the same group as a later cut.
#[test]
fn regression_cut_on_view_of_view() {
    let op = |kind: u8, a: usize, b: usize, cuts: [bool; 4], new_group: bool| OpSpec {
        kind,
        a,
        b,
        cuts,
        new_group,
    };
    let ops = vec![
        op(
            9,
            7421531714554437751,
            0,
            [false, true, false, false],
            false,
        ),
        op(
            5,
            2038837518584190343,
            6271764665574019416,
            [false; 4],
            true,
        ),
        op(
            0,
            9577613363951258354,
            12913079985870269524,
            [false; 4],
            true,
        ),
        op(
            3,
            2947107216606346534,
            8437672338121502578,
            [false, false, true, false],
            true,
        ),
        op(
            6,
            2593227991073468672,
            344016827522122220,
            [false; 4],
            false,
        ),
        op(
            0,
            11602644141812929350,
            1823381431812723921,
            [true, true, false, false],
            false,
        ),
        op(
            3,
            4491957392447562668,
            7481956255380048215,
            [false, true, false, false],
            true,
        ),
    ];
    let backend = Backend::cpu(2).unwrap();
    let net = random_net(&ops, 13109559672222907436 % 1000);
    check_equivalence(&backend, &net);
}

/// A second case proptest found: a cut view whose storage root is recomputed in its segment.
#[test]
fn regression_cut_view_of_recomputed_root() {
    let op = |kind: u8, a: usize, b: usize, cuts: [bool; 4], new_group: bool| OpSpec {
        kind,
        a,
        b,
        cuts,
        new_group,
    };
    let ops = vec![
        op(0, 0, 51, [false, false, false, true], false),
        op(
            1,
            13440672101606563783,
            5538007707459617999,
            [false, true, true, false],
            false,
        ),
        op(
            4,
            16549136251523554312,
            5322220055897358083,
            [false; 4],
            true,
        ),
        op(
            5,
            6236288506988029275,
            8448462275640739346,
            [false, false, true, true],
            true,
        ),
        op(
            3,
            1641057087149460021,
            619477026597766387,
            [false; 4],
            false,
        ),
        op(
            8,
            2697562301846917066,
            17365262795339578423,
            [false, false, true, true],
            false,
        ),
        op(
            6,
            13112416969440068005,
            18340912630142075489,
            [false; 4],
            true,
        ),
        op(
            1,
            14465422743013057921,
            12025468192281830547,
            [true, false, true, true],
            false,
        ),
        op(
            10,
            12520820203346479107,
            13414308821604367512,
            [false; 4],
            true,
        ),
        op(
            2,
            3572263994496418649,
            18290353089055359803,
            [false, true, false, false],
            false,
        ),
        op(
            10,
            491879169141744151,
            11504866449814057642,
            [true, false, false, false],
            true,
        ),
        op(
            3,
            13980868143575315040,
            7671074377333796675,
            [false, true, true, false],
            false,
        ),
        op(
            3,
            1923553326381023151,
            250385777474383613,
            [true, false, true, false],
            false,
        ),
        op(
            9,
            7656095153865469285,
            6935002666421857467,
            [false, true, false, false],
            true,
        ),
    ];
    let backend = Backend::cpu(2).unwrap();
    let net = random_net(&ops, 12372930055741813165 % 1000);
    check_equivalence(&backend, &net);
}
