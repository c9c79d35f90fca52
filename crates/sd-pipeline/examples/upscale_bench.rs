//! Benchmark body of `cargo xtask bench upscale`: tiled upscaling of a random image with a
//! full-size Real-ESRGAN x4plus network (23 RRDB blocks, 64 features, random weights) on the
//! CPU backend. Prints one JSON line with the timing.
//!
//! `upscale_bench [--size N] [--threads T] [--tile T] [--fast]` (defaults 512, 2, 128;
//! `--fast`: f16 im2col, ggml's fast path, instead of exact f32 convolutions).

use std::time::Instant;

use sd_models::esrgan::EsrganConfig;
use sd_models::upscaler::{Upscaler, UpscalerArch};
use sd_models::weights::fill_with;
use sd_models::{ComputeOptions, ParamBuilder};
use sd_pipeline::upscale::{tile_starts, upscale_planes, CpuUpscaler};

fn arg(args: &[String], flag: &str, default: usize) -> usize {
    args.windows(2)
        .find(|w| w[0] == flag)
        .map(|w| w[1].parse().expect("a number"))
        .unwrap_or(default)
}

/// A small linear congruential generator: uniform values in [-a, a].
fn uniform(state: &mut u64, a: f32) -> f32 {
    *state = state
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    ((*state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * a
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let size = arg(&args, "--size", 512);
    let threads = arg(&args, "--threads", 2);
    let tile = arg(&args, "--tile", 128);

    let arch = UpscalerArch::Esrgan(EsrganConfig::default());
    let pb = ParamBuilder::new(None, 4096).expect("param context");
    let model = Upscaler::new(&pb, &arch).expect("x4plus");
    let params = pb.finish();
    let mut st = 1u64;
    let buf = fill_with(&params, |_, n| {
        (0..n).map(|_| uniform(&mut st, 0.04)).collect()
    })
    .expect("weights");
    let fast = args.iter().any(|a| a == "--fast");
    let mut exec = CpuUpscaler::from_parts(model, buf, threads)
        .expect("backend")
        .with_options(ComputeOptions {
            exact: !fast,
            flash_attn: false,
        });

    let x: Vec<f32> = (0..3 * size * size)
        .map(|_| 0.5 + uniform(&mut st, 0.5))
        .collect();
    let starts = tile_starts(size, tile.min(size), tile / 4);
    let tiles = starts.len() * starts.len();
    let t0 = Instant::now();
    let y = upscale_planes(&mut exec, &x, size, size, tile).expect("upscale");
    let secs = t0.elapsed().as_secs_f64();
    assert_eq!(y.len(), 3 * 16 * size * size);
    let mean = y.iter().map(|&v| v as f64).sum::<f64>() / y.len() as f64;
    println!(
        "{{\"impl\": \"sd-rs (ggml CPU{})\", \"size\": {size}, \"out\": {}, \"threads\": {threads}, \
         \"tile\": {tile}, \"tiles\": {tiles}, \"params\": {}, \"seconds\": {secs:.3}, \
         \"mean\": {mean:.5}}}",
        if fast { ", f16 im2col" } else { "" },
        size * 4,
        params.tensors.values().map(|t| t.nelements()).sum::<usize>()
    );
}
