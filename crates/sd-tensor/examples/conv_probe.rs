//! Times one host convolution (`Context::conv_2d_host`) on the CPU backend, the implicit
//! kernel against the im2col path, on the SD UNet's and VAE's shapes, then one linear layer
//! (`Context::linear`), the crate's kernel against ggml's product:
//! `cargo run --release -p sd-tensor --example conv_probe [threads]`.

use std::time::Instant;

use sd_tensor::ggml::{Backend, BufferType, Context, GTensor, Gallocr, Graph};
use sd_tensor::DType;

fn main() {
    let threads: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(2);
    // (w, h, c, oc, n, k)
    let shapes = [
        (64, 64, 320, 320, 2, 3),
        (64, 64, 960, 320, 2, 3),
        (64, 64, 640, 320, 2, 3),
        (64, 64, 960, 320, 2, 1),
        (32, 32, 640, 640, 2, 3),
        (16, 16, 1280, 1280, 2, 3),
        (64, 64, 320, 320, 2, 1),
        (32, 32, 640, 640, 2, 1),
        (16, 16, 1280, 1280, 2, 1),
        (64, 64, 4, 320, 2, 3),
        (64, 64, 320, 4, 2, 3),
        (128, 128, 512, 512, 1, 3),
        (256, 256, 256, 256, 1, 3),
        (512, 512, 128, 128, 1, 3),
    ];
    let backend = Backend::cpu(threads).unwrap();
    for (w, h, c, oc, n, k) in shapes {
        let mut line = format!("{w}x{h} {c}->{oc} n{n} k{k}:");
        for implicit in [false, true] {
            let ctx = Context::new_descriptors(16, 64, 1).unwrap();
            ctx.set_host_kernels(true);
            ctx.set_f32_products(implicit);
            let kt = ctx.new_tensor(DType::F16, &[k, k, c, oc]).unwrap();
            let b = ctx.new_tensor(DType::F32, &[oc]).unwrap();
            let x = ctx.new_tensor(DType::F32, &[w, h, c, n]).unwrap();
            let buf = BufferType::cpu().alloc_context_tensors(&ctx).unwrap();
            fill(&kt, 1);
            fill(&b, 2);
            fill(&x, 3);
            let p = (k - 1) / 2;
            let y = ctx
                .conv_2d_host(&kt, &x, Some(&b), (1, 1), (p, p), (1, 1), false)
                .unwrap();
            let best = best_of_three(&ctx, &y, &backend);
            let flop = 2.0 * (w * h * n * oc * c * k * k) as f64;
            line += &format!(
                "  {} {:.1} ms {:.0} GFLOP/s",
                if implicit { "implicit" } else { "im2col" },
                best * 1e3,
                flop / best / 1e9
            );
            drop(buf);
        }
        println!("{line}");
    }
    // (K, M, N): the SD1.5 UNet's projections and feed-forwards at 64x64 and 32x32 (batch 2).
    for (k, m, n) in [
        (320, 320, 8192),
        (320, 2560, 8192),
        (1280, 320, 8192),
        (640, 640, 2048),
        (640, 5120, 2048),
        (2560, 640, 2048),
    ] {
        let mut line = format!("linear {k}->{m} n{n}:");
        for host in [false, true] {
            let ctx = Context::new_descriptors(16, 64, 1).unwrap();
            ctx.set_host_kernels(true);
            ctx.set_f32_products(host);
            let w = ctx.new_tensor(DType::F16, &[k, m]).unwrap();
            let b = ctx.new_tensor(DType::F32, &[m]).unwrap();
            let x = ctx.new_tensor(DType::F32, &[k, n]).unwrap();
            let buf = BufferType::cpu().alloc_context_tensors(&ctx).unwrap();
            fill(&w, 1);
            fill(&b, 2);
            fill(&x, 3);
            let y = ctx.linear(&w, &x, Some(&b)).unwrap();
            let best = best_of_three(&ctx, &y, &backend);
            let flop = 2.0 * (k * m * n) as f64;
            line += &format!(
                "  {} {:.1} ms {:.0} GFLOP/s",
                if host { "kernel" } else { "ggml" },
                best * 1e3,
                flop / best / 1e9
            );
            drop(buf);
        }
        println!("{line}");
    }
}

/// Fills `t` with fixed values in [-0.5, 0.5) (a multiplicative hash of the index and `seed`).
fn fill(t: &GTensor, seed: u32) {
    let v: Vec<f32> = (0..t.nelements())
        .map(|i| {
            ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 8) as f32 / 16777216.0 - 0.5
        })
        .collect();
    t.write_f32(&v).unwrap();
}

/// Allocates the graph of `y` on `backend` and returns its fastest of three computes, in
/// seconds.
fn best_of_three(ctx: &Context, y: &GTensor, backend: &Backend) -> f64 {
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
