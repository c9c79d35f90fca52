//! SDXL parity against diffusers / transformers on tiny random configs (fixtures by
//! `scripts/fixtures/make_sdxl_fixtures.py`): the base UNet (per-level transformer depth,
//! `label_emb` on `y`) from diffusers and original single-file names, the refiner's UNet,
//! and OpenCLIP-bigG's penultimate hidden state and pooled projection from transformers and
//! OpenCLIP names. Configs are read from the tensors ([`UnetConfig::from_catalog`]).

mod common;

use common::{catalog_in, check, io_in, ne, rel_l2, sdxl_fixtures, Ref};
use sd_formats::files::TensorCatalog;
use sd_models::clip::{ClipTextConfig, ClipTextModel, TextProjection};
use sd_models::nn::{sinusoidal_embedding, Activation};
use sd_models::run::run_cpu;
use sd_models::unet::{HeadSpec, UnetConfig, UnetModel};
use sd_models::{load_all_to_cpu, ComputeOptions, GraphCtx, HostData, ModelError, ParamBuilder};
use sd_tensor::DType;

fn config(name: &str) -> serde_json::Value {
    let text = std::fs::read_to_string(sdxl_fixtures().join("sdxl.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v[name].clone()
}

/// The family template: what the tensors do not tell (4-wide heads, 4 groups).
fn template() -> UnetConfig {
    UnetConfig {
        heads: HeadSpec::HeadDim(4),
        norm_groups: 4,
        ..UnetConfig::sdxl()
    }
}

/// `y` as the original conditioner builds it: pooled text, then each time id embedded.
fn sdxl_y(refs: &std::collections::HashMap<String, Ref>, dim: usize) -> Vec<f32> {
    let (te, ids) = (&refs["text_embeds"], &refs["time_ids"]);
    let b = te.shape[0];
    let (pooled, n_ids) = (te.shape[1], ids.shape[1]);
    let mut y = Vec::new();
    for i in 0..b {
        y.extend_from_slice(&te.data[i * pooled..(i + 1) * pooled]);
        y.extend(sinusoidal_embedding(
            &ids.data[i * n_ids..(i + 1) * n_ids],
            dim,
        ));
    }
    y
}

fn unet_forward(cat: &TensorCatalog, fixture: &str) -> (UnetConfig, Vec<f32>, Vec<f32>) {
    let cfg = UnetConfig::from_catalog(cat, &template()).unwrap();
    let pb = ParamBuilder::new(Some(cat), 2048).unwrap();
    let unet = UnetModel::new(&pb, cfg.clone()).unwrap();
    let params = pb.finish();
    assert_eq!(params.tensors.len(), cat.len(), "every tensor is used");
    let _buf = load_all_to_cpu(&params, cat).unwrap();
    let refs = io_in(&sdxl_fixtures(), fixture);
    let time_dim = config(fixture)["addition_time_embed_dim"].as_u64().unwrap() as usize;
    let y = sdxl_y(&refs, time_dim);
    check(&format!("{fixture} y"), &y, &refs["y"].data, 1e-5);

    let (xr, tr, cr) = (&refs["x"], &refs["timesteps"], &refs["context"]);
    let mut g = GraphCtx::new(16384, 16384, ComputeOptions::default()).unwrap();
    let x = g.ctx.new_tensor(DType::F32, &ne(&xr.shape)).unwrap();
    let t = g.ctx.new_tensor(DType::F32, &ne(&tr.shape)).unwrap();
    let c = g.ctx.new_tensor(DType::F32, &ne(&cr.shape)).unwrap();
    let b = xr.shape[0];
    let yt = g.ctx.new_tensor(DType::F32, &[y.len() / b, b]).unwrap();
    let out = unet.forward(&mut g, &x, &t, &c, Some(&yt)).unwrap();
    let want = &refs["out"];
    assert_eq!(out.ne().to_vec(), ne(&want.shape));
    let inputs = [
        (&x, HostData::F32(xr.data.clone())),
        (&t, HostData::F32(tr.data.clone())),
        (&c, HostData::F32(cr.data.clone())),
        (&yt, HostData::F32(y)),
    ];
    let got = run_cpu(&g, &[&out], &inputs, 16384, 2).unwrap();
    (cfg, got.into_iter().next().unwrap(), want.data.clone())
}

#[test]
fn unet_sdxl_reads_its_structure_from_the_tensors() {
    let cat = catalog_in(&sdxl_fixtures(), "unet_sdxl");
    let cfg = UnetConfig::from_catalog(&cat, &template()).unwrap();
    assert_eq!(cfg.model_channels, 8);
    assert_eq!(cfg.channel_mult, [1, 2, 2]);
    assert_eq!(cfg.num_res_blocks, 2);
    // diffusers' transformer_layers_per_block [1, 1, 2]: level 0 has no attention.
    assert_eq!(cfg.transformer_depth, [0, 1, 2]);
    assert_eq!(cfg.attention_resolutions, [4, 2]);
    assert_eq!(cfg.middle_depth(), 2);
    assert_eq!(cfg.context_dim, 20);
    assert_eq!(cfg.adm_in_channels, Some(16 + 6 * 8));
    assert!(cfg.use_linear_in_transformer);
    // The real SDXL and refiner configs read back from their own declarations.
    for real in [UnetConfig::sdxl(), UnetConfig::sdxl_refiner()] {
        let pb = ParamBuilder::new(None, 4096).unwrap();
        UnetModel::new(&pb, real.clone()).unwrap();
        let params = pb.finish();
        let shape_of = |name: &str| {
            let t = params.tensors.get(name)?;
            Some(t.shape(t.n_dims().max(1)))
        };
        let back = UnetConfig::from_shapes(shape_of, &real).unwrap();
        assert_eq!(back, real);
    }
}

#[test]
fn unet_sdxl_matches_diffusers() {
    let cat = catalog_in(&sdxl_fixtures(), "unet_sdxl");
    let (_, got, want) = unet_forward(&cat, "unet_sdxl");
    check("unet_sdxl", &got, &want, 1e-4);
}

#[test]
fn unet_sdxl_original_single_file_names_match_diffusers() {
    // The original layout (checked against diffusers' own single-file conversion by the
    // fixture script) converts to the same canonical tensors and gives the same output.
    let original = catalog_in(&sdxl_fixtures(), "unet_sdxl_original");
    let diffusers = catalog_in(&sdxl_fixtures(), "unet_sdxl");
    let names = |c: &TensorCatalog| {
        let mut v: Vec<String> = c.tensors().map(|t| t.name.clone()).collect();
        v.sort();
        v
    };
    assert_eq!(names(&original), names(&diffusers));
    let (_, got, want) = unet_forward(&original, "unet_sdxl");
    check("unet_sdxl original names", &got, &want, 1e-4);
}

#[test]
fn unet_sdxl_refiner_matches_diffusers() {
    let cat = catalog_in(&sdxl_fixtures(), "unet_sdxl_refiner");
    let (cfg, got, want) = unet_forward(&cat, "unet_sdxl_refiner");
    assert_eq!(cfg.channel_mult, [1, 1, 2, 2]);
    // Depth 2 at both attention levels and the middle: LDM's single number.
    assert_eq!(cfg.transformer_depth, [2]);
    assert_eq!(cfg.attention_resolutions, [4, 2]);
    assert_eq!(cfg.adm_in_channels, Some(16 + 5 * 8));
    check("unet_sdxl_refiner", &got, &want, 1e-4);
}

#[test]
fn unet_label_emb_needs_y_and_only_then() {
    let cat = catalog_in(&sdxl_fixtures(), "unet_sdxl");
    let pb = ParamBuilder::new(Some(&cat), 2048).unwrap();
    let cfg = UnetConfig::from_catalog(&cat, &template()).unwrap();
    let unet = UnetModel::new(&pb, cfg).unwrap();
    let mut g = GraphCtx::new(16384, 16384, ComputeOptions::default()).unwrap();
    let x = g.ctx.new_tensor(DType::F32, &[16, 16, 4, 1]).unwrap();
    let t = g.ctx.new_tensor(DType::F32, &[1]).unwrap();
    let c = g.ctx.new_tensor(DType::F32, &[20, 7, 1]).unwrap();
    let err = unet.forward(&mut g, &x, &t, &c, None).unwrap_err();
    assert!(matches!(err, ModelError::Input { name: "y", .. }), "{err}");
    let y = g.ctx.new_tensor(DType::F32, &[63, 1]).unwrap();
    let err = unet.forward(&mut g, &x, &t, &c, Some(&y)).unwrap_err();
    assert!(err.to_string().contains("[64, 1]"), "{err}");
}

fn clip_g_config() -> ClipTextConfig {
    let c = config("clip_g");
    let u = |k: &str| c[k].as_u64().unwrap() as usize;
    ClipTextConfig {
        vocab_size: u("vocab_size"),
        hidden_size: u("hidden_size"),
        intermediate_size: u("intermediate_size"),
        num_hidden_layers: u("num_hidden_layers"),
        num_attention_heads: u("num_attention_heads"),
        max_position_embeddings: u("max_position_embeddings"),
        hidden_act: Activation::Gelu,
        projection_dim: Some(u("projection_dim")),
        ..ClipTextConfig::sdxl_clip_g()
    }
}

fn clip_g(file: &str) -> (bool, Vec<f32>, Vec<f32>) {
    let cat = catalog_in(&sdxl_fixtures(), file);
    let pb = ParamBuilder::new(Some(&cat), 1024).unwrap();
    let model = ClipTextModel::new(&pb, clip_g_config()).unwrap();
    let openclip = matches!(model.text_projection, Some(TextProjection::OpenClip(_)));
    let params = pb.finish();
    let _buf = load_all_to_cpu(&params, &cat).unwrap();
    let refs = io_in(&sdxl_fixtures(), "clip_g");
    let ids_ref = &refs["input_ids"];
    let ids: Vec<i32> = ids_ref.data.iter().map(|&v| v as i32).collect();
    let n = ids_ref.shape[1];
    // The pooled position: the largest id (end of text), first occurrence.
    let pool_at: Vec<usize> = ids
        .chunks(n)
        .map(|row| {
            let max = row.iter().max().unwrap();
            row.iter().position(|v| v == max).unwrap()
        })
        .collect();
    let mut g = GraphCtx::new(2048, 4096, ComputeOptions::default()).unwrap();
    let input = g.ctx.new_tensor(DType::I32, &ne(&ids_ref.shape)).unwrap();
    let (hidden, pooled) = model.forward_with_pooled(&mut g, &input, &pool_at).unwrap();
    let got = run_cpu(
        &g,
        &[&hidden, &pooled],
        &[(&input, HostData::I32(ids))],
        4096,
        2,
    )
    .unwrap();
    check(
        &format!("{file} penultimate"),
        &got[0],
        &refs["penultimate"].data,
        1e-4,
    );
    (openclip, got[1].clone(), refs["pooled"].data.clone())
}

#[test]
fn clip_g_penultimate_and_pooled_match_transformers() {
    let (openclip, pooled, want) = clip_g("clip_g");
    assert!(!openclip, "transformers names give the Linear projection");
    check("clip_g pooled", &pooled, &want, 1e-4);
}

#[test]
fn clip_g_from_openclip_names_matches_transformers() {
    // Fused in_proj split by the name conversion, OpenCLIP's transposed projection.
    let (openclip, pooled, want) = clip_g("clip_g_original");
    assert!(openclip, "OpenCLIP names keep their projection layout");
    check("clip_g (OpenCLIP names) pooled", &pooled, &want, 1e-4);
    assert!(rel_l2(&pooled, &want) < 1e-4);
}
