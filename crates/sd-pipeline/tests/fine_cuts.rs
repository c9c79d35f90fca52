//! The memory floor is one layer, not one block: the built-in model's UNet (SD1
//! architecture) on a simulated device, under a budget of a tenth of its weight bytes plus
//! its workspace, runs with cuts inside its blocks (between resnet and transformer, after
//! attention and feed-forward) chosen by the engine only where a block does not fit. It
//! gives the same bits as the whole run and the device's peak stays within the budget; a
//! budget no granularity can meet fails before anything runs, naming the minimum budget.

mod common;

use common::sim::{sim_runtime, SimRun};
use sd_exec::ExecError;
use sd_formats::files::TensorCatalog;
use sd_models::diffusion::DiffusionArch;
use sd_models::unet::UnetModel;
use sd_models::HostData;
use sd_pipeline::family::ModelSpec;
use sd_pipeline::runtime::{BuiltGraph, RuntimeError};
use sd_residency::{Component, SourceId};
use sd_tensor::DType;

fn builtin() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/builtin/sd-rs-shapes.safetensors")
}

/// One UNet step (8x8 latents, batch 1) on a 64 MiB simulated device with `budget`
/// (bytes; `None`: no budget).
fn step(budget: Option<u64>) -> Result<SimRun, RuntimeError> {
    let mut loader = TensorCatalog::new();
    loader.add_file(builtin(), None).unwrap();
    let spec = ModelSpec::detect(&loader).unwrap();
    sd_models::weights::canonicalize(&mut loader, None).unwrap();
    let DiffusionArch::Unet(ucfg) = spec.diffusion.1.clone() else {
        panic!("not a UNet")
    };
    let mut rt = sim_runtime(loader, budget)?;
    let cfg = ucfg.clone();
    let (h, unet) = rt.add_model("unet", Component::Diffusion, SourceId::MAIN, |pb| {
        UnetModel::new(pb, cfg)
    })?;
    let ctx_dim = ucfg.context_dim;
    let x: Vec<f32> = (0..8 * 8 * 4)
        .map(|i| ((i * 29 % 23) as f32 - 11.0) / 7.0)
        .collect();
    let c: Vec<f32> = (0..ctx_dim * 77)
        .map(|i| ((i * 13 % 19) as f32 - 9.0) / 9.0)
        .collect();
    let out = rt.run(h, "unet step", 8192, |g| {
        let xt = g.ctx.new_tensor(DType::F32, &[8, 8, 4, 1])?;
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
