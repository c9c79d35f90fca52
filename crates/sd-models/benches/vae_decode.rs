//! One SD1.5 VAE decode on the ggml CPU backend, next to the ggml f16 matmul ceiling measured
//! in the same process: the Rust half of `cargo xtask bench vae` (the other half is
//! `scripts/bench/vae_decode_diffusers.py`, the same decode in diffusers).
//!
//! The decoder is the SD1.5 one (`VaeConfig::default`: 128 channels, mult 1/2/4/4, 2 res
//! blocks per level plus one, a mid block with attention) with random f16 weights (1-D
//! parameters f32, [`sd_models::bench::VaeDecode`]), decoding a `[64, 64, 4, 1]` latent into a
//! 512x512 image with the numerics `sd` uses on the CPU: exact activations, f16 im2col for f16
//! kernels, f32 attention, and the project's CPU convolution kernels (`host_kernels`;
//! `SD_BENCH_HOST_KERNELS=0` for ggml's own).
//!
//! `SD_BENCH_WEIGHTS=bf16` decodes with bf16 weights (`sd --type bf16`; bf16 im2col and
//! products), with the bf16 matmul ceiling beside (`matmul_weights_gflops`).
//!
//! Environment: `SD_BENCH_THREADS` (default 2), `SD_BENCH_REPS` (timed decodes after one
//! warm-up, default 2), `SD_BENCH_LATENT` (latent side, default 64). Prints `RESULT
//! key=value` lines for xtask.

use sd_models::bench::{
    bench_weights, load_average, matmul_f16_ceiling, process_cpu_seconds, report_weights_ceiling,
    VaeDecode,
};
use sd_models::ComputeOptions;
use sd_tensor::ggml::Backend;

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() {
    let threads = env_usize("SD_BENCH_THREADS", 2);
    let reps = env_usize("SD_BENCH_REPS", 2).max(1);
    let side = env_usize("SD_BENCH_LATENT", 64);
    let host_kernels = env_usize("SD_BENCH_HOST_KERNELS", 1) != 0;
    let backend = Backend::cpu(threads).expect("CPU backend");
    println!("RESULT load_start={}", load_average());
    let ceiling_before = matmul_f16_ceiling(&backend).expect("matmul ceiling");
    let opts = ComputeOptions {
        exact: true,
        flash_attn: false,
        host_kernels,
    };
    let weights = bench_weights();
    println!("RESULT weights={}", weights.name());
    let decode = VaeDecode::new(weights, side, opts, &backend, 1).expect("VAE decode graph");
    let gflop = decode.flops() / 1e9;
    println!(
        "SD1.5 VAE decode {side}x{side} -> {0}x{0}, {threads} threads, {1} weights, host kernels {host_kernels}: {gflop:.1} GFLOP",
        side * 8,
        weights.name()
    );
    let warm = decode.run(&backend).expect("decode");
    println!("warm-up decode: {warm:.2} s");
    let cpu0 = process_cpu_seconds();
    let mut times: Vec<f64> = (0..reps)
        .map(|_| decode.run(&backend).expect("decode"))
        .collect();
    let cpu = (process_cpu_seconds() - cpu0) / reps as f64;
    let out = decode.output().read_f32().expect("read output");
    assert!(out.iter().all(|v| v.is_finite()), "non-finite VAE output");
    times.sort_by(f64::total_cmp);
    let best = times[0];
    let ceiling = ceiling_before.max(matmul_f16_ceiling(&backend).expect("matmul ceiling"));
    println!(
        "ggml VAE decode: best {best:.2} s, {:.1} GFLOP/s = {:.0}% of the f16 matmul ceiling ({ceiling:.1} GFLOP/s)",
        gflop / best,
        100.0 * gflop / best / ceiling
    );
    println!("RESULT ggml_vae_seconds={best:.4}");
    println!("RESULT ggml_vae_cpu_seconds={cpu:.4}");
    println!("RESULT vae_gflop={gflop:.2}");
    println!("RESULT matmul_f16_gflops={ceiling:.2}");
    report_weights_ceiling(&backend, weights, ceiling, gflop / best, "decode")
        .expect("matmul ceiling");
    println!("RESULT load_end={}", load_average());
}
