//! Times one host convolution (`Context::conv_2d_host`) on the CPU backend, the implicit
//! kernel against the im2col path, on the SD UNet's and VAE's shapes, then one linear layer
//! (`Context::linear`), the crate's kernel against ggml's product:
//! `cargo run --release -p sd-tensor --example conv_probe [threads]`.

#[path = "probe/common.rs"]
mod common;

use common::{conv_seconds, linear_seconds, rate};
use sd_tensor::ggml::{Backend, BufferType};
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
    for shape @ (w, h, c, oc, n, k) in shapes {
        let mut line = format!("{w}x{h} {c}->{oc} n{n} k{k}:");
        let flop = 2.0 * (w * h * n * oc * c * k * k) as f64;
        for implicit in [false, true] {
            let best = conv_seconds(&backend, shape, DType::F16, implicit);
            line += &rate(if implicit { "implicit" } else { "im2col" }, best, flop);
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
        let flop = 2.0 * (k * m * n) as f64;
        for host in [false, true] {
            let best = linear_seconds(
                &backend,
                (k, m, n),
                DType::F16,
                BufferType::cpu(),
                host,
                true,
            );
            line += &rate(if host { "kernel" } else { "ggml" }, best, flop);
        }
        println!("{line}");
    }
}
