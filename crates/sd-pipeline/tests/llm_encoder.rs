//! The LLM text encoder streams within a budget: a 12-layer Qwen2.5-VL-style decoder (GQA, a
//! layer about 8% of the weights; fixture by `scripts/fixtures/make_llm_fixtures.py`) on a
//! simulated device under a tenth of its weight bytes plus a workspace allowance runs in
//! segments at its per-layer cuts, gives the same bits as the whole run, and the device's
//! peak stays within the budget. The RoPE tables and the causal mask are read by every
//! segment.

mod common;

use common::sim::{sim_runtime, SimRun};
use sd_formats::files::TensorCatalog;
use sd_formats::names::LLM_PREFIX;
use sd_models::llm::LlmConfig;
use sd_models::text_encoder::{TextEncoder, TextEncoderArch};
use sd_models::HostData;
use sd_pipeline::runtime::{BuiltGraph, RuntimeError};
use sd_residency::{Component, SourceId};
use sd_tensor::DType;

fn deep() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llm/llm_deep.safetensors")
}

/// One encoder evaluation of 64 tokens on a simulated device with `budget` bytes (`None`: no
/// budget).
fn encode(budget: Option<u64>) -> Result<SimRun, RuntimeError> {
    let mut loader = TensorCatalog::new();
    loader.add_file(deep(), Some(LLM_PREFIX)).unwrap();
    sd_models::weights::canonicalize(&mut loader, None).unwrap();
    let mut rt = sim_runtime(loader, budget)?;
    // The fixture's heads are 32 wide (Qwen2.5-VL's are 128, the default).
    let mut arch = TextEncoderArch::Llm(LlmConfig {
        head_dim: 32,
        ..LlmConfig::qwen2_5_vl_7b()
    });
    arch.set_prefix(LLM_PREFIX);
    let (h, enc) = rt.add_model("llm", Component::TextEncoder, SourceId::MAIN, |pb| {
        TextEncoder::new(pb, &arch)
    })?;
    let TextEncoder::Llm(m) = &enc else {
        panic!("not an LLM")
    };
    assert_eq!(
        (
            m.config.num_hidden_layers,
            m.config.hidden_size,
            m.config.num_attention_heads,
            m.config.num_key_value_heads
        ),
        (12, 64, 2, 1)
    );
    let ids: Vec<i32> = (0..64).map(|i| i * 37 % 128).collect();
    let out = rt.run(h, "llm", enc.graph_size(), |g| {
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
fn llm_streams_within_a_tenth_of_its_weights_with_the_same_bits() {
    let whole = encode(None).unwrap();
    assert_eq!(whole.segments.len(), 1, "{:?}", whole.segments);
    assert!(whole.out.iter().all(|v| v.is_finite()));
    let weights = whole.weights;
    // A tenth of the weights (a layer is 8% of them) plus the workspace of one layer at 64
    // tokens: scores and probabilities of 2 heads x 64 x 64 in f32 (32 KiB each), the RoPE
    // tables, the mask, the feed-forward's activations and the cut tensors.
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
