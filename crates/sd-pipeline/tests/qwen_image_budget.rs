//! The Qwen-Image transformer streams within a tenth of its weights: the tiny fixture
//! (`scripts/fixtures/make_qwen_image_fixtures.py`: 2 dual-stream blocks of 64) on a
//! simulated device under a tenth of its weight bytes plus a workspace allowance runs with
//! cuts inside its blocks (modulation, joint q/k/v, after attention, MLP halves), gives the
//! same bits as the whole run, and the device's peak stays within the budget.

mod common;

use common::sim::{assert_fine_cuts_fit, sim_runtime, values, SimRun};
use sd_formats::files::TensorCatalog;
use sd_models::diffusion::{DiffusionArch, DiffusionInputs, DiffusionNet};
use sd_models::qwen_image::QwenImageConfig;
use sd_models::HostData;
use sd_pipeline::runtime::{BuiltGraph, RuntimeError};
use sd_residency::{Component, SourceId};
use sd_tensor::DType;

fn tiny() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../sd-models/tests/fixtures/qwen_image/qwen_image_tiny.safetensors")
}

/// One evaluation on 12x8 latents (24 patches) and 7 text tokens, batch 1, on a 64 MiB
/// simulated device with `budget` bytes (`None`: no budget).
fn step(budget: Option<u64>) -> Result<SimRun, RuntimeError> {
    let mut loader = TensorCatalog::new();
    loader.add_file(tiny(), None).unwrap();
    let mut rt = sim_runtime(loader, budget)?;
    let arch = DiffusionArch::QwenImage(QwenImageConfig::default());
    let (h, net) = rt.add_model("qwen_image", Component::Diffusion, SourceId::MAIN, |pb| {
        DiffusionNet::new(pb, &arch)
    })?;
    let (w, hh, c, n_txt) = (12, 8, 16, 7);
    let out = rt.run(h, "qwen_image", net.graph_size(), |g| {
        let f = |ne: &[usize]| g.ctx.new_tensor(DType::F32, ne);
        let (x, t, ctx) = (f(&[w, hh, c, 1])?, f(&[1])?, f(&[32, n_txt, 1])?);
        let mut inputs = DiffusionInputs::new(&x, &t);
        inputs.context = Some(&ctx);
        let output = net.forward(g, &inputs)?;
        Ok(BuiltGraph {
            output,
            inputs: vec![
                (x, HostData::F32(values(w * hh * c, 1))),
                (t, HostData::F32(vec![0.7])),
                (ctx, HostData::F32(values(32 * n_txt, 2))),
            ],
        })
    })?;
    Ok(SimRun::of(&rt, h, out.data))
}

#[test]
fn qwen_image_streams_within_a_tenth_of_its_weights_with_the_same_bits() {
    let whole = step(None).unwrap();
    assert_eq!(whole.segments.len(), 1, "{:?}", whole.segments);
    let weights = whole.weights;
    let budget = weights / 10 + (256 << 10);
    let tight = step(Some(budget)).unwrap();
    assert_fine_cuts_fit(&whole, &tight, budget);
    assert!(
        tight.segments.iter().any(|s| s == "qwen_image.prelude"),
        "{:?}",
        tight.segments
    );
}
