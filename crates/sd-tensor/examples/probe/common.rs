//! What the CPU probes (`conv_probe.rs`, `amx_probe.rs`) share: fixed inputs, timing a
//! graph, one convolution and one linear layer on the CPU backend, and a result's format.
//! Included by each with `#[path]` (a directory without `main.rs` is not an example).

use std::time::Instant;

use sd_tensor::ggml::{Backend, BufferType, Context, GTensor, Gallocr, Graph};
use sd_tensor::DType;

/// Fills `t` with fixed values in [-0.5, 0.5) (a multiplicative hash of the index and `seed`).
pub fn fill(t: &GTensor, seed: u32) {
    let v: Vec<f32> = (0..t.nelements())
        .map(|i| {
            ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 8) as f32 / 16777216.0 - 0.5
        })
        .collect();
    t.write_f32(&v).unwrap();
}

/// Allocates the graph of `y` on `backend` and returns its fastest of three computes, in
/// seconds.
pub fn best_of_three(ctx: &Context, y: &GTensor, backend: &Backend) -> f64 {
    y.set_output();
    let mut graph = Graph::new(ctx, 64).unwrap();
    graph.build_forward_expand(y).unwrap();
    let mut galloc = Gallocr::new(backend.buffer_type()).unwrap();
    galloc.alloc_graph(&graph).unwrap();
    (0..3)
        .map(|_| {
            let t = Instant::now();
            backend.compute(&graph).unwrap();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::MAX, f64::min)
}

/// One result: `name`, milliseconds and GFLOP/s for `flop` operations in `seconds`.
pub fn rate(name: &str, seconds: f64, flop: f64) -> String {
    format!(
        "  {name} {:.1} ms {:.0} GFLOP/s",
        seconds * 1e3,
        flop / seconds / 1e9
    )
}

/// The best of three runs of one stride-1 `k x k` convolution `c -> oc` (bias, padding
/// `(k - 1) / 2`) over `n` images of `w x h` (`Context::conv_2d_host`), with a `dtype`
/// kernel and the crate's own products on or off.
pub fn conv_seconds(
    backend: &Backend,
    (w, h, c, oc, n, k): (usize, usize, usize, usize, usize, usize),
    dtype: DType,
    own_products: bool,
) -> f64 {
    let ctx = Context::new_descriptors(16, 64, 1).unwrap();
    ctx.set_host_kernels(true);
    ctx.set_f32_products(own_products);
    let kt = ctx.new_tensor(dtype, &[k, k, c, oc]).unwrap();
    let b = ctx.new_tensor(DType::F32, &[oc]).unwrap();
    let x = ctx.new_tensor(DType::F32, &[w, h, c, n]).unwrap();
    let _buf = BufferType::cpu().alloc_context_tensors(&ctx).unwrap();
    fill(&kt, 1);
    fill(&b, 2);
    fill(&x, 3);
    let p = (k - 1) / 2;
    let y = ctx
        .conv_2d_host(&kt, &x, Some(&b), (1, 1), (p, p), (1, 1), false)
        .unwrap();
    best_of_three(&ctx, &y, backend)
}

/// The best of three runs of one linear layer `k -> m` over `n` tokens (`Context::linear`,
/// with a bias if `bias`), its `dtype` weight in a buffer of `weights`, the crate's own
/// products on or off.
pub fn linear_seconds(
    backend: &Backend,
    (k, m, n): (usize, usize, usize),
    dtype: DType,
    weights: BufferType,
    own_products: bool,
    bias: bool,
) -> f64 {
    let wctx = Context::new_descriptors(4, 8, 1).unwrap();
    let w = wctx.new_tensor(dtype, &[k, m]).unwrap();
    let _wbuf = weights.alloc_context_tensors(&wctx).unwrap();
    let ctx = Context::new_descriptors(16, 64, 1).unwrap();
    ctx.set_host_kernels(true);
    ctx.set_f32_products(own_products);
    let b = ctx.new_tensor(DType::F32, &[m]).unwrap();
    let x = ctx.new_tensor(DType::F32, &[k, n]).unwrap();
    let _buf = BufferType::cpu().alloc_context_tensors(&ctx).unwrap();
    fill(&w, 1);
    fill(&b, 2);
    fill(&x, 3);
    let y = ctx.linear(&w, &x, bias.then_some(&b)).unwrap();
    best_of_three(&ctx, &y, backend)
}
