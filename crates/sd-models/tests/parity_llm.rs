//! LLM text encoder parity against transformers' `Qwen2_5_VLTextModel` on a tiny config
//! (fixtures by `scripts/fixtures/make_llm_fixtures.py`: hidden 256, 2 layers, 2 query heads
//! and 1 key/value head of width 128, RoPE theta 1e6): the last hidden state
//! (`hidden_states[-1]`, final norm applied, causal attention) of two 20-token sequences from
//! the checkpoint's names in f32 under the slot prefix, and from a llama.cpp GGUF with q8_0
//! weights; dimensions read from the tensors; a missing tensor is a clear error.

mod common;

use common::{check, io_in, ne, rel_l2};
use sd_formats::files::TensorCatalog;
use sd_formats::names::LLM_PREFIX;
use sd_models::llm::{LlmConfig, LlmModel};
use sd_models::run::run_cpu;
use sd_models::text_encoder::{TextEncoder, TextEncoderArch};
use sd_models::weights::canonicalize;
use sd_models::{load_all_to_cpu, ComputeOptions, GraphCtx, HostData, ParamBuilder};
use sd_tensor::DType;

fn dir() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llm")
}

/// The catalog of fixture file `file` given for the LLM slot (under [`LLM_PREFIX`]), in
/// canonical names.
fn catalog(file: &str) -> TensorCatalog {
    let mut loader = TensorCatalog::new();
    loader.add_file(dir().join(file), Some(LLM_PREFIX)).unwrap();
    canonicalize(&mut loader, None).unwrap();
    loader
}

/// Runs the encoder of `cat` (through the text-encoder enum, as the pipeline does) on the
/// fixture's ids, its weights converted to `weight_type` when loaded; returns the model's
/// config, the parameter dtypes and the output.
fn run(cat: &TensorCatalog, weight_type: Option<DType>) -> (LlmConfig, Vec<DType>, Vec<f32>) {
    let mut arch = TextEncoderArch::Llm(LlmConfig::qwen2_5_vl_7b());
    arch.set_prefix(LLM_PREFIX);
    let pb = ParamBuilder::new(Some(cat), 256).unwrap();
    pb.set_weight_type(weight_type);
    let enc = TextEncoder::new(&pb, &arch).unwrap();
    let TextEncoder::Llm(m) = &enc else {
        panic!("not an LLM encoder")
    };
    let config = m.config.clone();
    let params = pb.finish();
    assert_eq!(params.tensors.len(), cat.len(), "every tensor is used");
    let dtypes = params.tensors.values().filter_map(|t| t.dtype()).collect();
    let _buf = load_all_to_cpu(&params, cat).unwrap();
    let refs = io_in(&dir(), "llm_tiny");
    let ids = &refs["input_ids"];
    let mut g = GraphCtx::new(4096, enc.graph_size(), ComputeOptions::default()).unwrap();
    let input = g.ctx.new_tensor(DType::I32, &ne(&ids.shape)).unwrap();
    let out = enc.forward(&mut g, &input).unwrap();
    assert_eq!(out.ne()[..3].to_vec(), ne(&refs["out"].shape));
    let data = HostData::I32(ids.data.iter().map(|&v| v as i32).collect());
    let got = run_cpu(&g, &[&out], &[(&input, data)], enc.graph_size(), 2).unwrap();
    (config, dtypes, got.into_iter().next().unwrap())
}

#[test]
fn llm_reads_its_dimensions_from_the_tensors() {
    let cat = catalog("llm_tiny.safetensors");
    assert!(cat
        .get(&format!("{LLM_PREFIX}model.embed_tokens.weight"))
        .is_some());
    let (cfg, _, _) = run(&cat, None);
    let want = LlmConfig {
        vocab_size: 256,
        hidden_size: 256,
        intermediate_size: 128,
        num_hidden_layers: 2,
        num_attention_heads: 2,
        num_key_value_heads: 1,
        ..LlmConfig::qwen2_5_vl_7b()
    };
    assert_eq!(cfg, want);
}

#[test]
fn llm_matches_transformers_in_f32() {
    let (_, _, got) = run(&catalog("llm_tiny.safetensors"), None);
    let want = &io_in(&dir(), "llm_tiny")["out"].data;
    println!("llm f32: rel L2 {:.3e}", rel_l2(&got, want));
    check("llm f32", &got, want, 1e-4);
}

#[test]
fn llm_gguf_q8_0_keeps_its_quantized_weights_and_matches_transformers() {
    let cat = catalog("llm_tiny_q8_0.gguf");
    for name in [
        "model.embed_tokens.weight",
        "model.layers.1.self_attn.q_proj.bias",
        "model.layers.1.self_attn.o_proj.weight",
        "model.layers.0.post_attention_layernorm.weight",
        "model.layers.0.mlp.down_proj.weight",
        "model.norm.weight",
    ] {
        assert!(cat.get(&format!("{LLM_PREFIX}{name}")).is_some(), "{name}");
    }
    let (cfg, dtypes, got) = run(&cat, None);
    assert_eq!(
        (
            cfg.hidden_size,
            cfg.num_hidden_layers,
            cfg.num_attention_heads
        ),
        (256, 2, 2)
    );
    assert!(dtypes.contains(&DType::Q8_0), "q8_0 weights stay q8_0");
    let want = &io_in(&dir(), "llm_tiny")["out_q8_0"].data;
    // Dequantized to f32 when loaded, the GGUF gives transformers' output for the same
    // q8_0-rounded weights: names, layout and quantized bytes are right.
    let (_, dtypes_f32, exact) = run(&cat, Some(DType::F32));
    assert!(dtypes_f32.iter().all(|&d| d == DType::F32));
    println!("llm gguf dequantized: rel L2 {:.3e}", rel_l2(&exact, want));
    check("llm gguf dequantized", &exact, want, 1e-4);
    // Kept q8_0, ggml also quantizes the matrix products' inputs to q8_0.
    println!("llm gguf q8_0: rel L2 {:.3e}", rel_l2(&got, want));
    check("llm gguf q8_0", &got, want, 2e-2);
}

/// A q4_K GGUF as llama.cpp's quantizers lay one out (`make_llm_fixtures.py q4_k`: the
/// matrices of whole 256-value rows in q4_K, the down projections q8_0): dequantized when
/// loaded it gives transformers' output on the same dequantized weights; kept q4_K, within
/// ggml's rounding of the products' inputs.
#[test]
fn llm_gguf_q4_k_keeps_its_quantized_weights_and_matches_transformers() {
    let cat = catalog("llm_tiny_q4_k.gguf");
    let dtype = |name: &str| cat.get(&format!("{LLM_PREFIX}{name}")).map(|t| t.dtype);
    assert_eq!(
        dtype("model.layers.0.self_attn.q_proj.weight"),
        Some(DType::Q4K)
    );
    assert_eq!(
        dtype("model.layers.1.mlp.gate_proj.weight"),
        Some(DType::Q4K)
    );
    assert_eq!(
        dtype("model.layers.1.mlp.down_proj.weight"),
        Some(DType::Q8_0)
    );
    let want = &io_in(&dir(), "llm_tiny_q4_k")["out_q4_k"].data;
    let (_, dtypes_f32, exact) = run(&cat, Some(DType::F32));
    assert!(dtypes_f32.iter().all(|&d| d == DType::F32));
    println!(
        "llm gguf q4_K dequantized: rel L2 {:.3e}",
        rel_l2(&exact, want)
    );
    check("llm gguf q4_K dequantized", &exact, want, 1e-4);
    let (_, dtypes, got) = run(&cat, None);
    assert!(dtypes.contains(&DType::Q4K), "q4_K weights stay q4_K");
    println!("llm gguf q4_K: rel L2 {:.3e}", rel_l2(&got, want));
    check("llm gguf q4_K", &got, want, 2e-2);
}

#[test]
fn llm_without_a_layer_tensor_is_a_clear_error() {
    let mut cat = catalog("llm_tiny.safetensors");
    cat.retain(|t| !t.name.ends_with("layers.1.mlp.up_proj.weight"));
    let pb = ParamBuilder::new(Some(&cat), 256).unwrap();
    let mut cfg = LlmConfig::qwen2_5_vl_7b();
    cfg.prefix = LLM_PREFIX.trim_end_matches('.').into();
    let err = LlmModel::new(&pb, cfg).unwrap_err().to_string();
    assert!(err.contains("model.layers.1.mlp.up_proj.weight"), "{err}");
}

#[test]
fn llm_head_width_that_does_not_divide_q_is_a_clear_error() {
    let cat = catalog("llm_tiny.safetensors");
    let pb = ParamBuilder::new(Some(&cat), 256).unwrap();
    let mut cfg = LlmConfig::qwen2_5_vl_7b();
    cfg.prefix = LLM_PREFIX.trim_end_matches('.').into();
    cfg.head_dim = 96;
    let err = LlmModel::new(&pb, cfg).unwrap_err().to_string();
    assert!(err.contains("q_proj") && err.contains("96"), "{err}");
}
