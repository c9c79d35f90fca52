//! The SD3.5 MMDiT streams within a tenth of its weights: the tiny SD3.5 fixture
//! (`scripts/fixtures/make_sd3_fixtures.py`: 2 joint blocks, QK norm, MMDiT-X attention in
//! block 0) on a simulated device under a tenth of its weight bytes plus a workspace
//! allowance runs with cuts inside its joint blocks (modulation, joint q/k/v, after
//! attention, MLP halves), gives the same bits as the whole run, and the device's peak
//! stays within the budget.

mod common;

use common::sim::{assert_fine_cuts_fit, sim_runtime, values, SimRun};
use sd_formats::files::TensorCatalog;
use sd_models::diffusion::{DiffusionArch, DiffusionInputs, DiffusionNet};
use sd_models::mmdit::MmditConfig;
use sd_models::HostData;
use sd_pipeline::runtime::{BuiltGraph, RuntimeError};
use sd_residency::{Component, SourceId};
use sd_tensor::DType;

fn tiny() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../sd-models/tests/fixtures/sd3/sd35_tiny.safetensors")
}

/// One evaluation on 12x8 latents (24 patches) and 7 text tokens, cond and uncond in one
/// batch, on a 64 MiB simulated device with `budget` bytes (`None`: no budget).
fn step(budget: Option<u64>) -> Result<SimRun, RuntimeError> {
    let mut loader = TensorCatalog::new();
    loader.add_file(tiny(), None).unwrap();
    let mut rt = sim_runtime(loader, budget)?;
    let arch = DiffusionArch::Mmdit(MmditConfig::sd35_large());
    let (h, net) = rt.add_model("mmdit", Component::Diffusion, SourceId::MAIN, |pb| {
        DiffusionNet::new(pb, &arch)
    })?;
    let (w, hh, c, n_txt, b) = (12, 8, 16, 7, 2);
    let out = rt.run(h, "mmdit", net.graph_size(), |g| {
        let f = |ne: &[usize]| g.ctx.new_tensor(DType::F32, ne);
        let (x, t, ctx, y) = (
            f(&[w, hh, c, b])?,
            f(&[b])?,
            f(&[64, n_txt, b])?,
            f(&[64, b])?,
        );
        let mut inputs = DiffusionInputs::new(&x, &t);
        inputs.context = Some(&ctx);
        inputs.y = Some(&y);
        let output = net.forward(g, &inputs)?;
        Ok(BuiltGraph {
            output,
            inputs: vec![
                (x, HostData::F32(values(w * hh * c * b, 1))),
                (t, HostData::F32(vec![700.0, 700.0])),
                (ctx, HostData::F32(values(64 * n_txt * b, 2))),
                (y, HostData::F32(values(64 * b, 3))),
            ],
        })
    })?;
    Ok(SimRun::of(&rt, h, out.data))
}

#[test]
fn mmdit_streams_within_a_tenth_of_its_weights_with_the_same_bits() {
    let whole = step(None).unwrap();
    assert_eq!(whole.segments.len(), 1, "{:?}", whole.segments);
    let weights = whole.weights;
    let budget = weights / 10 + (256 << 10);
    let tight = step(Some(budget)).unwrap();
    assert_fine_cuts_fit(&whole, &tight, budget);
    // A block's segment follows the fine cuts inside it (the planner orders groups by what
    // they read: the block's text stream needs its MLP's hidden layer).
    let at = |n: &str| tight.segments.iter().position(|s| s == n);
    if let (Some(fine), Some(end)) = (at("joint_blocks.0/fc1_ctx"), at("joint_blocks.0")) {
        assert!(fine < end, "{:?}", tight.segments);
    }
}
