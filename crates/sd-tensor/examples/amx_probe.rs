//! Times one matrix product `W x` (weights `[K, N]`, activations `[K, M]` f32) on the CPU
//! backend four ways: ggml's f16 product, this crate's f32 product of f16 weights
//! (`Context::linear`), ggml's q8_0 product, and ggml's q8_0 product with the weights in the
//! CPU's `AMX` buffer type (int8 tiles), on the SD UNet's linear and convolution shapes:
//! `cargo run --release -p sd-tensor --example amx_probe [threads] [products|attention|conv|flux]`
//! (a part alone; the first three by default; `flux`: FLUX.1's linear layers over the 1536
//! tokens of a 512x512 image on tiles, bf16 and q8_0 weights, and its attention).

#[path = "probe/common.rs"]
mod common;

use common::{best_of_three, conv_seconds, fill, linear_seconds, rate};
use sd_tensor::ggml::{Backend, BufferType, Context};
use sd_tensor::DType;

/// (K, N, M): projections, feed-forwards and 3x3 convolutions as products (K = 9 C).
const PRODUCTS: [(usize, usize, usize); 9] = [
    (320, 320, 8192),
    (320, 2560, 8192),
    (1280, 320, 8192),
    (640, 5120, 2048),
    (2560, 640, 2048),
    (2880, 320, 8192),
    (5760, 640, 2048),
    (11520, 1280, 512),
    (2048, 2048, 2048),
];

/// (K, N, M) of FLUX.1's linear layers at 512x512 (1024 image and 512 text tokens):
/// attention projections, MLP up and down, a single block's `linear1` and `linear2`.
const FLUX_PRODUCTS: [(usize, usize, usize); 5] = [
    (3072, 3072, 1536),
    (3072, 12288, 1024),
    (12288, 3072, 1024),
    (3072, 21504, 1536),
    (15360, 3072, 1536),
];

fn main() {
    let threads: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(2);
    let part = std::env::args().nth(2);
    let runs = |name: &str| part.as_deref().is_none_or(|p| p == name);
    let extra: Vec<String> = BufferType::cpu_extra().iter().map(|b| b.name()).collect();
    println!("CPU extra buffer types: {extra:?}");
    let amx = BufferType::cpu_amx();
    // ggml's AMX product faults in this ggml release (see `host_amx.rs`): asked for only.
    let ggml_amx = std::env::var("PROBE_GGML_AMX").is_ok_and(|v| v == "1");
    let backend = Backend::cpu(threads).unwrap();
    let products = if runs("products") { &PRODUCTS[..] } else { &[] };
    for &(k, n, m) in products {
        let mut line = format!("{k}->{n} x{m}:");
        let flop = 2.0 * (k * n * m) as f64;
        let cases: Vec<(&str, DType, BufferType, bool)> = [
            ("ggml f16", DType::F16, BufferType::cpu(), false),
            ("f32 kernel", DType::F16, BufferType::cpu(), true),
            ("ggml q8_0", DType::Q8_0, BufferType::cpu(), false),
            ("ggml bf16", DType::BF16, BufferType::cpu(), false),
            ("tiles bf16", DType::BF16, BufferType::cpu(), true),
        ]
        .into_iter()
        .chain(
            amx.filter(|_| ggml_amx)
                .map(|b| ("ggml AMX q8_0", DType::Q8_0, b, false)),
        )
        .collect();
        for (name, dtype, buft, f32_products) in cases {
            let best = linear_seconds(&backend, (k, n, m), dtype, buft, f32_products, false);
            line += &rate(name, best, flop);
        }
        println!("{line}");
    }
    // SD1.5 self-attention at 64x64 and 32x32 latents (batch 2): f32 products, then bf16
    // (tiles where the CPU has AMX-BF16 and `SD_AMX` is not 0, else AVX512-BF16).
    if part.as_deref() == Some("flux") {
        for &(k, n, m) in &FLUX_PRODUCTS {
            let mut line = format!("{k}->{n} x{m}:");
            let flop = 2.0 * (k * n * m) as f64;
            for (name, dtype) in [("tiles bf16", DType::BF16), ("tiles q8_0", DType::Q8_0)] {
                let best =
                    linear_seconds(&backend, (k, n, m), dtype, BufferType::cpu(), true, false);
                line += &rate(name, best, flop);
            }
            println!("{line}");
        }
    }
    let attentions = match part.as_deref() {
        None | Some("attention") => &[(8, 40, 4096), (8, 80, 1024)][..],
        Some("flux") => &[(24, 128, 1536)][..],
        _ => &[],
    };
    for &(heads, d, n) in attentions {
        let mut line = format!("attention {heads}x{d} over {n}:");
        // Two products of 2 n n d per head and image.
        let flop = 2.0 * heads as f64 * 4.0 * (n * n * d) as f64;
        for bf16 in [false, true] {
            let ctx = Context::new_descriptors(16, 64, 1).unwrap();
            ctx.set_bf16_attention(bf16);
            let q = ctx.new_tensor(DType::F32, &[heads * d, n, 2]).unwrap();
            let k = ctx.new_tensor(DType::F32, &[heads * d, n, 2]).unwrap();
            let v = ctx.new_tensor(DType::F32, &[heads * d, n, 2]).unwrap();
            let buf = BufferType::cpu().alloc_context_tensors(&ctx).unwrap();
            fill(&q, 1);
            fill(&k, 2);
            fill(&v, 3);
            let scale = 1.0 / (d as f32).sqrt();
            let y = ctx
                .attention_host(&q, &k, &v, heads, scale)
                .unwrap()
                .unwrap();
            let best = best_of_three(&ctx, &y, &backend);
            line += &rate(if bf16 { "bf16" } else { "f32" }, best, flop);
            drop(buf);
        }
        println!("{line}");
    }
    let convs = if runs("conv") { &CONVS[..] } else { &[] };
    for &shape in convs {
        conv(&backend, shape);
    }
}

/// (w, h, c, oc, n, k) of the convolutions timed.
const CONVS: [(usize, usize, usize, usize, usize, usize); 7] = [
    (64, 64, 320, 320, 2, 3),
    (64, 64, 960, 320, 2, 3),
    (32, 32, 640, 640, 2, 3),
    (16, 16, 1280, 1280, 2, 3),
    (128, 128, 512, 512, 1, 3),
    (256, 256, 256, 256, 1, 3),
    (512, 512, 128, 128, 1, 3),
];

/// Times one 3x3 (or 1x1) convolution `c -> oc` over `n` images of `w x h`: f16 kernels on
/// this crate's implicit f32 kernel, bf16 kernels on ggml's product (after the bf16 im2col)
/// and on tiles.
fn conv(backend: &Backend, shape: (usize, usize, usize, usize, usize, usize)) {
    let (w, h, c, oc, n, k) = shape;
    let mut line = format!("conv {w}x{h} {c}->{oc} n{n} k{k}:");
    let flop = 2.0 * (w * h * n * oc * c * k * k) as f64;
    for (name, dtype, own) in [
        ("f16 implicit", DType::F16, true),
        ("ggml bf16", DType::BF16, false),
        ("tiles bf16", DType::BF16, true),
    ] {
        line += &rate(name, conv_seconds(backend, shape, dtype, own), flop);
    }
    println!("{line}");
}
