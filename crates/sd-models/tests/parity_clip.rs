//! CLIP text encoder parity against transformers' `CLIPTextModel` (tiny random weights,
//! fixtures by `scripts/fixtures/make_model_fixtures.py`).

mod common;

use common::{catalog, check, config, io};
use sd_models::clip::{ClipTextConfig, ClipTextModel};
use sd_models::nn::Activation;
use sd_models::run::run_cpu;
use sd_models::{load_all_to_cpu, ComputeOptions, GraphCtx, HostData, ModelError, ParamBuilder};
use sd_tensor::DType;

fn tiny_config(name: &str, clip_skip: usize) -> ClipTextConfig {
    let c = config(name);
    let u = |k: &str| c[k].as_u64().unwrap() as usize;
    ClipTextConfig {
        vocab_size: u("vocab_size"),
        hidden_size: u("hidden_size"),
        intermediate_size: u("intermediate_size"),
        num_hidden_layers: u("num_hidden_layers"),
        num_attention_heads: u("num_attention_heads"),
        max_position_embeddings: u("max_position_embeddings"),
        hidden_act: match c["hidden_act"].as_str().unwrap() {
            "quick_gelu" => Activation::QuickGelu,
            "gelu" => Activation::Gelu,
            other => panic!("activation {other}"),
        },
        layer_norm_eps: c["layer_norm_eps"].as_f64().unwrap() as f32,
        clip_skip,
        final_layer_norm: true,
        ..ClipTextConfig::sd1()
    }
}

fn run(name: &str, clip_skip: usize, opts: ComputeOptions) -> (Vec<f32>, Vec<f32>) {
    let cat = catalog(name);
    let pb = ParamBuilder::new(Some(&cat), 1024).unwrap();
    let model = ClipTextModel::new(&pb, tiny_config(name, clip_skip)).unwrap();
    let params = pb.finish();
    let _buf = load_all_to_cpu(&params, &cat).unwrap();

    let refs = io(name);
    let ids_ref = &refs["input_ids"];
    let ids: Vec<i32> = ids_ref.data.iter().map(|&v| v as i32).collect();
    let mut g = GraphCtx::new(2048, 4096, opts).unwrap();
    let input = g
        .ctx
        .new_tensor(DType::I32, &common::ne(&ids_ref.shape))
        .unwrap();
    let out = model.forward(&mut g, &input).unwrap();
    let want = &refs[&format!("hidden_skip{clip_skip}")];
    assert_eq!(out.ne()[..3], common::ne(&want.shape)[..]);
    let got = run_cpu(&g, &[&out], &[(&input, HostData::I32(ids))], 4096, 2).unwrap();
    (got.into_iter().next().unwrap(), want.data.clone())
}

#[test]
fn clip_sd1_quick_gelu_matches_transformers() {
    for skip in [1, 2] {
        let (got, want) = run("clip_sd1", skip, ComputeOptions::default());
        check(&format!("clip_sd1 skip {skip}"), &got, &want, 1e-4);
    }
}

#[test]
fn clip_sd2_gelu_matches_transformers() {
    for skip in [1, 2] {
        let (got, want) = run("clip_sd2", skip, ComputeOptions::default());
        check(&format!("clip_sd2 skip {skip}"), &got, &want, 1e-4);
    }
}

#[test]
fn clip_fast_numerics_stay_close() {
    let opts = ComputeOptions {
        exact: false,
        flash_attn: true,
        host_kernels: false,
    };
    let (got, want) = run("clip_sd1", 1, opts);
    check("clip_sd1 fast", &got, &want, 1e-2);
}

#[test]
fn missing_and_misshapen_tensors_are_errors() {
    let mut cat = catalog("clip_sd1");
    let mut cfg = tiny_config("clip_sd1", 1);
    cfg.hidden_size = 64;
    let pb = ParamBuilder::new(Some(&cat), 1024).unwrap();
    let err = ClipTextModel::new(&pb, cfg).unwrap_err();
    assert!(
        matches!(&err, ModelError::ShapeMismatch { name, .. } if name.ends_with("token_embedding.weight")),
        "{err}"
    );
    let victim = "cond_stage_model.transformer.text_model.encoder.layers.1.mlp.fc2.bias";
    cat.retain(|t| t.name != victim);
    let pb = ParamBuilder::new(Some(&cat), 1024).unwrap();
    let err = ClipTextModel::new(&pb, tiny_config("clip_sd1", 1)).unwrap_err();
    assert!(err.to_string().contains(victim), "{err}");
}
