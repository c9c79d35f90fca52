//! The FLUX.1 transformer streams within a budget: the tiny dev fixture
//! (`scripts/fixtures/make_flux_fixtures.py`, 2 double + 2 single blocks) on a simulated
//! device under about a third of its weight bytes plus a workspace allowance runs in
//! segments at its block cuts (the RoPE tables are auxiliary inputs every segment reads),
//! gives the same bits as the whole run, and the device's peak stays within the budget.

mod common;

use common::sim::{assert_fine_cuts_fit, sim_runtime, values, SimRun};
use sd_formats::files::TensorCatalog;
use sd_models::diffusion::{DiffusionArch, DiffusionInputs, DiffusionNet};
use sd_models::flux::FluxConfig;
use sd_models::HostData;
use sd_pipeline::runtime::{BuiltGraph, RuntimeError};
use sd_residency::{Component, SourceId};
use sd_tensor::DType;

fn tiny() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../sd-models/tests/fixtures/flux/flux_tiny.safetensors")
}

/// One evaluation on 16x16 latents (64 image tokens) and 8 text tokens, batch 1, on a
/// 64 MiB simulated device with `budget` bytes (`None`: no budget).
fn step(budget: Option<u64>) -> Result<SimRun, RuntimeError> {
    let mut loader = TensorCatalog::new();
    loader.add_file(tiny(), None).unwrap();
    let mut rt = sim_runtime(loader, budget)?;
    let arch = DiffusionArch::Flux(FluxConfig::dev());
    let (h, net) = rt.add_model("flux", Component::Diffusion, SourceId::MAIN, |pb| {
        DiffusionNet::new(pb, &arch)
    })?;
    let (w, c, n_txt) = (16, 16, 8);
    let out = rt.run(h, "flux", net.graph_size(), |g| {
        let f = |ne: &[usize]| g.ctx.new_tensor(DType::F32, ne);
        let (x, t, ctx, y, gd) = (
            f(&[w, w, c, 1])?,
            f(&[1])?,
            f(&[32, n_txt, 1])?,
            f(&[32, 1])?,
            f(&[1])?,
        );
        let mut inputs = DiffusionInputs::new(&x, &t);
        inputs.context = Some(&ctx);
        inputs.y = Some(&y);
        inputs.guidance = Some(&gd);
        let output = net.forward(g, &inputs)?;
        Ok(BuiltGraph {
            output,
            inputs: vec![
                (x, HostData::F32(values(w * w * c, 1))),
                (t, HostData::F32(vec![0.7])),
                (ctx, HostData::F32(values(32 * n_txt, 2))),
                (y, HostData::F32(values(32, 3))),
                (gd, HostData::F32(vec![3.5])),
            ],
        })
    })?;
    Ok(SimRun::of(&rt, h, out.data))
}

#[test]
fn flux_streams_within_a_third_of_its_weights_with_the_same_bits() {
    let whole = step(None).unwrap();
    assert_eq!(whole.segments.len(), 1, "{:?}", whole.segments);
    let weights = whole.weights;
    let budget = weights / 3 + (512 << 10);
    let tight = step(Some(budget)).unwrap();
    println!(
        "weights {weights} B, budget {budget} B, peak {} B, {} segments: {:?}",
        tight.peak,
        tight.segments.len(),
        tight.segments
    );
    assert!(tight.segments.len() > 2, "{:?}", tight.segments);
    assert!(
        tight.peak <= budget,
        "peak {} > budget {budget}",
        tight.peak
    );
    assert_eq!(tight.out, whole.out, "segmented output differs");
}

/// At a tenth of its weights (and 704 KiB for the workspace) the transformer runs with
/// cuts inside its blocks (modulation, joint q/k/v, after attention, MLP halves; a single
/// block's q/k/v/MLP input), with the whole run's bits, inside the budget.
#[test]
fn flux_streams_within_a_tenth_of_its_weights_inside_its_blocks() {
    let (whole, tight, budget) = tenth(704 << 10);
    assert_fine_cuts_fit(&whole, &tight.unwrap(), budget);
}

/// The whole run, a run at a tenth of the weights plus `allowance`, and that budget.
fn tenth(allowance: u64) -> (SimRun, Result<SimRun, RuntimeError>, u64) {
    let whole = step(None).unwrap();
    let budget = whole.weights / 10 + allowance;
    let tight = step(Some(budget));
    (whole, tight, budget)
}

/// With 512-640 KiB of allowance every budget is met or refused before anything runs (issue
/// 19: the plan said these fit, and the run failed in segment 14 or passed the budget by up
/// to 38 KB). Three engine fixes made it hold: blocks left in the staging pool are evicted
/// for pool room (a full pool sent every segment's weights to buffers of their own beside
/// it); a workspace kept from a larger segment is released when the next segment's request
/// does not fit with it; and segments are measured with the outputs the cut cache will hold
/// as allocated elsewhere, as they run (ggml's allocator laid the rest out 55,296 B larger
/// than measured in `single_blocks.0/linear1`). `RUST_LOG=sd_exec=trace,sd_tensor=trace`
/// logs each segment's planned need and each simulated allocation.
#[test]
fn flux_budgets_are_met_or_refused_up_front() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    for allowance in [512u64 << 10, 640 << 10] {
        let (_, tight, budget) = tenth(allowance);
        match tight {
            Ok(run) => assert!(
                run.peak <= budget,
                "allowance {allowance}: peak {} > budget {budget}",
                run.peak
            ),
            Err(RuntimeError::Exec(sd_exec::ExecError::BudgetTooSmall(_))) => {}
            Err(e) => panic!("allowance {allowance}: {e}"),
        }
    }
}
