//! The memory floor is one layer, not one block: the built-in model's UNet (SD1
//! architecture) on a simulated device, under a budget of a tenth of its weight bytes plus
//! its workspace, runs with cuts inside its blocks (between resnet and transformer, after
//! attention and feed-forward) chosen by the engine only where a block does not fit. It
//! gives the same bits as the whole run and the device's peak stays within the budget; a
//! budget no granularity can meet fails before anything runs, naming the minimum budget.

mod common;

use common::sim::{sim_runtime_with, SimRun};
use sd_exec::ExecError;
use sd_formats::files::TensorCatalog;
use sd_models::diffusion::DiffusionArch;
use sd_models::unet::UnetModel;
use sd_models::{ComputeOptions, HostData};
use sd_pipeline::family::ModelSpec;
use sd_pipeline::runtime::{BuiltGraph, RuntimeError, RuntimeOptions};
use sd_residency::{Component, SourceId};
use sd_tensor::DType;

fn builtin() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/builtin/sd-rs-shapes.safetensors")
}

/// One UNet step (8x8 latents, batch 1) on a 64 MiB simulated device with `budget`
/// (bytes; `None`: no budget).
fn step(budget: Option<u64>) -> Result<SimRun, RuntimeError> {
    step_with(budget, 8, |_| {})
}

/// [`step`] on `side` x `side` latents, the runtime's options changed by `edit`.
fn step_with(
    budget: Option<u64>,
    side: usize,
    edit: impl FnOnce(&mut RuntimeOptions),
) -> Result<SimRun, RuntimeError> {
    let mut loader = TensorCatalog::new();
    loader.add_file(builtin(), None).unwrap();
    let spec = ModelSpec::detect(&loader).unwrap();
    sd_models::weights::canonicalize(&mut loader, None).unwrap();
    let DiffusionArch::Unet(ucfg) = spec.diffusion.1.clone() else {
        panic!("not a UNet")
    };
    let mut rt = sim_runtime_with(loader, budget, edit)?;
    let cfg = ucfg.clone();
    let (h, unet) = rt.add_model("unet", Component::Diffusion, SourceId::MAIN, |pb| {
        UnetModel::new(pb, cfg)
    })?;
    let ctx_dim = ucfg.context_dim;
    let x: Vec<f32> = (0..side * side * 4)
        .map(|i| ((i * 29 % 23) as f32 - 11.0) / 7.0)
        .collect();
    let c: Vec<f32> = (0..ctx_dim * 77)
        .map(|i| ((i * 13 % 19) as f32 - 9.0) / 9.0)
        .collect();
    let out = rt.run(h, "unet step", 8192, |g| {
        let xt = g.ctx.new_tensor(DType::F32, &[side, side, 4, 1])?;
        let tt = g.ctx.new_tensor(DType::F32, &[1])?;
        let ct = g.ctx.new_tensor(DType::F32, &[ctx_dim, 77, 1])?;
        let output = unet.forward(g, &xt, &tt, &ct, None)?;
        Ok(BuiltGraph {
            output,
            inputs: vec![
                (xt, HostData::F32(x.clone())),
                (tt, HostData::F32(vec![500.0])),
                (ct, HostData::F32(c.clone())),
            ],
        })
    })?;
    Ok(SimRun::of(&rt, h, out.data))
}

#[test]
fn sub_block_cuts_equal_the_whole_run_within_a_tenth_of_the_weights() {
    let whole = step(None).unwrap();
    assert_eq!(whole.segments.len(), 1, "{:?}", whole.segments);
    let weights = whole.weights;
    // The workspace at this size: what one segment needs besides weights is small; a tenth
    // of the weights plus a fixed allowance for activations and the compute buffer.
    let budget = weights / 10 + (256 << 10);
    let tight = step(Some(budget)).unwrap();
    let fine: Vec<&String> = tight.segments.iter().filter(|n| n.contains('/')).collect();
    println!(
        "weights {weights} B, budget {budget} B, peak {} B, {} segments ({} inside blocks), largest footprint {} B",
        tight.peak,
        tight.segments.len(),
        fine.len(),
        tight.footprint
    );
    assert!(
        !fine.is_empty(),
        "no cut inside a block: {:?}",
        tight.segments
    );
    assert!(
        tight.peak <= budget,
        "peak {} > budget {budget}",
        tight.peak
    );
    assert_eq!(tight.out, whole.out, "segmented output differs");
}

#[test]
fn a_budget_below_one_layer_fails_before_running_naming_the_minimum() {
    let Err(err) = step(Some(32 << 10)) else {
        panic!("32 KiB cannot hold the largest UNet layer");
    };
    let RuntimeError::Exec(ExecError::BudgetTooSmall(short)) = &err else {
        panic!("not a budget error: {err}");
    };
    assert!(short.minimum > 32 << 10);
    let text = err.to_string();
    assert!(
        text.contains("minimum budget") && text.contains(short.largest.as_str()),
        "{text}"
    );
}

/// Large intermediates in bands (`RuntimeOptions::band_divisor`): the UNet's convolutions
/// in row bands and its feed-forwards in token chunks run under a budget below the least
/// one its whole ops need (the minimum their error names), the peak within it, and the
/// output is the unbudgeted run's within f32 rounding (ggml's CPU product may sum a
/// narrower matrix in another order).
#[test]
fn bands_run_below_the_whole_ops_minimum_with_the_same_output() {
    let side = 32;
    let bands = |divisor: Option<u64>| {
        move |o: &mut RuntimeOptions| {
            o.band_divisor = divisor;
            o.band_min_bytes = 16 << 10;
            // Flash attention: the attention scores are not what bands shrink.
            o.compute_options = ComputeOptions {
                exact: false,
                flash_attn: true,
                host_kernels: false,
            };
        }
    };
    let whole = step_with(None, side, bands(None)).unwrap();
    let minimum = match step_with(Some(64 << 10), side, bands(None)) {
        Err(RuntimeError::Exec(ExecError::BudgetTooSmall(short))) => short.minimum,
        Err(e) => panic!("not a budget error: {e}"),
        Ok(_) => panic!("64 KiB ran"),
    };
    let budget = minimum * 4 / 5;
    assert!(
        step_with(Some(budget), side, bands(None)).is_err(),
        "whole ops ran below their minimum"
    );
    let banded = step_with(Some(budget), side, bands(Some(64))).unwrap();
    println!(
        "weights {} B, whole ops' minimum {minimum} B, budget {budget} B: bands peak {} B, {} segments",
        whole.weights,
        banded.peak,
        banded.segments.len()
    );
    assert!(
        banded.peak <= budget,
        "peak {} > budget {budget}",
        banded.peak
    );
    let scale = whole.out.iter().fold(1f32, |m, v| m.max(v.abs()));
    let diff = whole
        .out
        .iter()
        .zip(&banded.out)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert_eq!(whole.out.len(), banded.out.len());
    assert!(diff <= 1e-5 * scale, "banded output differs by {diff}");
}
