//! The SD3 / SD3.5 MMDiT against diffusers' `SD3Transformer2DModel` on tiny random weights
//! with Stability's single-file names (`scripts/fixtures/make_sd3_fixtures.py`): SD3
//! Medium's block (no QK norm) and SD3.5 Medium's (QK norm, MMDiT-X `attn2`), one forward
//! pass on a batch of two non-square latents, f32.

mod common;

use common::{io_in, ne};
use sd_formats::files::TensorCatalog;
use sd_models::mmdit::{MmditConfig, MmditModel};
use sd_models::run::run_cpu;
use sd_models::{load_all_to_cpu, ComputeOptions, GraphCtx, HostData, ParamBuilder};
use sd_tensor::DType;
use sd_testutil::rel_l2;

fn dir() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/sd3")
}

/// Runs the weights of `weights` on the inputs of fixture `name`; returns (config,
/// relative L2 error against diffusers).
fn run(weights: &TensorCatalog, name: &str) -> (MmditConfig, f64) {
    run_with(weights, "model.diffusion_model", name)
}

/// [`run`] with the parameters under `prefix`.
fn run_with(weights: &TensorCatalog, prefix: &str, name: &str) -> (MmditConfig, f64) {
    run_against(weights, prefix, name, "out")
}

/// [`run_with`] against the reference output `want`.
fn run_against(
    weights: &TensorCatalog,
    prefix: &str,
    name: &str,
    want: &str,
) -> (MmditConfig, f64) {
    let pb = ParamBuilder::new(Some(weights), 1024).unwrap();
    let config = MmditConfig {
        prefix: prefix.into(),
        ..MmditConfig::sd35_large()
    };
    let model = MmditModel::new(&pb, config).unwrap();
    let params = pb.finish();
    assert_eq!(params.tensors.len(), weights.len(), "every tensor is used");
    let _buf = load_all_to_cpu(&params, weights).unwrap();
    let io = io_in(&dir(), name);
    let mut g = GraphCtx::new(
        model.graph_size(),
        model.graph_size(),
        ComputeOptions {
            exact: true,
            flash_attn: false,
            // The CPU kernels, as `sd` runs DiTs on the CPU (ggml's attention, the other
            // backends' path, is held to diffusers by the UNet and CLIP tests).
            host_kernels: true,
        },
    )
    .unwrap();
    let new = |g: &GraphCtx, key: &str| g.ctx.new_tensor(DType::F32, &ne(&io[key].shape)).unwrap();
    let x = new(&g, "x");
    let context = new(&g, "context");
    let t = new(&g, "timestep");
    let y = new(&g, "pooled");
    let out = model.forward(&mut g, &x, &t, &context, &y).unwrap();
    assert_eq!(out.ne().to_vec(), ne(&io["out"].shape));
    let inputs = vec![
        (&x, HostData::F32(io["x"].data.clone())),
        (&context, HostData::F32(io["context"].data.clone())),
        (&t, HostData::F32(io["timestep"].data.clone())),
        (&y, HostData::F32(io["pooled"].data.clone())),
    ];
    let got = run_cpu(&g, &[&out], &inputs, model.graph_size(), 2).unwrap();
    (model.config.clone(), rel_l2(&got[0], &io[want].data))
}

fn sai(name: &str) -> TensorCatalog {
    let mut cat = TensorCatalog::new();
    cat.add_file(dir().join(format!("{name}.safetensors")), None)
        .unwrap();
    cat
}

#[test]
fn sd3_medium_block_matches_diffusers() {
    let (c, e) = run(&sai("sd3_tiny"), "sd3_tiny");
    println!("sd3 tiny: relative L2 {e:.2e}");
    assert_eq!((c.hidden_size, c.num_heads, c.depth), (64, 1, 2));
    assert_eq!((c.patch_size, c.in_channels, c.out_channels), (2, 16, 16));
    assert_eq!(
        (c.context_dim, c.pooled_dim, c.pos_embed_max_size),
        (64, 64, 8)
    );
    assert!(!c.qk_norm && c.dual_attention_layers.is_empty());
    assert!(e < 1e-4, "relative L2 {e:.3e}");
}

#[test]
fn sd35_mmditx_block_matches_diffusers() {
    let (c, e) = run(&sai("sd35_tiny"), "sd35_tiny");
    println!("sd3.5 tiny (MMDiT-X): relative L2 {e:.2e}");
    assert_eq!((c.hidden_size, c.num_heads, c.head_dim()), (64, 2, 32));
    assert!(c.qk_norm);
    assert_eq!(c.dual_attention_layers, [0]);
    assert!(e < 1e-4, "relative L2 {e:.3e}");
}

/// diffusers' names (`SD3Transformer2DModel`'s state dict, q/k/v apart, (scale, shift)
/// modulations), made from the Stability-named fixture, read as they are give the same
/// output.
#[test]
fn diffusers_names_match_diffusers() {
    use common::{rewrite_f32, row_slice};
    use sd_models::mmdit::MmditLayout;
    let tmp = std::env::temp_dir().join(format!("sd-rs-sd3-diffusers-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    let dst = tmp.join("sd35_tiny_diffusers.safetensors");
    let d = |sai: &str, leaf: &str| {
        let name = MmditLayout::Diffusers.name(sai);
        if leaf.is_empty() {
            format!("transformer.{name}")
        } else {
            format!("transformer.{name}.{leaf}")
        }
    };
    rewrite_f32(&dir().join("sd35_tiny.safetensors"), &dst, |t| {
        let rel =
            t.0.strip_prefix("model.diffusion_model.")
                .unwrap()
                .to_string();
        if rel == "pos_embed" {
            return vec![(d(&rel, ""), t.1.clone(), t.2.clone())];
        }
        let (stem, leaf) = rel.rsplit_once('.').unwrap();
        if let Some(base) = stem.strip_suffix(".qkv") {
            let h = t.1[0] / 3;
            return ["q", "k", "v"]
                .iter()
                .enumerate()
                .map(|(i, x)| {
                    let (s, v) = row_slice(&t, i * h, h);
                    (d(&format!("{base}.{x}"), leaf), s, v)
                })
                .collect();
        }
        // The final and the last (pre-only) context modulations: (shift, scale) -> (scale,
        // shift).
        if stem == "final_layer.adaLN_modulation.1"
            || stem == "joint_blocks.1.context_block.adaLN_modulation.1"
        {
            let h = t.1[0] / 2;
            let (s, shift) = row_slice(&t, 0, h);
            let (_, scale) = row_slice(&t, h, h);
            let mut shape = s;
            shape[0] = 2 * h;
            return vec![(d(stem, leaf), shape, [scale, shift].concat())];
        }
        vec![(d(stem, leaf), t.1.clone(), t.2.clone())]
    });
    let mut cat = TensorCatalog::new();
    cat.add_file(&dst, None).unwrap();
    std::fs::remove_dir_all(&tmp).ok();
    let pb = ParamBuilder::new(Some(&cat), 1024).unwrap();
    let config = MmditConfig {
        prefix: "transformer".into(),
        ..MmditConfig::sd35_large()
    };
    let model = MmditModel::new(&pb, config).unwrap();
    assert_eq!(model.config.layout, MmditLayout::Diffusers);
    assert_eq!(model.config.dual_attention_layers, [0]);
    drop(pb);
    let (_, e) = run_with(&cat, "transformer", "sd35_tiny");
    println!("sd3.5 tiny, diffusers names: relative L2 {e:.2e}");
    assert!(e < 1e-4, "relative L2 {e:.3e}");
}

/// A city96-style GGUF (Stability's names without prefix, matrices q8_0) against the
/// reference on the same weights quantized and dequantized (ggml also quantizes the
/// activations it multiplies q8_0 matrices with: a looser bound).
#[test]
fn q8_0_gguf_matches_diffusers_on_its_weights() {
    let mut cat = TensorCatalog::new();
    cat.add_file(
        dir().join("sd35_tiny_q8_0.gguf"),
        Some("model.diffusion_model."),
    )
    .unwrap();
    assert_eq!(
        cat.get("model.diffusion_model.joint_blocks.0.x_block.attn.qkv.weight")
            .map(|t| t.dtype),
        Some(DType::Q8_0)
    );
    let (c, e) = run_against(&cat, "model.diffusion_model", "sd35_tiny", "out_q8_0");
    let (_, e_f32) = run_against(&cat, "model.diffusion_model", "sd35_tiny", "out");
    println!("sd3.5 tiny, q8_0 GGUF: relative L2 {e:.2e} ({e_f32:.2e} to the f32 weights')");
    assert_eq!(c.dual_attention_layers, [0]);
    assert!(e < 2e-2, "relative L2 {e:.3e}");
}
