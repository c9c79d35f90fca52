//! ggml round trip: a graph with conv2d, group_norm, mul_mat, flash attention and upscale,
//! computed on the CPU backend (through the graph allocator and through the scheduler) and
//! compared with plain Rust computations.

use sd_tensor::ggml::{
    Backend, BufferType, Context, GTensor, Gallocr, Graph, Interpolation, Scheduler,
};
use sd_tensor::DType;
use sd_testutil::{f16_round, max_abs, rnd};

/// x: [C, H, W], k: [OC, C, KH, KW] -> [OC, OH, OW]
#[allow(clippy::too_many_arguments)]
fn conv2d_ref(
    x: &[f32],
    c: usize,
    h: usize,
    w: usize,
    k: &[f32],
    oc: usize,
    kh: usize,
    kw: usize,
    stride: usize,
    pad: usize,
) -> (Vec<f32>, usize, usize) {
    let oh = (h + 2 * pad - kh) / stride + 1;
    let ow = (w + 2 * pad - kw) / stride + 1;
    let mut out = vec![0f32; oc * oh * ow];
    for o in 0..oc {
        for y in 0..oh {
            for xx in 0..ow {
                let mut acc = 0f64;
                for ci in 0..c {
                    for ky in 0..kh {
                        for kx in 0..kw {
                            let iy = (y * stride + ky) as isize - pad as isize;
                            let ix = (xx * stride + kx) as isize - pad as isize;
                            if iy < 0 || ix < 0 || iy >= h as isize || ix >= w as isize {
                                continue;
                            }
                            acc += x[(ci * h + iy as usize) * w + ix as usize] as f64
                                * k[((o * c + ci) * kh + ky) * kw + kx] as f64;
                        }
                    }
                }
                out[(o * oh + y) * ow + xx] = acc as f32;
            }
        }
    }
    (out, oh, ow)
}

/// x: [C, H*W], groups over channels.
fn group_norm_ref(x: &[f32], c: usize, hw: usize, groups: usize, eps: f32) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    let cpg = c / groups;
    for g in 0..groups {
        let s = &x[g * cpg * hw..(g + 1) * cpg * hw];
        let mean = s.iter().map(|&v| v as f64).sum::<f64>() / s.len() as f64;
        let var = s.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / s.len() as f64;
        for (i, &v) in s.iter().enumerate() {
            out[g * cpg * hw + i] = ((v as f64 - mean) / (var + eps as f64).sqrt()) as f32;
        }
    }
    out
}

/// a: [m, k], b: [n, k] -> [n, m] (ggml's mul_mat in row-major terms).
fn mul_mat_ref(a: &[f32], b: &[f32], m: usize, n: usize, k: usize) -> Vec<f32> {
    let mut out = vec![0f32; n * m];
    for j in 0..n {
        for i in 0..m {
            out[j * m + i] = (0..k)
                .map(|t| a[i * k + t] as f64 * b[j * k + t] as f64)
                .sum::<f64>() as f32;
        }
    }
    out
}

/// q: [heads, nq, d], k/v: [heads, nkv, d] -> [nq, heads, d]
#[allow(clippy::too_many_arguments)]
fn attention_ref(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    heads: usize,
    nq: usize,
    nkv: usize,
    d: usize,
    scale: f32,
) -> Vec<f32> {
    let mut out = vec![0f32; nq * heads * d];
    for h in 0..heads {
        for i in 0..nq {
            let qi = &q[(h * nq + i) * d..(h * nq + i + 1) * d];
            let scores: Vec<f64> = (0..nkv)
                .map(|j| {
                    let kj = &k[(h * nkv + j) * d..(h * nkv + j + 1) * d];
                    qi.iter()
                        .zip(kj)
                        .map(|(a, b)| *a as f64 * *b as f64)
                        .sum::<f64>()
                        * scale as f64
                })
                .collect();
            let mx = scores.iter().cloned().fold(f64::MIN, f64::max);
            let e: Vec<f64> = scores.iter().map(|s| (s - mx).exp()).collect();
            let z: f64 = e.iter().sum();
            for t in 0..d {
                let acc: f64 = (0..nkv)
                    .map(|j| e[j] / z * v[(h * nkv + j) * d + t] as f64)
                    .sum();
                out[(i * heads + h) * d + t] = acc as f32;
            }
        }
    }
    out
}

struct Case {
    ctx: Context,
    graph: Graph,
    outputs: Vec<(String, sd_tensor::ggml::GTensor, Vec<f32>, f32)>,
    _weights: sd_tensor::ggml::Buffer,
}

fn build_case() -> Case {
    let ctx = Context::new_descriptors(256, 256, 1).unwrap();
    // conv2d: x [N=1, C=6, H=9, W=11], kernel [OC=4, C=6, 3, 3], stride 1, pad 1.
    let (c, h, w, oc) = (6, 9, 11, 4);
    let x = ctx.new_tensor(DType::F32, &[w, h, c, 1]).unwrap();
    let k = ctx.new_tensor(DType::F32, &[3, 3, c, oc]).unwrap();
    // group norm input [W=5, H=4, C=8, 1], 2 groups.
    let gn_in = ctx.new_tensor(DType::F32, &[5, 4, 8, 1]).unwrap();
    // mul_mat: a [k=64, m=33], b [k=64, n=7].
    let ma = ctx.new_tensor(DType::F32, &[64, 33]).unwrap();
    let mb = ctx.new_tensor(DType::F32, &[64, 7]).unwrap();
    // attention: d=64, nq=5, nkv=24, heads=2; k/v in f16.
    let q = ctx.new_tensor(DType::F32, &[64, 5, 2, 1]).unwrap();
    let kk = ctx.new_tensor(DType::F16, &[64, 24, 2, 1]).unwrap();
    let vv = ctx.new_tensor(DType::F16, &[64, 24, 2, 1]).unwrap();
    // upscale input [W=3, H=2, C=2, 1].
    let up_in = ctx.new_tensor(DType::F32, &[3, 2, 2, 1]).unwrap();

    let weights = BufferType::cpu().alloc_context_tensors(&ctx).unwrap();

    let xv = rnd(c * h * w, 1);
    let kv = rnd(oc * c * 9, 2);
    let gv = rnd(5 * 4 * 8, 3);
    let mav = rnd(64 * 33, 4);
    let mbv = rnd(64 * 7, 5);
    let qv = rnd(64 * 5 * 2, 6);
    let kkv = f16_round(&rnd(64 * 24 * 2, 7));
    let vvv = f16_round(&rnd(64 * 24 * 2, 8));
    let upv = rnd(12, 9);
    x.write_f32(&xv).unwrap();
    k.write_f32(&kv).unwrap();
    gn_in.write_f32(&gv).unwrap();
    ma.write_f32(&mav).unwrap();
    mb.write_f32(&mbv).unwrap();
    q.write_f32(&qv).unwrap();
    kk.write_f32(&kkv).unwrap();
    vv.write_f32(&vvv).unwrap();
    up_in.write_f32(&upv).unwrap();

    let conv = ctx.conv_2d(&k, &x, (1, 1), (1, 1), (1, 1), true).unwrap();
    let conv_direct = ctx.conv_2d_direct(&k, &x, (1, 1), (1, 1), (1, 1)).unwrap();
    let gn = ctx.group_norm(&gn_in, 2, 1e-6).unwrap();
    let mm = ctx.mul_mat(&ma, &mb).unwrap();
    let scale = 1.0 / 8.0;
    let fa = ctx.flash_attn_ext(&q, &kk, &vv, None, scale).unwrap();
    let up = ctx
        .interpolate(&up_in, 6, 4, Interpolation::Nearest)
        .unwrap();

    let (conv_ref, oh, ow) = conv2d_ref(&xv, c, h, w, &kv, oc, 3, 3, 1, 1);
    assert_eq!(conv.ne(), [ow, oh, oc, 1]);
    let gn_ref = group_norm_ref(&gv, 8, 20, 2, 1e-6);
    let mm_ref = mul_mat_ref(&mav, &mbv, 33, 7, 64);
    assert_eq!(mm.ne(), [33, 7, 1, 1]);
    let fa_ref = attention_ref(&qv, &kkv, &vvv, 2, 5, 24, 64, scale);
    assert_eq!(fa.ne(), [64, 2, 5, 1]);
    let mut up_ref = vec![0f32; 2 * 4 * 6];
    for ch in 0..2 {
        for y in 0..4 {
            for xx in 0..6 {
                up_ref[(ch * 4 + y) * 6 + xx] = upv[(ch * 2 + y / 2) * 3 + xx / 2];
            }
        }
    }

    let mut graph = Graph::new(&ctx, 256).unwrap();
    let outputs = vec![
        ("conv2d".to_string(), conv, conv_ref.clone(), 1e-5),
        ("conv2d_direct".to_string(), conv_direct, conv_ref, 1e-5),
        ("group_norm".to_string(), gn, gn_ref, 1e-5),
        ("mul_mat".to_string(), mm, mm_ref, 1e-4),
        // K/V are f16 and ggml's CPU kernel rounds Q and the softmax weights to f16.
        ("flash_attn_ext".to_string(), fa, fa_ref, 2e-3),
        ("upscale".to_string(), up, up_ref, 0.0),
    ];
    for (_, t, _, _) in &outputs {
        t.set_output();
        graph.build_forward_expand(t).unwrap();
    }
    Case {
        ctx,
        graph,
        outputs,
        _weights: weights,
    }
}

fn check(case: &Case) {
    for (name, t, want, tol) in &case.outputs {
        let got = t.read_f32().unwrap();
        let err = max_abs(&got, want);
        assert!(err <= *tol, "{name}: max abs error {err} > {tol}");
    }
}

#[test]
fn graph_allocator_path_matches_rust() {
    let case = build_case();
    let backend = Backend::cpu(2).unwrap();
    let mut galloc = Gallocr::new(backend.buffer_type()).unwrap();
    let size = galloc.reserve(&case.graph).unwrap();
    assert!(size > 0);
    assert_eq!(galloc.measure(&case.graph), size);
    galloc.alloc_graph(&case.graph).unwrap();
    backend.compute(&case.graph).unwrap();
    check(&case);
    assert!(case.ctx.free_bytes() > 0);
    // Dropping the allocator makes its tensors unreadable instead of dangling.
    let conv = case.outputs[0].1.clone();
    drop(galloc);
    assert!(matches!(
        conv.read_f32(),
        Err(sd_tensor::GgmlError::NotAllocated { .. })
    ));
}

#[test]
fn scheduler_path_matches_rust() {
    let case = build_case();
    let backend = Backend::cpu(2).unwrap();
    let mut sched = Scheduler::new(&[&backend], 256, false).unwrap();
    let seen = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let s2 = seen.clone();
    sched.set_eval_callback(Box::new(move |_t, ask| {
        if !ask {
            s2.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        true
    }));
    sched.reserve(&case.graph).unwrap();
    assert!(sched.buffer_size(&backend).unwrap() > 0);
    sched.alloc_graph(&case.graph).unwrap();
    sched.compute(&case.graph).unwrap();
    assert!(sched.n_splits() >= 1);
    assert_eq!(
        seen.load(std::sync::atomic::Ordering::Relaxed),
        case.graph.n_nodes()
    );
    check(&case);
}

#[test]
fn bad_operands_are_errors_not_aborts() {
    let ctx = Context::new_descriptors(16, 16, 1).unwrap();
    let a = ctx.new_tensor(DType::F32, &[4, 3]).unwrap();
    let b = ctx.new_tensor(DType::F32, &[5, 3]).unwrap();
    assert!(ctx.mul_mat(&a, &b).is_err());
    assert!(ctx.add(&a, &b).is_err());
    assert!(ctx.reshape(&a, &[5]).is_err());
    assert!(ctx.permute(&a, [0, 0, 1, 2]).is_err());
    assert!(ctx.group_norm(&a, 0, 1e-5).is_err());
    assert!(ctx.concat(&a, &b, 1).is_err());
    assert!(ctx.view(&a, [4, 4, 1, 1], [16, 64, 64], 0).is_err());
    let k = ctx.new_tensor(DType::F32, &[3, 3, 2, 4]).unwrap();
    let x = ctx.new_tensor(DType::F32, &[8, 8, 3, 1]).unwrap();
    assert!(ctx.conv_2d(&k, &x, (1, 1), (1, 1), (1, 1), true).is_err());
    assert!(ctx.new_tensor(DType::Q8_0, &[33]).is_err());
    assert!(ctx.new_tensor(DType::F32, &[usize::MAX, 2]).is_err());
    // Data I/O on an unallocated tensor.
    assert!(matches!(
        a.read_f32(),
        Err(sd_tensor::GgmlError::NotAllocated { .. })
    ));
    // Context exhaustion is an error.
    let small = Context::new_descriptors(2, 1, 0).unwrap();
    let mut made = 0;
    while small.new_tensor(DType::F32, &[4]).is_ok() {
        made += 1;
        assert!(made < 10);
    }
    // Graph overflow is an error.
    let ctx2 = Context::new_descriptors(64, 4, 1).unwrap();
    let mut g = Graph::new(&ctx2, 4).unwrap();
    let mut t = ctx2.new_tensor(DType::F32, &[4]).unwrap();
    let mut failed = false;
    for _ in 0..8 {
        t = ctx2.scale(&t, 2.0).unwrap();
        if g.build_forward_expand(&t).is_err() {
            failed = true;
            break;
        }
    }
    assert!(failed);
}

#[test]
fn buffer_placement_and_copies() {
    let ctx = Context::new_descriptors(8, 8, 1).unwrap();
    let a = ctx.new_tensor(DType::F16, &[32, 2]).unwrap();
    let b = ctx.new_tensor(DType::F16, &[32, 2]).unwrap();
    let buf = BufferType::cpu().alloc(4096).unwrap();
    buf.place(&a, 0).unwrap();
    assert!(buf.place(&a, 128).is_err(), "placing twice");
    assert!(buf.place(&b, 4090).is_err(), "out of range");
    buf.place(&b, 256).unwrap();
    let v: Vec<f32> = (0..64).map(|i| i as f32 * 0.5).collect();
    a.write_f32(&v).unwrap();
    Backend::copy_tensor(&a, &b).unwrap();
    assert_eq!(b.read_f32().unwrap(), v);
    // Unplacing takes a tensor's memory back while the buffer stays: it can be placed
    // again (here at another offset) and the other tensor keeps its bytes.
    assert!(buf.unplace(&a));
    assert!(!a.is_allocated() && b.is_allocated());
    assert!(!buf.unplace(&a), "unplaced twice");
    buf.place(&a, 1024).unwrap();
    a.write_f32(&v).unwrap();
    assert_eq!(a.read_f32().unwrap(), v);
    assert_eq!(b.read_f32().unwrap(), v);
    assert_eq!(buf.placed_tensors().len(), 2);
    drop(buf);
    assert!(!a.is_allocated() && !b.is_allocated());
}

#[test]
fn devices_report_memory() {
    let devs = sd_tensor::ggml::Device::all();
    assert!(!devs.is_empty());
    let cpu = sd_tensor::ggml::Device::cpu().unwrap();
    let m = cpu.memory();
    assert!(m.total > 0 && m.free <= m.total);
    assert!(!sd_tensor::ggml::version().is_empty());
}

#[repr(C, align(64))]
struct Aligned([u8; 320]);

impl AsRef<[u8]> for Aligned {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

#[test]
fn shared_bytes_buffers_are_zero_copy_and_read_only() {
    let values: Vec<f32> = (0..64).map(|i| i as f32 - 3.5).collect();
    let mut bytes = Aligned([0u8; 320]);
    for (i, v) in values.iter().enumerate() {
        bytes.0[64 + 4 * i..68 + 4 * i].copy_from_slice(&v.to_le_bytes());
    }
    let shared: sd_tensor::ggml::SharedBytes = std::sync::Arc::new(bytes);
    let buf = sd_tensor::ggml::Buffer::from_shared_bytes(shared).unwrap();
    let ctx = Context::new_descriptors(4, 4, 1).unwrap();
    let t = ctx.new_tensor(DType::F32, &[64]).unwrap();
    buf.place(&t, 64).unwrap();
    assert_eq!(t.read_f32().unwrap(), values);
    assert!(t.write_f32(&values).is_err(), "mapped memory is read-only");
    drop(buf);
    assert!(!t.is_allocated());
    // Unaligned memory is refused instead of tripping ggml's assertion.
    struct Unaligned(Aligned);
    impl AsRef<[u8]> for Unaligned {
        fn as_ref(&self) -> &[u8] {
            &self.0 .0[1..]
        }
    }
    let bad: sd_tensor::ggml::SharedBytes = std::sync::Arc::new(Unaligned(Aligned([0u8; 320])));
    assert!(sd_tensor::ggml::Buffer::from_shared_bytes(bad).is_err());
}

#[test]
fn scheduler_allocates_twice_and_refuses_oversized_graphs() {
    let case = build_case();
    let backend = Backend::cpu(1).unwrap();
    let mut sched = Scheduler::new(&[&backend], 256, false).unwrap();
    sched.alloc_graph(&case.graph).unwrap();
    sched.compute(&case.graph).unwrap();
    // A second allocation without reset would trip a ggml assertion; it resets instead.
    sched.alloc_graph(&case.graph).unwrap();
    sched.compute(&case.graph).unwrap();
    check(&case);
    let mut small = Scheduler::new(&[&backend], 16, false).unwrap();
    assert!(matches!(
        small.alloc_graph(&case.graph),
        Err(sd_tensor::GgmlError::GraphFull { .. })
    ));
}

/// ggml's allocator reuses its previous plan for any graph with the same node count and
/// sizes; two such graphs with different lifetimes must not share it.
#[test]
fn gallocr_replans_for_a_different_graph_of_the_same_shape() {
    let ctx = Context::new_descriptors(32, 32, 2).unwrap();
    let x = ctx.new_tensor(DType::F32, &[8]).unwrap();
    let y = ctx.new_tensor(DType::F32, &[8]).unwrap();
    let _buf = BufferType::cpu().alloc_context_tensors(&ctx).unwrap();
    let xv: Vec<f32> = (0..8).map(|i| i as f32 * 0.25 - 1.0).collect();
    let yv: Vec<f32> = (0..8).map(|i| 0.5 - i as f32 * 0.125).collect();
    x.write_f32(&xv).unwrap();
    y.write_f32(&yv).unwrap();
    // Graph A: a = x + y; b = tanh(a); out = scale(b) (a chain, memory reusable in place).
    let a = ctx.add(&x, &y).unwrap();
    let b = ctx.tanh(&a).unwrap();
    let out_a = ctx.scale(&b, 2.0).unwrap();
    out_a.set_output();
    let mut ga = Graph::new(&ctx, 8).unwrap();
    ga.build_forward_expand(&out_a).unwrap();
    // Graph B: p = x * y; q = tanh(x); r = scale(p), both q and r outputs (p must survive q).
    let p = ctx.mul(&x, &y).unwrap();
    let q = ctx.tanh(&x).unwrap();
    let r = ctx.scale(&p, 3.0).unwrap();
    q.set_output();
    r.set_output();
    let mut gb = Graph::new(&ctx, 8).unwrap();
    gb.build_forward_expand(&p).unwrap();
    gb.build_forward_expand(&q).unwrap();
    gb.build_forward_expand(&r).unwrap();
    assert_eq!(ga.n_nodes(), gb.n_nodes());
    let backend = Backend::cpu(1).unwrap();
    let mut galloc = Gallocr::new(backend.buffer_type()).unwrap();
    galloc.alloc_graph(&ga).unwrap();
    backend.compute(&ga).unwrap();
    galloc.alloc_graph(&gb).unwrap();
    backend.compute(&gb).unwrap();
    let want_q: Vec<f32> = xv.iter().map(|v| v.tanh()).collect();
    let want_r: Vec<f32> = xv.iter().zip(&yv).map(|(a, b)| 3.0 * a * b).collect();
    assert!(max_abs(&q.read_f32().unwrap(), &want_q) < 1e-6);
    assert!(max_abs(&r.read_f32().unwrap(), &want_r) < 1e-6);
}

/// Graphs allocated with `alloc_graph_kept` keep their memory when the allocator places
/// the next graph in the same buffer, and compute again without allocating while the
/// generation stays; a graph that needs a larger buffer changes the generation.
#[test]
fn gallocr_kept_graphs_share_the_buffer_until_it_grows() {
    let ctx = Context::new_descriptors(64, 64, 3).unwrap();
    let x = ctx.new_tensor(DType::F32, &[8]).unwrap();
    let _buf = BufferType::cpu().alloc_context_tensors(&ctx).unwrap();
    let xv: Vec<f32> = (0..8).map(|i| i as f32 * 0.25 - 1.0).collect();
    x.write_f32(&xv).unwrap();
    let chain = |k: f32| {
        let a = ctx.scale(&x, k).unwrap();
        let out = ctx.tanh(&a).unwrap();
        out.set_output();
        let mut g = Graph::new(&ctx, 8).unwrap();
        g.build_forward_expand(&out).unwrap();
        (g, out)
    };
    let (ga, out_a) = chain(2.0);
    let (gb, out_b) = chain(3.0);
    let backend = Backend::cpu(1).unwrap();
    let mut galloc = Gallocr::new(backend.buffer_type()).unwrap();
    galloc.alloc_graph_kept(&ga).unwrap();
    let first = galloc.generation();
    galloc.alloc_graph_kept(&gb).unwrap();
    assert_eq!(galloc.generation(), first, "same size: the buffer stays");
    assert!(out_a.is_allocated(), "the kept graph keeps its memory");
    let want = |k: f32| -> Vec<f32> { xv.iter().map(|v| (k * v).tanh()).collect() };
    for _ in 0..2 {
        backend.compute(&ga).unwrap();
        assert!(max_abs(&out_a.read_f32().unwrap(), &want(2.0)) < 1e-6);
        backend.compute(&gb).unwrap();
        assert!(max_abs(&out_b.read_f32().unwrap(), &want(3.0)) < 1e-6);
    }
    // A larger graph grows the buffer: the generation changes.
    let y = ctx.new_tensor(DType::F32, &[4096]).unwrap();
    y.set_input();
    let big = ctx.tanh(&ctx.scale(&y, 2.0).unwrap()).unwrap();
    big.set_output();
    let mut gc = Graph::new(&ctx, 8).unwrap();
    gc.build_forward_expand(&big).unwrap();
    galloc.alloc_graph_kept(&gc).unwrap();
    assert_ne!(galloc.generation(), first, "the buffer grew");
}

/// Each pair's values: (ggml's op, the host kernel's).
type PairValues = Vec<(Vec<f32>, Vec<f32>)>;

/// Computes every tensor of `pairs` (ggml's op, the host kernel's) in one graph of `ctx` on
/// the CPU backend with `threads`; returns the graph's custom op count and each pair's values.
fn compute_pairs(
    ctx: &Context,
    pairs: &[(GTensor, GTensor)],
    threads: usize,
) -> (usize, PairValues) {
    compute_pairs_counting(ctx, pairs, threads, "CUSTOM", 256)
}

/// [`compute_pairs`] in a graph of `size` nodes, counting the nodes of op `op`.
fn compute_pairs_counting(
    ctx: &Context,
    pairs: &[(GTensor, GTensor)],
    threads: usize,
    op: &str,
    size: usize,
) -> (usize, PairValues) {
    let mut graph = Graph::new(ctx, size).unwrap();
    for (a, b) in pairs {
        for t in [a, b] {
            t.set_output();
            graph.build_forward_expand(t).unwrap();
        }
    }
    let custom = graph.nodes().iter().filter(|n| n.op_name() == op).count();
    let backend = Backend::cpu(threads).unwrap();
    let mut galloc = Gallocr::new(backend.buffer_type()).unwrap();
    galloc.alloc_graph(&graph).unwrap();
    backend.compute(&graph).unwrap();
    let values = pairs
        .iter()
        .map(|(a, b)| (a.read_f32().unwrap(), b.read_f32().unwrap()))
        .collect();
    (custom, values)
}

/// The crate's CPU convolution kernels (`conv_2d_host`: im2col and epilogue) give the bits
/// of ggml's `conv_2d` + a broadcast bias `add` exactly, for f32 and f16 kernels (f32 / f16
/// im2col), and agree to f32 rounding for bf16 kernels (a bf16 im2col, against ggml's path
/// on the input rounded to bf16), with and without a bias, strides, paddings, dilations, rectangular kernels
/// and inputs, several images, a channel-strided (non-contiguous) input, 1 to 3 threads.
#[test]
fn host_im2col_convolution_equals_ggmls_bit_for_bit() {
    // (kernel w, h, in ch, out ch), input (w, h, n), stride, pad, dilation
    type Case = (
        [usize; 4],
        [usize; 3],
        (usize, usize),
        (usize, usize),
        (usize, usize),
    );
    let cases: [Case; 7] = [
        ([3, 3, 5, 4], [9, 7, 1], (1, 1), (1, 1), (1, 1)),
        // 3x3, stride 1: several tiles of 16 pixels and a partial one.
        ([3, 3, 4, 3], [37, 5, 2], (1, 1), (1, 1), (1, 1)),
        ([3, 3, 3, 2], [16, 17, 2], (2, 2), (1, 1), (1, 1)),
        ([1, 1, 6, 3], [5, 4, 1], (1, 1), (0, 0), (1, 1)),
        ([5, 3, 2, 3], [11, 9, 1], (1, 2), (2, 0), (1, 1)),
        ([3, 3, 4, 4], [10, 10, 1], (1, 1), (2, 2), (2, 2)),
        ([4, 4, 3, 5], [37, 21, 2], (2, 3), (3, 1), (1, 2)),
    ];
    for (i, (kn, xn, stride, pad, dil)) in cases.into_iter().enumerate() {
        for kernel_type in [DType::F32, DType::F16, DType::BF16] {
            for exact in [true, false] {
                for threads in [1, 3] {
                    let ctx = Context::new_descriptors(96, 96, 1).unwrap();
                    let k = ctx.new_tensor(kernel_type, &kn).unwrap();
                    let bias = ctx.new_tensor(DType::F32, &[kn[3]]).unwrap();
                    let x = ctx
                        .new_tensor(DType::F32, &[xn[0], xn[1], kn[2], xn[2]])
                        .unwrap();
                    let buf = BufferType::cpu().alloc_context_tensors(&ctx).unwrap();
                    k.write_f32(&rnd(kn.iter().product(), 11 + i as u64))
                        .unwrap();
                    bias.write_f32(&rnd(kn[3], 3 + i as u64)).unwrap();
                    x.write_f32(&rnd(xn[0] * xn[1] * kn[2] * xn[2], 7 + i as u64))
                        .unwrap();
                    let mut outs = Vec::new();
                    for input in [
                        x.clone(),
                        ctx.cont(&ctx.permute(&x, [0, 1, 3, 2]).unwrap()).unwrap(),
                    ] {
                        // The second input is x with channels and images swapped, then viewed
                        // back: channel-strided rows.
                        let input = if input.ne() == x.ne() {
                            input
                        } else {
                            ctx.permute(&input, [0, 1, 3, 2]).unwrap()
                        };
                        // A bf16 kernel's host product runs on bf16 columns; ggml's im2col
                        // writes f32 ones (the kernel is then widened): give ggml's path the
                        // input rounded to bf16, so both multiply the same values.
                        let rounded = if kernel_type == DType::BF16 {
                            let r = ctx.cast(&input, DType::BF16).unwrap();
                            ctx.cast(&r, DType::F32).unwrap()
                        } else {
                            input.clone()
                        };
                        let a = ctx.conv_2d(&k, &rounded, stride, pad, dil, exact).unwrap();
                        let b = ctx
                            .conv_2d_host(&k, &input, None, stride, pad, dil, exact)
                            .unwrap();
                        outs.push((a.clone(), b));
                        let with_bias = ctx
                            .add(&a, &ctx.reshape(&bias, &[1, 1, kn[3], 1]).unwrap())
                            .unwrap();
                        let b = ctx
                            .conv_2d_host(&k, &input, Some(&bias), stride, pad, dil, exact)
                            .unwrap();
                        outs.push((with_bias, b));
                    }
                    let (custom, values) = compute_pairs(&ctx, &outs, threads);
                    // Per host convolution: the im2col and the epilogue.
                    assert_eq!(custom, 8, "case {i}: the host kernels were not used");
                    for (a, b) in values {
                        assert!(a.iter().any(|v| *v != 0.0));
                        let same = if kernel_type == DType::BF16 {
                            // Products of bf16 values are exact in f32; the sums' order
                            // differs (bf16 dot products against a widened f32 product).
                            let scale = a.iter().fold(1f32, |m, v| m.max(v.abs()));
                            max_abs(&a, &b) <= 1e-5 * scale
                        } else {
                            a.iter().zip(&b).all(|(p, q)| p.to_bits() == q.to_bits())
                        };
                        assert!(
                            same,
                            "case {i} {kernel_type:?} exact {exact} threads {threads}: max diff {}",
                            max_abs(&a, &b)
                        );
                    }
                    drop(buf);
                }
            }
        }
    }
}

/// Stride-1 convolutions of f16 and f32 kernels over images of at least 256 padded output
/// pixels (and, for a kernel wider than 1, padded rows at least 32 times its extra columns) run on the implicit kernel (one custom op, no im2col) and agree with ggml's exact
/// f32 convolution (f32 im2col and product, the f16 kernel widened) to f32 rounding: 3x3,
/// 1x1, a rectangular kernel with unequal paddings, a padding wider than the kernel's reach,
/// several images, a channel-strided input, with and without a bias, 1 to 3 threads. With
/// `set_f32_products(false)` the same convolutions take the im2col path again.
#[test]
fn host_implicit_convolution_agrees_with_ggmls_f32_convolution() {
    // (kernel w, h, in ch, out ch), input (w, h, n), pad
    // (3 threads split a single image's output channels into chunks: cases 1 and 2.)
    type Case = ([usize; 4], [usize; 3], (usize, usize));
    let cases: [Case; 6] = [
        ([3, 3, 5, 4], [64, 9, 1], (1, 1)),
        ([3, 3, 7, 33], [70, 5, 2], (1, 1)),
        ([1, 1, 6, 35], [32, 17, 1], (0, 0)),
        ([5, 3, 4, 6], [130, 4, 1], (2, 0)),
        ([1, 1, 3, 2], [30, 20, 1], (1, 2)),
        // Two blocks of output rows (2 MiB of padded input rows a block).
        ([3, 3, 64, 8], [64, 130, 1], (1, 1)),
    ];
    for (i, (kn, xn, pad)) in cases.into_iter().enumerate() {
        for kernel_type in [DType::F32, DType::F16] {
            for threads in [1, 3] {
                for implicit in [true, false] {
                    let ctx = Context::new_descriptors(96, 96, 1).unwrap();
                    ctx.set_f32_products(implicit);
                    let k = ctx.new_tensor(kernel_type, &kn).unwrap();
                    let k32 = ctx.new_tensor(DType::F32, &kn).unwrap();
                    let bias = ctx.new_tensor(DType::F32, &[kn[3]]).unwrap();
                    let x = ctx
                        .new_tensor(DType::F32, &[xn[0], xn[1], kn[2], xn[2]])
                        .unwrap();
                    let buf = BufferType::cpu().alloc_context_tensors(&ctx).unwrap();
                    let mut kv = rnd(kn.iter().product(), 21 + i as u64);
                    if kernel_type == DType::F16 {
                        kv = f16_round(&kv);
                    }
                    k.write_f32(&kv).unwrap();
                    k32.write_f32(&kv).unwrap();
                    bias.write_f32(&rnd(kn[3], 5 + i as u64)).unwrap();
                    x.write_f32(&rnd(xn[0] * xn[1] * kn[2] * xn[2], 9 + i as u64))
                        .unwrap();
                    let strided = ctx.cont(&ctx.permute(&x, [0, 1, 3, 2]).unwrap()).unwrap();
                    let strided = ctx.permute(&strided, [0, 1, 3, 2]).unwrap();
                    let mut outs = Vec::new();
                    for input in [x.clone(), strided] {
                        let (s1, d1) = ((1, 1), (1, 1));
                        let a = ctx.conv_2d(&k32, &input, s1, pad, d1, true).unwrap();
                        let b = ctx
                            .conv_2d_host(&k, &input, None, s1, pad, d1, false)
                            .unwrap();
                        outs.push((a.clone(), b));
                        let with_bias = ctx
                            .add(&a, &ctx.reshape(&bias, &[1, 1, kn[3], 1]).unwrap())
                            .unwrap();
                        let b = ctx
                            .conv_2d_host(&k, &input, Some(&bias), s1, pad, d1, false)
                            .unwrap();
                        outs.push((with_bias, b));
                    }
                    let (custom, values) = compute_pairs(&ctx, &outs, threads);
                    // One custom op per implicit convolution; im2col and epilogue else.
                    let expected = if implicit { 4 } else { 8 };
                    assert_eq!(custom, expected, "case {i} implicit {implicit}");
                    for (a, b) in values {
                        let scale = a.iter().fold(1f32, |m, v| m.max(v.abs()));
                        // The im2col path (not exact) rounds the activations to f16.
                        let tol = if implicit { 2e-6 } else { 2e-3 };
                        assert_eq!(a.len(), b.len());
                        assert!(
                            max_abs(&a, &b) <= tol * scale,
                            "case {i} {kernel_type:?} threads {threads} implicit {implicit}: \
                             max diff {} (scale {scale})",
                            max_abs(&a, &b)
                        );
                    }
                    drop(buf);
                }
            }
        }
    }
}

/// f16 kernels of at least 16 output channels that the implicit kernel does not take (strided,
/// narrow images, dilated) run as this crate's f32 im2col and one f32 product op
/// (`IM2COL_CONV_NAME`: the layout and the bias on the way) and agree with ggml's exact f32
/// convolution to f32 rounding (ggml's own f16 path rounds the activations to f16): row
/// groups of several channel tiles, more threads than tiles (the columns split, across the
/// images' boundary), several column blocks of an image, several kernel chunks a thread, a
/// channel-strided input, with and without a bias, 1 to 3 threads. With
/// `set_f32_products(false)` they keep ggml's f16 im2col and product.
#[test]
fn host_f16_convolutions_outside_the_implicit_kernel_run_as_f32_products() {
    // (kernel w, h, in ch, out ch), input (w, h, n), stride, pad, dilation
    type Case = (
        [usize; 4],
        [usize; 3],
        (usize, usize),
        (usize, usize),
        (usize, usize),
    );
    let cases: [Case; 6] = [
        // Stride 2 (a UNet's downsampler), three channel tiles.
        ([3, 3, 6, 40], [17, 12, 2], (2, 2), (1, 1), (1, 1)),
        // A narrow image (below the implicit kernel's width): 1,200 pixels, three column
        // blocks of 512.
        ([3, 3, 5, 33], [20, 60, 1], (1, 1), (1, 1), (1, 1)),
        // One channel tile: 3 threads split the columns of 2 images.
        ([3, 3, 4, 16], [9, 7, 2], (1, 1), (1, 1), (1, 1)),
        ([1, 1, 8, 20], [6, 5, 2], (1, 1), (0, 0), (1, 1)),
        ([3, 3, 4, 17], [12, 10, 1], (1, 1), (2, 2), (2, 2)),
        // K = 3 3 4000 = 36,000 values: two kernel chunks of 58 rows for 64 channels.
        ([3, 3, 4000, 64], [4, 3, 1], (1, 1), (1, 1), (1, 1)),
    ];
    for (i, (kn, xn, stride, pad, dil)) in cases.into_iter().enumerate() {
        for threads in [1, 3] {
            for own in [true, false] {
                let ctx = Context::new_descriptors(96, 96, 1).unwrap();
                ctx.set_host_kernels(true);
                ctx.set_f32_products(own);
                let k = ctx.new_tensor(DType::F16, &kn).unwrap();
                let k32 = ctx.new_tensor(DType::F32, &kn).unwrap();
                let bias = ctx.new_tensor(DType::F32, &[kn[3]]).unwrap();
                let x = ctx
                    .new_tensor(DType::F32, &[xn[0], xn[1], kn[2], xn[2]])
                    .unwrap();
                let buf = BufferType::cpu().alloc_context_tensors(&ctx).unwrap();
                let kv = f16_round(&rnd(kn.iter().product(), 31 + i as u64));
                k.write_f32(&kv).unwrap();
                k32.write_f32(&kv).unwrap();
                bias.write_f32(&rnd(kn[3], 15 + i as u64)).unwrap();
                x.write_f32(&rnd(xn[0] * xn[1] * kn[2] * xn[2], 19 + i as u64))
                    .unwrap();
                let strided = ctx.cont(&ctx.permute(&x, [0, 1, 3, 2]).unwrap()).unwrap();
                let strided = ctx.permute(&strided, [0, 1, 3, 2]).unwrap();
                let mut outs = Vec::new();
                for input in [x.clone(), strided] {
                    let a = ctx.conv_2d(&k32, &input, stride, pad, dil, true).unwrap();
                    let b = ctx
                        .conv_2d_host(&k, &input, None, stride, pad, dil, false)
                        .unwrap();
                    outs.push((a.clone(), b));
                    let with_bias = ctx
                        .add(&a, &ctx.reshape(&bias, &[1, 1, kn[3], 1]).unwrap())
                        .unwrap();
                    let b = ctx
                        .conv_2d_host(&k, &input, Some(&bias), stride, pad, dil, false)
                        .unwrap();
                    outs.push((with_bias, b));
                }
                let named = outs
                    .iter()
                    .filter(|(_, b)| b.name() == sd_tensor::ggml::IM2COL_CONV_NAME)
                    .count();
                assert_eq!(named, if own { 4 } else { 0 }, "case {i} own {own}");
                let (custom, values) = compute_pairs(&ctx, &outs, threads);
                // The im2col and the product op, or the im2col and the epilogue.
                assert_eq!(custom, 8, "case {i} own {own}");
                for (a, b) in values {
                    let scale = a.iter().fold(1f32, |m, v| m.max(v.abs()));
                    // ggml's f16 path rounds the activations to f16.
                    let tol = if own { 4e-6 } else { 2e-3 };
                    assert_eq!(a.len(), b.len());
                    assert!(
                        max_abs(&a, &b) <= tol * scale,
                        "case {i} threads {threads} own {own}: max diff {} (scale {scale})",
                        max_abs(&a, &b)
                    );
                }
                drop(buf);
            }
        }
    }
}

/// `Context::linear` with the CPU kernels on: f16 and f32 weights over at least 512 columns
/// take the crate's kernel (one custom op; several weight chunks a thread, a feature count
/// that is not a multiple of the row tiles) and agree with ggml's f32 `mul_mat` + `add` to
/// f32 rounding, with and without a bias, 1 to 3 threads; fewer columns, a bf16 weight, or
/// `set_f32_products(false)` keep ggml's ops.
#[test]
fn host_linear_agrees_with_ggmls_f32_product() {
    // (K, M), x's outer dimensions, weight type, whether the kernel takes it
    let cases = [
        // 8 MiB weight chunks: 256 features a chunk, two for one thread.
        ((8192, 300), [512, 1, 1], DType::F16, true),
        ((96, 37), [20, 13, 2], DType::F32, true),
        ((96, 37), [20, 5, 2], DType::F16, false),
        ((96, 37), [600, 1, 1], DType::BF16, false),
    ];
    for (i, ((k, m), outer, wt, expected)) in cases.into_iter().enumerate() {
        for threads in [1, 3] {
            for enabled in [true, false] {
                let ctx = Context::new_descriptors(32, 32, 1).unwrap();
                ctx.set_host_kernels(true);
                ctx.set_f32_products(enabled);
                let w = ctx.new_tensor(wt, &[k, m]).unwrap();
                let w32 = ctx.new_tensor(DType::F32, &[k, m]).unwrap();
                let b = ctx.new_tensor(DType::F32, &[m]).unwrap();
                let x = ctx
                    .new_tensor(DType::F32, &[k, outer[0], outer[1], outer[2]])
                    .unwrap();
                let buf = BufferType::cpu().alloc_context_tensors(&ctx).unwrap();
                // Values the weight type holds exactly.
                let wv = match wt {
                    DType::F16 => f16_round(&rnd(k * m, 31 + i as u64)),
                    DType::BF16 => rnd(k * m, 31 + i as u64)
                        .iter()
                        .map(|v| half::bf16::from_f32(*v).to_f32())
                        .collect(),
                    _ => rnd(k * m, 31 + i as u64),
                };
                w.write_f32(&wv).unwrap();
                w32.write_f32(&wv).unwrap();
                b.write_f32(&rnd(m, 7 + i as u64)).unwrap();
                x.write_f32(&rnd(x.nelements(), 3 + i as u64)).unwrap();
                let reference = ctx.mul_mat(&w32, &x).unwrap();
                let with_bias = ctx.add(&reference, &b).unwrap();
                let outs = vec![
                    (reference, ctx.linear(&w, &x, None).unwrap()),
                    (with_bias, ctx.linear(&w, &x, Some(&b)).unwrap()),
                ];
                let (custom, values) = compute_pairs(&ctx, &outs, threads);
                let used = expected && enabled;
                assert_eq!(
                    custom,
                    if used { 2 } else { 0 },
                    "case {i} enabled {enabled}"
                );
                // ggml's products of f16 / bf16 weights round the activations too.
                let tol = if used || wt == DType::F32 { 1e-5 } else { 2e-2 };
                for (a, b) in values {
                    let scale = a.iter().fold(1f32, |s, v| s.max(v.abs()));
                    assert!(
                        max_abs(&a, &b) <= tol * scale,
                        "case {i} threads {threads} enabled {enabled}: max diff {}",
                        max_abs(&a, &b)
                    );
                }
                drop(buf);
            }
        }
    }
}

/// Each pair's values (reference, kernel) agree within `tol` of the reference's largest
/// magnitude (at least 1).
fn assert_within_scale(values: PairValues, tol: f32, threads: usize) {
    for (i, (a, g)) in values.into_iter().enumerate() {
        let scale = a.iter().fold(1f32, |m, v| m.max(v.abs()));
        assert!(
            max_abs(&a, &g) <= tol * scale,
            "case {i}, {threads} threads: max diff {} (scale {scale})",
            max_abs(&a, &g)
        );
    }
}

/// `geglu_host` (one custom op) agrees with ggml's GEGLU (the row halves copied out, the
/// exact erf GELU of the gate, the product) to 1e-6 of the values' scale: rows read in place
/// from a projection with contiguous rows and from a view with wider row strides, values
/// large enough to reach both tails of the GELU, 1 and 3 threads; without host kernels, or
/// an odd row, it is `None`.
#[test]
fn host_geglu_agrees_with_ggmls_gelu_erf_and_mul() {
    for threads in [1, 3] {
        let ctx = Context::new_descriptors(64, 64, 1).unwrap();
        ctx.set_host_kernels(true);
        let (inner, tokens, b) = (40, 37, 2);
        let p = ctx.new_tensor(DType::F32, &[2 * inner, tokens, b]).unwrap();
        // A wider tensor whose rows hold the projection's values then padding.
        let wide = ctx
            .new_tensor(DType::F32, &[2 * inner + 6, tokens, b])
            .unwrap();
        let odd = ctx.new_tensor(DType::F32, &[7, 3]).unwrap();
        let buf = BufferType::cpu().alloc_context_tensors(&ctx).unwrap();
        let v: Vec<f32> = rnd(p.nelements(), 61).iter().map(|x| 6.0 * x).collect();
        p.write_f32(&v).unwrap();
        wide.write_f32(&rnd(wide.nelements(), 62)).unwrap();
        let nb = wide.nb();
        let view = ctx
            .view(&wide, [2 * inner, tokens, b, 1], [nb[1], nb[2], nb[3]], 0)
            .unwrap();
        let reference = |t: &GTensor| {
            let nb = t.nb();
            let half = |off: usize| {
                ctx.cont(
                    &ctx.view(t, [inner, tokens, b, 1], [nb[1], nb[2], nb[3]], off)
                        .unwrap(),
                )
                .unwrap()
            };
            let (value, gate) = (half(0), half(inner * 4));
            ctx.mul(&value, &ctx.gelu_erf(&gate).unwrap()).unwrap()
        };
        let outs = vec![
            (reference(&p), ctx.geglu_host(&p).unwrap().unwrap()),
            (reference(&view), ctx.geglu_host(&view).unwrap().unwrap()),
        ];
        assert!(ctx.geglu_host(&odd).unwrap().is_none());
        let (custom, values) = compute_pairs(&ctx, &outs, threads);
        assert_eq!(custom, 2);
        assert_within_scale(values, 1e-6, threads);
        ctx.set_host_kernels(false);
        assert!(ctx.geglu_host(&p).unwrap().is_none());
        drop(buf);
    }
}

/// `gelu_tanh_host` (one custom op) agrees with GELU's tanh form built from ggml's f32 ops
/// (as the models built it: `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`) to 1e-6 of
/// the values' scale: contiguous, from a view with wider row strides, and times a second
/// tensor (T5's gated form), values reaching both tails, 1 and 3 threads; other shapes,
/// types or no host kernels are `None`.
#[test]
fn host_gelu_tanh_agrees_with_the_formula_in_ggml_ops() {
    for threads in [1, 3] {
        let ctx = Context::new_descriptors(96, 96, 1).unwrap();
        ctx.set_host_kernels(true);
        let (inner, tokens, b) = (48, 29, 2);
        let x = ctx.new_tensor(DType::F32, &[inner, tokens, b]).unwrap();
        let times = ctx.new_tensor(DType::F32, &[inner, tokens, b]).unwrap();
        let wide = ctx
            .new_tensor(DType::F32, &[inner + 10, tokens, b])
            .unwrap();
        let half = ctx.new_tensor(DType::F16, &[inner, tokens, b]).unwrap();
        let buf = BufferType::cpu().alloc_context_tensors(&ctx).unwrap();
        x.write_f32(
            &rnd(x.nelements(), 71)
                .iter()
                .map(|v| 8.0 * v)
                .collect::<Vec<_>>(),
        )
        .unwrap();
        times.write_f32(&rnd(times.nelements(), 72)).unwrap();
        wide.write_f32(
            &rnd(wide.nelements(), 73)
                .iter()
                .map(|v| 5.0 * v)
                .collect::<Vec<_>>(),
        )
        .unwrap();
        let nb = wide.nb();
        let view = ctx
            .view(&wide, [inner, tokens, b, 1], [nb[1], nb[2], nb[3]], 4)
            .unwrap();
        let formula = |t: &GTensor| {
            let t = ctx.cont(t).unwrap();
            let cube = ctx.mul(&ctx.mul(&t, &t).unwrap(), &t).unwrap();
            let inner = ctx.add(&t, &ctx.scale(&cube, 0.044715).unwrap()).unwrap();
            let th = ctx
                .tanh(
                    &ctx.scale(&inner, (2.0f32 / std::f32::consts::PI).sqrt())
                        .unwrap(),
                )
                .unwrap();
            let halfx = ctx.scale(&t, 0.5).unwrap();
            ctx.add(&halfx, &ctx.mul(&halfx, &th).unwrap()).unwrap()
        };
        let outs = vec![
            (formula(&x), ctx.gelu_tanh_host(&x, None).unwrap().unwrap()),
            (
                formula(&view),
                ctx.gelu_tanh_host(&view, None).unwrap().unwrap(),
            ),
            (
                ctx.mul(&formula(&x), &times).unwrap(),
                ctx.gelu_tanh_host(&x, Some(&times)).unwrap().unwrap(),
            ),
        ];
        assert!(ctx.gelu_tanh_host(&half, None).unwrap().is_none());
        assert!(ctx.gelu_tanh_host(&x, Some(&wide)).unwrap().is_none());
        let (custom, values) = compute_pairs(&ctx, &outs, threads);
        assert_eq!(custom, 3);
        assert_within_scale(values, 1e-6, threads);
        ctx.set_host_kernels(false);
        assert!(ctx.gelu_tanh_host(&x, None).unwrap().is_none());
        drop(buf);
    }
}

/// `group_norm_host` (one custom op: the norm, its per-channel scale and shift, and the
/// SiLU when asked) agrees with ggml's `group_norm`, a broadcast `mul` and `add`, and
/// `silu`, to 2e-6 of the values' scale: groups of one and of several channels, planes of
/// 35 values (not a multiple of the kernel's 16 lanes) and of 64, inputs off zero (a mean
/// the two-pass variance must subtract), 1 and 3 threads; without host kernels, or for a
/// non-contiguous input, it is `None`; channels that do not split into the groups are an
/// error.
#[test]
fn host_group_norm_agrees_with_ggmls_norm_affine_and_silu() {
    for threads in [1, 3] {
        for (w, h, c, n, groups) in [(7, 5, 6, 2, 3), (8, 8, 32, 2, 32), (8, 8, 64, 1, 8)] {
            let ctx = Context::new_descriptors(64, 64, 1).unwrap();
            let x = ctx.new_tensor(DType::F32, &[w, h, c, n]).unwrap();
            let scale = ctx.new_tensor(DType::F32, &[c]).unwrap();
            let shift = ctx.new_tensor(DType::F32, &[c]).unwrap();
            let buf = BufferType::cpu().alloc_context_tensors(&ctx).unwrap();
            let v: Vec<f32> = rnd(x.nelements(), 71)
                .iter()
                .map(|x| 3.0 * x + 5.0)
                .collect();
            x.write_f32(&v).unwrap();
            scale.write_f32(&rnd(c, 72)).unwrap();
            shift.write_f32(&rnd(c, 73)).unwrap();
            let eps = 1e-5;
            let as_channels = |t: &GTensor| ctx.reshape(t, &[1, 1, c, 1]).unwrap();
            let reference = |silu: bool| {
                let y = ctx.group_norm(&x, groups, eps).unwrap();
                let y = ctx.mul(&y, &as_channels(&scale)).unwrap();
                let y = ctx.add(&y, &as_channels(&shift)).unwrap();
                if silu {
                    ctx.silu(&y).unwrap()
                } else {
                    y
                }
            };
            ctx.set_host_kernels(true);
            let host = |silu: bool| {
                ctx.group_norm_host(&x, groups, eps, &scale, &shift, silu)
                    .unwrap()
                    .unwrap()
            };
            let outs = vec![
                (reference(false), host(false)),
                (reference(true), host(true)),
            ];
            let t = ctx.transpose(&x).unwrap();
            assert!(ctx
                .group_norm_host(&t, groups, eps, &scale, &shift, true)
                .unwrap()
                .is_none());
            assert!(ctx
                .group_norm_host(&x, 5, eps, &scale, &shift, true)
                .is_err());
            let (custom, values) = compute_pairs(&ctx, &outs, threads);
            assert_eq!(custom, 2);
            for (i, (a, g)) in values.into_iter().enumerate() {
                let scale = a.iter().fold(1f32, |m, v| m.max(v.abs()));
                assert!(
                    max_abs(&a, &g) <= 2e-6 * scale,
                    "{w}x{h}x{c}x{n} / {groups}, case {i}, {threads} threads: max diff {} (scale {scale})",
                    max_abs(&a, &g)
                );
            }
            ctx.set_host_kernels(false);
            assert!(ctx
                .group_norm_host(&x, groups, eps, &scale, &shift, false)
                .unwrap()
                .is_none());
            drop(buf);
        }
    }
}

/// `channel_affine` on the crate's CPU kernel gives the bits of ggml's broadcast `mul` then
/// `add`, for per-channel and per-sample scales and shifts, either alone, 1 and 3 threads;
/// a shape that fits neither is an error.
#[test]
fn host_channel_affine_equals_ggmls_mul_add_bit_for_bit() {
    let (w, h, c, n) = (7, 5, 6, 2);
    for threads in [1, 3] {
        let mut outs = Vec::new();
        let ctx = Context::new_descriptors(64, 64, 1).unwrap();
        let x = ctx.new_tensor(DType::F32, &[w, h, c, n]).unwrap();
        let s1 = ctx.new_tensor(DType::F32, &[c]).unwrap();
        let b1 = ctx.new_tensor(DType::F32, &[c]).unwrap();
        let s2 = ctx.new_tensor(DType::F32, &[c, n]).unwrap();
        let b2 = ctx.new_tensor(DType::F32, &[c, n]).unwrap();
        let bad = ctx.new_tensor(DType::F32, &[c + 1]).unwrap();
        let buf = BufferType::cpu().alloc_context_tensors(&ctx).unwrap();
        for (i, t) in [&x, &s1, &b1, &s2, &b2, &bad].into_iter().enumerate() {
            t.write_f32(&rnd(t.nelements(), 40 + i as u64)).unwrap();
        }
        let combos: [(Option<&GTensor>, Option<&GTensor>); 5] = [
            (Some(&s1), Some(&b1)),
            (Some(&s2), Some(&b2)),
            (Some(&s1), None),
            (None, Some(&b2)),
            (Some(&s2), Some(&b1)),
        ];
        for (s, b) in combos {
            ctx.set_host_kernels(false);
            let want = ctx.channel_affine(&x, s, b).unwrap();
            ctx.set_host_kernels(true);
            let got = ctx.channel_affine(&x, s, b).unwrap();
            outs.push((want, got));
        }
        assert!(ctx.channel_affine(&x, Some(&bad), None).is_err());
        let (custom, values) = compute_pairs(&ctx, &outs, threads);
        assert_eq!(custom, outs.len(), "the host kernel was not used");
        for (i, (a, b)) in values.into_iter().enumerate() {
            let same = a.iter().zip(&b).all(|(p, q)| p.to_bits() == q.to_bits());
            assert!(
                same,
                "combo {i}, {threads} threads: max diff {}",
                max_abs(&a, &b)
            );
        }
        drop(buf);
    }
}

/// `conv_2d_cwh` on the crate's CPU kernel (products straight over the padded pieces) agrees
/// with its ggml-ops form (concatenation, window copies, batched product) to f32 rounding:
/// 1x1, 3x3 and 5x5 kernels, one to three pieces, with and without bias, LeakyReLU and a
/// padded output, outputs of several bands per thread and fewer rows than threads, 1 and 3
/// threads; pieces whose channels do not add up to the kernel's are an error.
#[test]
fn host_channels_innermost_convolution_agrees_with_ggmls_ops() {
    // (kernel size, channels of the pieces, output channels, output w, h, bias, slope, padded)
    type Case = (
        usize,
        Vec<usize>,
        usize,
        [usize; 2],
        bool,
        Option<f32>,
        bool,
    );
    let cases: Vec<Case> = vec![
        (3, vec![5], 4, [9, 7], true, Some(0.2), false),
        (3, vec![6, 3, 3], 8, [11, 6], true, Some(0.2), true),
        (1, vec![6], 3, [5, 4], false, None, false),
        (5, vec![2, 3], 3, [8, 9], true, None, true),
        (3, vec![16, 8], 64, [128, 30], true, Some(0.2), false),
        (3, vec![2], 2, [4, 2], false, Some(0.1), true),
    ];
    for threads in [1, 3] {
        let ctx = Context::new_descriptors(256, 256, 1).unwrap();
        let mut inputs = Vec::new();
        for (k, chans, oc, [w, h], _, _, _) in &cases {
            let c: usize = chans.iter().sum();
            let kernel = ctx.new_tensor(DType::F32, &[*k, *k, c, *oc]).unwrap();
            let bias = ctx.new_tensor(DType::F32, &[*oc]).unwrap();
            let pieces: Vec<GTensor> = chans
                .iter()
                .map(|&cj| ctx.new_tensor(DType::F32, &[cj, *w, *h, 1]).unwrap())
                .collect();
            inputs.push((kernel, bias, pieces));
        }
        let buf = BufferType::cpu().alloc_context_tensors(&ctx).unwrap();
        let mut seed = 90;
        let mut outs = Vec::new();
        for ((k, _, _, _, with_bias, slope, padded), (kernel, bias, pieces)) in
            cases.iter().zip(&inputs)
        {
            for t in std::iter::once(kernel).chain([bias]).chain(pieces) {
                seed += 1;
                t.write_f32(&rnd(t.nelements(), seed)).unwrap();
            }
            let p = (k - 1) / 2;
            let padded_pieces: Vec<GTensor> = pieces
                .iter()
                .map(|t| ctx.pad_ext(t, [(0, 0), (p, p), (p, p), (0, 0)]).unwrap())
                .collect();
            let refs: Vec<&GTensor> = padded_pieces.iter().collect();
            let bias = with_bias.then_some(bias);
            ctx.set_host_kernels(false);
            let want = ctx
                .conv_2d_cwh(kernel, &refs, bias, *slope, *padded)
                .unwrap();
            ctx.set_host_kernels(true);
            let got = ctx
                .conv_2d_cwh(kernel, &refs, bias, *slope, *padded)
                .unwrap();
            assert_eq!(want.ne(), got.ne());
            outs.push((want, got));
            if refs.len() > 1 {
                assert!(ctx
                    .conv_2d_cwh(kernel, &refs[1..], bias, None, false)
                    .is_err());
            }
        }
        let (custom, values) = compute_pairs(&ctx, &outs, threads);
        assert_eq!(custom, cases.len(), "the host kernel was not used");
        for (i, (a, b)) in values.into_iter().enumerate() {
            let scale = a.iter().fold(0f32, |m, v| m.max(v.abs()));
            assert!(scale > 0.0);
            let diff = max_abs(&a, &b);
            assert!(
                diff <= 1e-5 * scale,
                "case {i}, {threads} threads: max diff {diff} (values up to {scale})"
            );
            if cases[i].6 {
                // The padded output's border is zero.
                let (oc, [w, _]) = (cases[i].2, cases[i].3);
                let p = (cases[i].0 - 1) / 2;
                assert!(b[..(w + 2 * p) * oc * p].iter().all(|v| *v == 0.0));
            }
        }
        drop(buf);
    }
}

/// `attention_host` (the crate's CPU attention kernel) against attention computed here in
/// f64: one to eight heads, value widths unlike the key width, several query blocks and one,
/// two batch items, q, k and v read in place from one fused `[q | k | v]` projection (row
/// strides wider than the operand), 1 and 3 threads, f32 and (where the CPU has AVX512-BF16)
/// bf16 products (on AMX tiles where it also has AMX-BF16); a mismatched shape is `None`.
#[test]
fn host_attention_matches_softmax_attention() {
    // (heads, d, dv, n_q, n_kv)
    let cases = [
        (1, 8, 8, 5, 7),
        (2, 16, 8, 300, 77),
        (8, 40, 40, 70, 1000),
        (2, 64, 64, 40, 300),
        (3, 4, 12, 9, 2048),
    ];
    let b = 2;
    let has_bf16 = cfg!(target_arch = "x86_64") && {
        #[cfg(target_arch = "x86_64")]
        {
            std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512bf16")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    };
    for (threads, bf16) in [(1, false), (3, false), (1, true), (3, true)] {
        for (i, &(heads, d, dv, nq, nkv)) in cases.iter().enumerate() {
            let ctx = Context::new_descriptors(32, 32, 1).unwrap();
            ctx.set_bf16_attention(bf16);
            let width = 2 * heads * d + heads * dv;
            // q from the first rows, k and v from the same fused tensor (n_kv rows).
            let fused_q = ctx.new_tensor(DType::F32, &[width, nq, b]).unwrap();
            let fused_kv = ctx.new_tensor(DType::F32, &[width, nkv, b]).unwrap();
            let buf = BufferType::cpu().alloc_context_tensors(&ctx).unwrap();
            let qv = rnd(fused_q.nelements(), 200 + i as u64);
            let kvv = rnd(fused_kv.nelements(), 300 + i as u64);
            fused_q.write_f32(&qv).unwrap();
            fused_kv.write_f32(&kvv).unwrap();
            let view = |t: &GTensor, off: usize, w: usize, n: usize| {
                let nb = t.nb();
                ctx.view(t, [w, n, b, 1], [nb[1], nb[2], nb[3]], off * 4)
                    .unwrap()
            };
            let q = view(&fused_q, 0, heads * d, nq);
            let k = view(&fused_kv, heads * d, heads * d, nkv);
            let v = view(&fused_kv, 2 * heads * d, heads * dv, nkv);
            let scale = 1.0 / (d as f32).sqrt();
            assert!(
                ctx.attention_host(&q, &v, &v, heads, scale)
                    .unwrap()
                    .is_none()
                    || d == dv
            );
            let out = ctx
                .attention_host(&q, &k, &v, heads, scale)
                .unwrap()
                .unwrap();
            assert_eq!(out.ne(), [heads * dv, nq, b, 1]);
            let (custom, values) = compute_pairs(&ctx, &[(out.clone(), out)], threads);
            assert_eq!(custom, 1);
            let got = &values[0].0;
            let mut worst = 0f64;
            for bi in 0..b {
                for h in 0..heads {
                    for i_q in 0..nq {
                        let qrow = &qv[(bi * nq + i_q) * width + h * d..][..d];
                        let scores: Vec<f64> = (0..nkv)
                            .map(|j| {
                                let krow = &kvv[(bi * nkv + j) * width + heads * d + h * d..][..d];
                                let dot: f64 = qrow
                                    .iter()
                                    .zip(krow)
                                    .map(|(a, c)| *a as f64 * *c as f64)
                                    .sum();
                                dot * scale as f64
                            })
                            .collect();
                        let max = scores.iter().cloned().fold(f64::MIN, f64::max);
                        let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                        let sum: f64 = e.iter().sum();
                        for c in 0..dv {
                            let want: f64 = (0..nkv)
                                .map(|j| {
                                    e[j] * kvv[(bi * nkv + j) * width + 2 * heads * d + h * dv + c]
                                        as f64
                                })
                                .sum::<f64>()
                                / sum;
                            let g = got[(bi * nq + i_q) * heads * dv + h * dv + c] as f64;
                            worst = worst.max((g - want).abs());
                        }
                    }
                }
            }
            // bf16 products (where the CPU has them): Q, K, V and the numerators rounded to
            // bf16 (8 bits of mantissa); otherwise f32.
            let tol = if bf16 && has_bf16 { 5e-3 } else { 2e-5 };
            assert!(
                worst < tol,
                "case {i}, {threads} threads, bf16 {bf16}: max error {worst}"
            );
            if bf16 && has_bf16 {
                // The bf16 products ran (their rounding shows).
                assert!(
                    worst > 2e-5,
                    "case {i}: bf16 attention gave f32's error {worst}"
                );
            }
            drop(buf);
        }
    }
}

/// bf16 weights on AMX tiles, where the CPU has AMX-BF16 (skipped elsewhere): linear layers
/// (bf16 and q8_0 weights) with fewer and with more than 512 output features (the tokens, then the weight as the
/// tiles' rows; the latter from 32 tokens on), token counts that are not multiples of 32,
/// and convolutions (3x3 and 1x1,
/// 32 and 64 output channels, several images whose pixel counts are not multiples of 32;
/// over wide images without an im2col: channel counts that are not multiples of 32, an odd
/// one, several blocks of rows) agree with ggml's f32 ops on the same bf16 values to f32
/// rounding, with and without a bias, 1 and 3 threads: one custom op a linear layer, two a
/// convolution with an im2col (the bf16 im2col and the tile product with its epilogue), one
/// without.
#[test]
fn amx_tiles_agree_with_ggmls_f32_ops_on_bf16_values() {
    if !sd_tensor::ggml::cpu_amx_bf16() {
        eprintln!("skipped: this CPU has no AMX-BF16 tiles");
        return;
    }
    let bf = |v: Vec<f32>| -> Vec<f32> {
        v.iter()
            .map(|x| half::bf16::from_f32(*x).to_f32())
            .collect()
    };
    let check = |what: String, custom: usize, expected: usize, values: PairValues| {
        assert_eq!(custom, expected, "{what}: custom ops");
        for (a, b) in values {
            let scale = a.iter().fold(1f32, |m, v| m.max(v.abs()));
            assert!(a.iter().any(|v| *v != 0.0), "{what}");
            assert!(
                max_abs(&a, &b) <= 1e-5 * scale,
                "{what}: max diff {} (scale {scale})",
                max_abs(&a, &b)
            );
        }
    };
    // (the second, fourth and fifth: 512 features or more, from one block of 32 tokens on).
    // q8_0 weights (`sd --type q8_0`) take the same products, each block of rows converted
    // to bf16: the reference multiplies ggml's dequantized values rounded to bf16; the
    // fourth (fewer tokens than features) and fifth (rows wider than 2048) take chunks of
    // the weight's rows, each thread packing every token.
    for (i, (k, m, cols)) in [
        (64, 96, 515),
        (96, 512, 520),
        (320, 320, 600),
        (64, 512, 40),
        (2080, 544, 600),
    ]
    .into_iter()
    .enumerate()
    {
        for (threads, wt) in [
            (1, DType::BF16),
            (3, DType::BF16),
            (1, DType::Q8_0),
            (3, DType::Q8_0),
        ] {
            let ctx = Context::new_descriptors(32, 32, 1).unwrap();
            ctx.set_host_kernels(true);
            let w = ctx.new_tensor(wt, &[k, m]).unwrap();
            let w32 = ctx.new_tensor(DType::F32, &[k, m]).unwrap();
            let b = ctx.new_tensor(DType::F32, &[m]).unwrap();
            let x = ctx.new_tensor(DType::F32, &[k, cols]).unwrap();
            let buf = BufferType::cpu().alloc_context_tensors(&ctx).unwrap();
            let wv = bf(rnd(k * m, 41 + i as u64));
            w.write_f32(&wv).unwrap();
            let wv = bf(w.read_f32().unwrap());
            w32.write_f32(&wv).unwrap();
            b.write_f32(&rnd(m, 42 + i as u64)).unwrap();
            x.write_f32(&bf(rnd(k * cols, 43 + i as u64))).unwrap();
            let reference = ctx.mul_mat(&w32, &x).unwrap();
            let with_bias = ctx.add(&reference, &b).unwrap();
            let outs = vec![
                (reference, ctx.linear(&w, &x, None).unwrap()),
                (with_bias, ctx.linear(&w, &x, Some(&b)).unwrap()),
            ];
            let (custom, values) = compute_pairs(&ctx, &outs, threads);
            check(
                format!("linear {wt:?} {k}->{m} x{cols} threads {threads}"),
                custom,
                2,
                values,
            );
            drop(buf);
        }
    }
    // (kernel w, h, in ch, out ch), input (w, h, n), pad, custom ops: two convolutions of
    // two ops (bf16 im2col, tile product) or, for images at least 64 padded columns wide
    // and 1x1 kernels, of one (the implicit tile product: no im2col).
    let convs: [([usize; 4], [usize; 3], usize, usize); 6] = [
        ([3, 3, 32, 32], [13, 11, 2], 1, 4),
        ([1, 1, 64, 64], [7, 9, 3], 0, 2),
        ([3, 3, 32, 64], [40, 3, 1], 1, 4),
        // Implicit: channels padded to 64, an odd channel count, two images.
        ([3, 3, 48, 32], [70, 5, 2], 1, 2),
        ([3, 3, 33, 32], [66, 4, 1], 1, 2),
        // Implicit: two blocks of output rows (2 MiB of packed input rows a block).
        ([3, 3, 512, 32], [64, 40, 1], 1, 2),
    ];
    for (i, (kn, xn, pad, ops)) in convs.into_iter().enumerate() {
        for threads in [1, 3] {
            let ctx = Context::new_descriptors(64, 64, 1).unwrap();
            ctx.set_host_kernels(true);
            let k = ctx.new_tensor(DType::BF16, &kn).unwrap();
            let k32 = ctx.new_tensor(DType::F32, &kn).unwrap();
            let bias = ctx.new_tensor(DType::F32, &[kn[3]]).unwrap();
            let x = ctx
                .new_tensor(DType::F32, &[xn[0], xn[1], kn[2], xn[2]])
                .unwrap();
            let buf = BufferType::cpu().alloc_context_tensors(&ctx).unwrap();
            let kv = bf(rnd(kn.iter().product(), 51 + i as u64));
            k.write_f32(&kv).unwrap();
            k32.write_f32(&kv).unwrap();
            bias.write_f32(&rnd(kn[3], 52 + i as u64)).unwrap();
            x.write_f32(&bf(rnd(x.nelements(), 53 + i as u64))).unwrap();
            let (s1, p, d1) = ((1, 1), (pad, pad), (1, 1));
            let a = ctx.conv_2d(&k32, &x, s1, p, d1, true).unwrap();
            let with_bias = ctx
                .add(&a, &ctx.reshape(&bias, &[1, 1, kn[3], 1]).unwrap())
                .unwrap();
            let outs = vec![
                (a, ctx.conv_2d_host(&k, &x, None, s1, p, d1, false).unwrap()),
                (
                    with_bias,
                    ctx.conv_2d_host(&k, &x, Some(&bias), s1, p, d1, false)
                        .unwrap(),
                ),
            ];
            let (custom, values) = compute_pairs(&ctx, &outs, threads);
            check(
                format!("conv {kn:?} over {xn:?} threads {threads}"),
                custom,
                ops,
                values,
            );
            drop(buf);
        }
    }
}

/// With a band limit (`Context::set_band_bytes`), `conv_2d` computes a convolution whose
/// im2col exceeds it in bands of output rows (the input padded once, the bands
/// concatenated) within f32 rounding of the whole convolution: 3x3 with padding, a 1x1, a
/// dilated rectangular kernel with unequal strides, several images, a channel-strided
/// input, bands of one row, two and 56; under the limit, or where the padded input and the
/// bands' outputs would cost more than the im2col saves (a strided convolution from two
/// channels to sixteen), it is one im2col as before.
#[test]
fn banded_convolutions_equal_whole_ones() {
    // kernel, input (w, h, n), stride, pad, dilation, whether bands pay (the im2col saved
    // exceeds the padded input and the bands' outputs)
    type Case = (
        [usize; 4],
        [usize; 3],
        (usize, usize),
        (usize, usize),
        (usize, usize),
        bool,
    );
    let cases: [Case; 6] = [
        ([3, 3, 64, 32], [64, 64, 1], (1, 1), (1, 1), (1, 1), true),
        ([3, 3, 16, 4], [9, 7, 2], (1, 1), (1, 1), (1, 1), true),
        ([1, 1, 24, 3], [5, 4, 1], (1, 1), (0, 0), (1, 1), true),
        ([5, 3, 12, 3], [11, 9, 1], (1, 2), (2, 1), (1, 2), true),
        ([3, 3, 16, 4], [10, 10, 2], (1, 1), (2, 2), (2, 2), true),
        // A strided convolution from few channels to many: its padded input and output
        // outweigh its im2col.
        ([3, 3, 2, 16], [16, 17, 1], (2, 2), (1, 1), (1, 1), false),
    ];
    for (i, (kn, xn, stride, pad, dil, pays)) in cases.into_iter().enumerate() {
        for (kernel_type, exact) in [(DType::F32, false), (DType::F32, true), (DType::F16, false)] {
            let ctx = Context::new_descriptors(4096, 4096, 1).unwrap();
            let k = ctx.new_tensor(kernel_type, &kn).unwrap();
            let x = ctx
                .new_tensor(DType::F32, &[xn[0], xn[1], kn[2], xn[2]])
                .unwrap();
            let buf = BufferType::cpu().alloc_context_tensors(&ctx).unwrap();
            k.write_f32(&rnd(kn.iter().product(), 21 + i as u64))
                .unwrap();
            x.write_f32(&rnd(xn[0] * xn[1] * kn[2] * xn[2], 5 + i as u64))
                .unwrap();
            // x with channels and images swapped, then viewed back: channel-strided rows.
            let strided = ctx
                .permute(
                    &ctx.cont(&ctx.permute(&x, [0, 1, 3, 2]).unwrap()).unwrap(),
                    [0, 1, 3, 2],
                )
                .unwrap();
            let ext_w = dil.0 * (kn[0] - 1) + 1;
            let ow = (xn[0] + 2 * pad.0 - ext_w) / stride.0 + 1;
            let row = kn[0] * kn[1] * kn[2] * ow * xn[2] * if exact { 4 } else { 2 };
            let mut pairs = Vec::new();
            for input in [&x, &strided] {
                ctx.set_band_bytes(None);
                let whole = ctx.conv_2d(&k, input, stride, pad, dil, exact).unwrap();
                // One row a band, two, and 56 (a short last band).
                for rows in [1, 2, 56] {
                    ctx.set_band_bytes(Some(row * rows));
                    let banded = ctx.conv_2d(&k, input, stride, pad, dil, exact).unwrap();
                    assert_eq!(banded.ne(), whole.ne(), "case {i}");
                    pairs.push((whole.clone(), banded));
                }
            }
            ctx.set_band_bytes(None);
            let (concats, values) = compute_pairs_counting(&ctx, &pairs, 2, "CONCAT", 4096);
            assert_eq!(concats > 0, pays, "case {i}: {concats} concatenations");
            for (a, b) in values {
                assert!(a.iter().any(|v| *v != 0.0));
                // The same products; ggml's CPU matrix product may sum a narrower one in
                // another order (its tiled kernels take some shapes only).
                let scale = a.iter().fold(1f32, |m, v| m.max(v.abs()));
                assert!(
                    max_abs(&a, &b) <= 1e-6 * scale,
                    "case {i} {kernel_type:?} exact {exact}: max diff {}",
                    max_abs(&a, &b)
                );
            }
            drop(buf);
        }
    }
}

/// `Context::geglu`: the first half of each row times the GELU of the second half (erf or
/// tanh form), within f32 rounding of the same computed with views and separate ops; rows
/// of odd width and non-contiguous rows are errors, not aborts.
#[test]
fn geglu_is_the_value_half_times_the_gelu_of_the_gate_half() {
    let ctx = Context::new_descriptors(64, 64, 1).unwrap();
    let p = ctx.new_tensor(DType::F32, &[12, 5, 3]).unwrap();
    let odd = ctx.new_tensor(DType::F32, &[7, 2]).unwrap();
    let buf = BufferType::cpu().alloc_context_tensors(&ctx).unwrap();
    p.write_f32(&rnd(12 * 5 * 3, 9)).unwrap();
    let nb = p.nb();
    let value = ctx
        .cont(
            &ctx.view(&p, [6, 5, 3, 1], [nb[1], nb[2], nb[3]], 0)
                .unwrap(),
        )
        .unwrap();
    let gate = ctx
        .cont(
            &ctx.view(&p, [6, 5, 3, 1], [nb[1], nb[2], nb[3]], 24)
                .unwrap(),
        )
        .unwrap();
    let mut pairs = Vec::new();
    for erf in [true, false] {
        let g = if erf {
            ctx.gelu_erf(&gate)
        } else {
            ctx.gelu(&gate)
        }
        .unwrap();
        let reference = ctx
            .reshape(&ctx.mul(&value, &g).unwrap(), &[6, 5, 3])
            .unwrap();
        pairs.push((reference, ctx.geglu(&p, erf).unwrap()));
    }
    assert!(ctx.geglu(&odd, true).is_err());
    assert!(ctx.geglu(&ctx.transpose(&p).unwrap(), true).is_err());
    let (_, values) = compute_pairs(&ctx, &pairs, 2);
    for (a, b) in values {
        assert!(a.iter().any(|v| *v != 0.0));
        assert!(max_abs(&a, &b) <= 1e-5, "max diff {}", max_abs(&a, &b));
    }
    drop(buf);
}
