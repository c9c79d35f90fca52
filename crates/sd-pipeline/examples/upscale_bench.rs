//! Benchmark body of `cargo xtask bench upscale`: tiled upscaling of a random image with a
//! full-size Real-ESRGAN x4plus network (23 RRDB blocks, 64 features, random weights) on the
//! CPU backend. Prints one JSON line with the timing.
//!
//! `upscale_bench [--size N] [--threads T] [--tile T] [--ggml-ops] [--fast]` (defaults 512,
//! 2, 128; the convolutions run on the project's CPU kernel as `sd` runs them; `--ggml-ops`:
//! on ggml's ops instead; `--fast` with it: f16 im2col, ggml's fast path, instead of exact
//! f32).

use std::time::Instant;

use clap::Parser;

use sd_models::esrgan::EsrganConfig;
use sd_models::upscaler::{Upscaler, UpscalerArch};
use sd_models::weights::fill_with;
use sd_models::{ComputeOptions, ParamBuilder};
use sd_pipeline::upscale::{tile_starts, upscale_planes, CpuUpscaler};

/// The command line (clap).
#[derive(Debug, Parser)]
#[command(
    name = "upscale_bench",
    about = "Tiled x4plus upscaling on the CPU backend"
)]
struct Args {
    /// Image side in pixels
    #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u32).range(1..=8192))]
    size: u32,
    /// CPU threads
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=1024))]
    threads: u32,
    /// Tile side in input pixels
    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u32).range(4..=8192))]
    tile: u32,
    /// ggml's ops for the convolutions instead of the project's CPU kernel
    #[arg(long)]
    ggml_ops: bool,
    /// With --ggml-ops: f16 im2col (ggml's fast path) instead of exact f32 convolutions
    #[arg(long, requires = "ggml_ops")]
    fast: bool,
}

/// A small linear congruential generator: uniform values in [-a, a].
fn uniform(state: &mut u64, a: f32) -> f32 {
    *state = state
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    ((*state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * a
}

fn main() {
    let args = Args::parse();
    let (size, threads, tile) = (
        args.size as usize,
        args.threads as usize,
        args.tile as usize,
    );

    let arch = UpscalerArch::Esrgan(EsrganConfig::default());
    let pb = ParamBuilder::new(None, 4096).expect("param context");
    let model = Upscaler::new(&pb, &arch).expect("x4plus");
    let params = pb.finish();
    let mut st = 1u64;
    let buf = fill_with(&params, |_, n| {
        (0..n).map(|_| uniform(&mut st, 0.04)).collect()
    })
    .expect("weights");
    let fast = args.fast;
    let mut exec = CpuUpscaler::from_parts(model, buf, threads)
        .expect("backend")
        .with_options(ComputeOptions {
            exact: !fast,
            flash_attn: false,
            host_kernels: !args.ggml_ops,
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
        "{{\"impl\": \"sd-rs (ggml CPU{}{})\", \"size\": {size}, \"out\": {}, \"threads\": {threads}, \
         \"tile\": {tile}, \"tiles\": {tiles}, \"params\": {}, \"seconds\": {secs:.3}, \
         \"mean\": {mean:.5}}}",
        if args.ggml_ops { ", ggml ops" } else { ", host kernels" },
        if fast { ", f16 im2col" } else { "" },
        size * 4,
        params.tensors.values().map(|t| t.nelements()).sum::<usize>()
    );
}
