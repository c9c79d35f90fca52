//! The T5 encoder streams within a budget: a 12-block T5 (T5-XXL's proportions, a block
//! about 8% of the weights; fixture by `scripts/fixtures/make_t5_fixtures.py`) on a
//! simulated device under a tenth of its weight bytes plus a workspace allowance runs in
//! segments at its per-block cuts, gives the same bits as the whole run, and the device's
//! peak stays within the budget. The relative position bias is recomputed in each segment.
//! And a T5 file given for a CLIP slot is an error naming the file and the flags.

mod common;

use common::sim::{sim_runtime, SimRun};
use sd_formats::files::TensorCatalog;
use sd_formats::names::T5_PREFIX;
use sd_models::t5::T5Config;
use sd_models::text_encoder::{TextEncoder, TextEncoderArch};
use sd_models::HostData;
use sd_pipeline::pipeline::{LoadOptions, ModelFiles, Pipeline};
use sd_pipeline::runtime::{BuiltGraph, RuntimeError, RuntimeOptions};
use sd_residency::{Component, SourceId};
use sd_tensor::DType;

fn deep() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/t5/t5_deep.safetensors")
}

/// One encoder evaluation of 64 tokens on a 64 MiB simulated device with `budget` bytes
/// (`None`: no budget).
fn encode(budget: Option<u64>) -> Result<SimRun, RuntimeError> {
    let mut loader = TensorCatalog::new();
    loader.add_file(deep(), None).unwrap();
    sd_models::weights::canonicalize(&mut loader, None).unwrap();
    let mut rt = sim_runtime(loader, budget)?;
    let mut arch = TextEncoderArch::T5(T5Config::xxl());
    arch.set_prefix(T5_PREFIX);
    let (h, enc) = rt.add_model("t5", Component::TextEncoder, SourceId::MAIN, |pb| {
        TextEncoder::new(pb, &arch)
    })?;
    let TextEncoder::T5(m) = &enc else {
        panic!("not a T5")
    };
    assert_eq!((m.config.num_layers, m.config.d_model), (12, 64));
    let ids: Vec<i32> = (0..64)
        .map(|i| if i < 50 { i * 37 % 250 + 3 } else { 0 })
        .collect();
    let out = rt.run(h, "t5", enc.graph_size(), |g| {
        let input = g.ctx.new_tensor(DType::I32, &[ids.len(), 1])?;
        let output = enc.forward(g, &input)?;
        Ok(BuiltGraph {
            output,
            inputs: vec![(input, HostData::I32(ids.clone()))],
        })
    })?;
    Ok(SimRun::of(&rt, h, out.data))
}

#[test]
fn t5_streams_within_a_tenth_of_its_weights_with_the_same_bits() {
    let whole = encode(None).unwrap();
    assert_eq!(whole.segments.len(), 1, "{:?}", whole.segments);
    let weights = whole.weights;
    // A tenth of the weights (a block is 8% of them) plus the workspace of one block at 64
    // tokens: scores, probabilities and bias of 4 heads x 64 x 64 in f32 (64 KiB each), the
    // feed-forward's activations and the cut tensors.
    let budget = weights / 10 + (384 << 10);
    let tight = encode(Some(budget)).unwrap();
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

#[test]
fn a_t5_file_given_as_clip_l_is_an_error_naming_file_and_flags() {
    let builtin = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/builtin/sd-rs-shapes.safetensors");
    let files = ModelFiles::single(builtin).with("clip_l", deep());
    let err = Pipeline::open(
        &files,
        LoadOptions {
            runtime: RuntimeOptions {
                threads: 2,
                ..RuntimeOptions::default()
            },
            ..LoadOptions::default()
        },
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("t5_deep.safetensors")
            && err.contains("T5")
            && err.contains("--clip_l")
            && err.contains("--t5xxl"),
        "{err}"
    );
}
