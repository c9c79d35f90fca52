//! T5 encoder parity against transformers' `T5EncoderModel` on the tiny config of the
//! research notes (fixtures by `scripts/fixtures/make_t5_fixtures.py`): `last_hidden_state`
//! of two 256-token sequences (one padded after its `</s>`, no attention mask, as the FLUX and
//! SD3 pipelines run it) from a bare f32 file, an f16 file under the bundle prefix with the
//! tied `encoder.embed_tokens` name, and a llama.cpp GGUF with q8_0 weights (kept q8_0); the
//! relative-position buckets of every distance up to 1023; dimensions read from the
//! tensors.

mod common;

use common::{check, io_in, ne};
use sd_formats::files::TensorCatalog;
use sd_formats::names::T5_PREFIX;
use sd_models::run::run_cpu;
use sd_models::t5::{relative_position_bucket, T5Config, T5EncoderModel};
use sd_models::text_encoder::{TextEncoder, TextEncoderArch};
use sd_models::weights::canonicalize;
use sd_models::{load_all_to_cpu, ComputeOptions, GraphCtx, HostData, ParamBuilder};
use sd_tensor::DType;

fn dir() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/t5")
}

/// The catalog of fixture file `file`, in canonical names.
fn catalog(file: &str) -> TensorCatalog {
    let mut loader = TensorCatalog::new();
    loader.add_file(dir().join(file), None).unwrap();
    canonicalize(&mut loader, None).unwrap();
    loader
}

/// Runs the encoder of `cat` (through the text-encoder enum, as the pipeline does) on the
/// fixture's ids; returns the model's config, the parameter dtypes and the output.
fn run(cat: &TensorCatalog) -> (T5Config, Vec<DType>, Vec<f32>) {
    run_as(cat, None)
}

/// [`run`] with the weights converted to `weight_type` when loaded (`--type`).
fn run_as(cat: &TensorCatalog, weight_type: Option<DType>) -> (T5Config, Vec<DType>, Vec<f32>) {
    let (config, dtypes, out, _) = run_with(cat, weight_type, ComputeOptions::default());
    (config, dtypes, out)
}

/// [`run_as`] with `opts`; also counts the graph's nodes of the project's tanh-GELU kernel.
fn run_with(
    cat: &TensorCatalog,
    weight_type: Option<DType>,
    opts: ComputeOptions,
) -> (T5Config, Vec<DType>, Vec<f32>, usize) {
    let mut arch = TextEncoderArch::T5(T5Config::xxl());
    arch.set_prefix(T5_PREFIX);
    let pb = ParamBuilder::new(Some(cat), 256).unwrap();
    pb.set_weight_type(weight_type);
    let enc = TextEncoder::new(&pb, &arch).unwrap();
    let TextEncoder::T5(m) = &enc else {
        panic!("not a T5 encoder")
    };
    let config = m.config.clone();
    let params = pb.finish();
    assert_eq!(params.tensors.len(), cat.len(), "every tensor is used");
    let dtypes = params.tensors.values().filter_map(|t| t.dtype()).collect();
    let _buf = load_all_to_cpu(&params, cat).unwrap();
    let refs = io_in(&dir(), "t5_tiny");
    let ids = &refs["input_ids"];
    let mut g = GraphCtx::new(4096, enc.graph_size(), opts).unwrap();
    let input = g.ctx.new_tensor(DType::I32, &ne(&ids.shape)).unwrap();
    let out = enc.forward(&mut g, &input).unwrap();
    assert_eq!(out.ne()[..3].to_vec(), ne(&refs["out"].shape));
    let gelu_nodes = common::nodes_named(
        &g.ctx,
        &out,
        enc.graph_size(),
        sd_tensor::ggml::GELU_TANH_HOST_NAME,
    );
    let data = HostData::I32(ids.data.iter().map(|&v| v as i32).collect());
    let got = run_cpu(&g, &[&out], &[(&input, data)], enc.graph_size(), 2).unwrap();
    (config, dtypes, got.into_iter().next().unwrap(), gelu_nodes)
}

#[test]
fn buckets_equal_transformers_for_every_distance() {
    let refs = io_in(&dir(), "t5_tiny");
    let want = &refs["buckets"].data;
    assert_eq!(want.len(), 2047);
    for (i, &w) in want.iter().enumerate() {
        let rel = i as i64 - 1023;
        assert_eq!(
            relative_position_bucket(rel, 32, 128) as f32,
            w,
            "relative position {rel}"
        );
    }
}

#[test]
fn t5_reads_its_dimensions_from_the_tensors() {
    let cat = catalog("t5_tiny.safetensors");
    assert!(cat.get(&format!("{T5_PREFIX}shared.weight")).is_some());
    let (cfg, _, _) = run(&cat);
    let want = T5Config {
        vocab_size: 512,
        d_model: 128,
        d_kv: 64,
        d_ff: 256,
        num_layers: 2,
        num_heads: 2,
        relative_attention_num_buckets: 32,
        ..T5Config::xxl()
    };
    assert_eq!(cfg, want);
}

#[test]
fn t5_matches_transformers_in_f32() {
    let (_, _, got) = run(&catalog("t5_tiny.safetensors"));
    check("t5 f32", &got, &io_in(&dir(), "t5_tiny")["out"].data, 1e-4);
}

/// With the project's CPU kernels, each block's gated GELU (`gelu_new(wi_0 x) * wi_1 x`)
/// is one op of the tanh-GELU kernel, and the output still matches transformers.
#[test]
fn t5_on_the_cpu_kernels_matches_transformers_in_f32() {
    let opts = ComputeOptions {
        host_kernels: true,
        ..ComputeOptions::default()
    };
    let (cfg, _, got, gelu_nodes) = run_with(&catalog("t5_tiny.safetensors"), None, opts);
    assert_eq!(gelu_nodes, cfg.num_layers);
    check(
        "t5 f32, CPU kernels",
        &got,
        &io_in(&dir(), "t5_tiny")["out"].data,
        1e-4,
    );
}

#[test]
fn t5_f16_weights_under_the_bundle_prefix_match_transformers() {
    let cat = catalog("t5_tiny_f16.safetensors");
    assert!(cat
        .get(&format!("{T5_PREFIX}encoder.embed_tokens.weight"))
        .is_some());
    let (_, dtypes, got) = run(&cat);
    assert!(dtypes.contains(&DType::F16), "f16 weights stay f16");
    let refs = io_in(&dir(), "t5_tiny");
    // The reference computes in f32 with the same f16-rounded weights; ggml rounds the
    // matrix products' inputs to f16 as well.
    check("t5 f16 weights", &got, &refs["out_f16"].data, 5e-3);
}

#[test]
fn t5_gguf_q8_0_keeps_its_quantized_weights_and_matches_transformers() {
    let cat = catalog("t5_tiny_q8_0.gguf");
    for name in [
        "shared.weight",
        "encoder.block.1.layer.1.DenseReluDense.wo.weight",
        "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
        "encoder.final_layer_norm.weight",
    ] {
        assert!(cat.get(&format!("{T5_PREFIX}{name}")).is_some(), "{name}");
    }
    let (cfg, dtypes, got) = run(&cat);
    assert_eq!((cfg.d_model, cfg.num_layers, cfg.num_heads), (128, 2, 2));
    assert!(dtypes.contains(&DType::Q8_0), "q8_0 weights stay q8_0");
    let want = &io_in(&dir(), "t5_tiny")["out_q8_0"].data;
    // Dequantized to f32 when loaded, the GGUF gives transformers' output for the same
    // q8_0-rounded weights: names, layout and quantized bytes are right.
    let (_, dtypes_f32, exact) = run_as(&cat, Some(DType::F32));
    assert!(dtypes_f32.iter().all(|&d| d == DType::F32));
    check("t5 gguf dequantized", &exact, want, 1e-4);
    // Kept q8_0, ggml also quantizes the matrix products' inputs to q8_0 (8 bits per value);
    // the tiny random model's unscaled attention logits are large, so its softmax magnifies
    // that rounding.
    check("t5 gguf q8_0", &got, want, 8e-2);
}

#[test]
fn t5_without_a_bias_table_is_a_clear_error() {
    let mut cat = catalog("t5_tiny.safetensors");
    cat.retain(|t| !t.name.contains("relative_attention_bias"));
    let pb = ParamBuilder::new(Some(&cat), 256).unwrap();
    let mut cfg = T5Config::xxl();
    cfg.prefix = T5_PREFIX.trim_end_matches('.').into();
    let err = T5EncoderModel::new(&pb, cfg).unwrap_err().to_string();
    assert!(err.contains("relative_attention_bias"), "{err}");
}
