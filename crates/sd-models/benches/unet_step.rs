//! One SD1.5 (or SDXL) UNet step on the ggml CPU backend, next to the ggml f16 matmul ceiling measured
//! in the same process: the Rust half of `cargo xtask bench unet` (the other half is
//! `scripts/bench/unet_step_diffusers.py`, the same step in diffusers).
//!
//! The UNet is the full SD1.5 config (`UnetConfig::sd1`: 320 channels, mult 1/2/4/4,
//! 2 res blocks, 8 heads, context 768) with random f16 weights (1-D parameters f32), built by
//! [`sd_models::bench::SyntheticUnet`]; the step is a 512x512 image with classifier-free
//! guidance: latents `[2, 4, 64, 64]`, context `[2, 77, 768]`, timestep 500. Numerics are
//! stable-diffusion.cpp's CPU defaults: f16 weights, f32 activations (ggml converts them to
//! f16 inside f16 matmuls; convolutions use f16 im2col), attention by f32 `mul_mat` +
//! softmax (no flash attention), table GELU.
//!
//! FLOPs are counted from the graph ([`sd_models::bench::graph_flops`]: every matrix
//! product, convolutions included). The ceiling is a 2048^3 f16 x f32 `mul_mat`, as
//! `crates/sd-tensor/benches/matmul.rs` measures it, before and after the UNet runs.
//!
//! `SD_BENCH_MODEL=sdxl` runs the SDXL base UNet (`UnetConfig::sdxl`, context 2048, `y` of
//! 2816) at 1024x1024 (latents `[2, 4, 128, 128]`); `SD_BENCH_LATENT=N` sets the latent side.
//!
//! `SD_BENCH_WEIGHTS=bf16` gives the UNet bf16 weights instead of f16 (`sd --type bf16`: on
//! a CPU with AVX512-BF16 the products run on bf16 dot products); the ceiling is then also
//! measured for bf16 weights (`matmul_weights_gflops`).
//!
//! Environment: `SD_BENCH_THREADS` (default 2), `SD_BENCH_REPS` (timed UNet steps after one
//! warm-up, default 2), `SD_BENCH_FLASH_ATTN=1` (ggml's `flash_attn_ext` for attention instead of
//! the default f32 `mul_mat` + softmax). Prints the CPU time per step too (on a shared machine
//! the wall time includes waiting for cores; CPU time does not). Prints human-readable lines and `RESULT key=value` lines for xtask.

use std::time::Instant;

use sd_models::bench::{
    bench_weights, load_average as loadavg, matmul_f16_ceiling as matmul_ceiling,
    process_cpu_seconds as cpu_seconds, report_weights_ceiling, StepShape, SyntheticUnet, UnetStep,
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
    // `cargo bench` passes `--bench`; nothing else is taken.
    let threads = env_usize("SD_BENCH_THREADS", 2);
    let reps = env_usize("SD_BENCH_REPS", 2).max(1);
    let backend = Backend::cpu(threads).expect("CPU backend");
    println!("RESULT threads={threads}");
    println!("RESULT load_start={}", loadavg());

    let ceiling_before = matmul_ceiling(&backend).expect("matmul ceiling");
    println!("ggml f16 matmul 2048^3, {threads} threads: {ceiling_before:.1} GFLOP/s");

    let sdxl = std::env::var("SD_BENCH_MODEL").is_ok_and(|m| m == "sdxl");
    let (label, mut shape) = if sdxl {
        ("SDXL", StepShape::SDXL_1024_CFG)
    } else {
        ("SD1.5", StepShape::SD15_512_CFG)
    };
    let side = env_usize("SD_BENCH_LATENT", shape.width);
    (shape.width, shape.height) = (side, side);
    let weights = bench_weights();
    println!("RESULT weights={}", weights.name());
    let t = Instant::now();
    let unet = if sdxl {
        SyntheticUnet::sdxl_cpu(weights, 1)
    } else {
        SyntheticUnet::sd15_cpu(weights, 1)
    }
    .expect("synthetic UNet");
    println!(
        "{label} UNet, random {} weights: {} tensors, {:.2} GB, built in {:.1} s",
        weights.name(),
        unet.params.tensors.len(),
        unet.params.nbytes() as f64 / 1e9,
        t.elapsed().as_secs_f64()
    );
    let flash_attn = env_usize("SD_BENCH_FLASH_ATTN", 0) != 0;
    // SD_BENCH_HOST_KERNELS=0: ggml's own ops (im2col, attention) only.
    let host_kernels = env_usize("SD_BENCH_HOST_KERNELS", 1) != 0;
    let opts = ComputeOptions {
        exact: false,
        flash_attn,
        host_kernels,
    };
    println!(
        "attention: {}",
        if host_kernels {
            if sd_models::weights::bf16_attention_for(Some(weights), true)
                && std::env::var("SD_BENCH_BF16_ATTENTION").map_or(true, |v| v != "0")
            {
                "the project's CPU kernel (bf16 products, heads in place)"
            } else {
                "the project's CPU kernel (f32, heads in place)"
            }
        } else if flash_attn {
            "flash_attn_ext (K, V in f16)"
        } else {
            "f32 mul_mat + softmax"
        }
    );
    let step = UnetStep::new(&unet.model, shape, opts, &backend).expect("UNet step graph");
    let gflop = step.flops() / 1e9;
    println!(
        "one step (batch 2, {side}x{side} latent, 77x{} context): {gflop:.1} GFLOP",
        unet.model.config.context_dim
    );
    let warm = step.run(&backend).expect("UNet step");
    println!("warm-up step: {warm:.2} s");
    let cpu0 = cpu_seconds();
    let mut times: Vec<f64> = (0..reps)
        .map(|_| step.run(&backend).expect("UNet step"))
        .collect();
    let cpu_per_step = (cpu_seconds() - cpu0) / reps as f64;
    let out = step.output().read_f32().expect("read output");
    assert!(out.iter().all(|v| v.is_finite()), "non-finite UNet output");
    times.sort_by(f64::total_cmp);
    let best = times[0];
    let median = times[times.len() / 2];
    println!(
        "timed steps: {}",
        times
            .iter()
            .map(|t| format!("{t:.2} s"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let ceiling_after = matmul_ceiling(&backend).expect("matmul ceiling");
    println!("ggml f16 matmul 2048^3 after the UNet: {ceiling_after:.1} GFLOP/s");
    let ceiling = ceiling_before.max(ceiling_after);
    let rate = gflop / best;
    println!(
        "ggml UNet step: best {best:.2} s, median {median:.2} s, {rate:.1} GFLOP/s = {:.0}% of the f16 matmul ceiling",
        100.0 * rate / ceiling
    );
    println!(
        "CPU time per timed step: {cpu_per_step:.2} s (wall x threads = {:.2} s when uncontended)",
        median * threads as f64
    );
    println!("RESULT ggml_unet_seconds={best:.4}");
    println!("RESULT ggml_unet_cpu_seconds={cpu_per_step:.4}");
    println!("RESULT ggml_unet_seconds_median={median:.4}");
    println!("RESULT unet_gflop={gflop:.2}");
    println!("RESULT ggml_unet_gflops={rate:.2}");
    println!("RESULT matmul_f16_gflops={ceiling:.2}");
    println!("RESULT matmul_f16_gflops_before={ceiling_before:.2}");
    println!("RESULT matmul_f16_gflops_after={ceiling_after:.2}");
    report_weights_ceiling(&backend, weights, ceiling, rate, "step").expect("matmul ceiling");
    println!("RESULT load_end={}", loadavg());
}
