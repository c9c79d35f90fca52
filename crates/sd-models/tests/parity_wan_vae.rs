//! Wan-2.1 / Qwen-Image VAE parity against diffusers' `AutoencoderKLQwenImage` on one
//! 64 x 48 image (tiny random weights, fixtures by
//! `scripts/fixtures/make_wan_vae_fixtures.py`): encoder moments and mean, decoder output,
//! both name layouts, size detection, latent normalisation.

mod common;

use std::path::PathBuf;

use common::{catalog_in, check, io_in, Ref};
use sd_formats::files::TensorCatalog;
use sd_formats::names::VAE_PREFIX;
use sd_models::run::run_cpu;
use sd_models::wan_vae::{WanVae, WanVaeConfig, WAN21_LATENTS_MEAN, WAN21_LATENTS_STD};
use sd_models::{load_all_to_cpu, ComputeOptions, GraphCtx, HostData, ParamBuilder};
use sd_tensor::DType;

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/wan_vae")
}

/// The diffusers-layout file (under `vae.`, as a diffusers folder is read).
const DIFFUSERS: &str = "wan_vae_diffusers";
/// The original Wan layout without prefix (ComfyUI's `qwen_image_vae.safetensors`).
const WAN: &str = "wan_vae";

/// `[N, C, T = 1, H, W]` to ggml `[W, H, C, N]`.
fn image_ne(r: &Ref) -> Vec<usize> {
    assert_eq!(r.shape.len(), 5);
    assert_eq!(r.shape[2], 1, "one frame");
    vec![r.shape[4], r.shape[3], r.shape[1], r.shape[0]]
}

fn expected_config() -> WanVaeConfig {
    WanVaeConfig {
        base_dim: 8,
        z_dim: 16,
        dim_mult: vec![1, 2, 4, 4],
        num_res_blocks: 2,
        ..WanVaeConfig::default()
    }
}

/// Runs the encoder (`encode`) or decoder of the model in `file` on the fixture input.
fn run(file: &str, encode: bool, opts: ComputeOptions, f32_weights: bool) -> (Vec<f32>, Vec<f32>) {
    let cat = catalog_in(&dir(), file);
    let pb = ParamBuilder::new(Some(&cat), 1024).unwrap();
    if f32_weights {
        pb.set_weight_type(Some(DType::F32));
    }
    let cfg = WanVaeConfig::from_tensors(&pb, VAE_PREFIX).unwrap();
    assert_eq!(cfg, expected_config());
    let vae = WanVae::new(&pb, cfg).unwrap();
    let _buf = load_all_to_cpu(&pb.finish(), &cat).unwrap();
    // Every tensor of the file is used but the resamples' temporal convolutions.
    let time_convs = cat
        .names_with_prefix("")
        .filter(|n| n.contains(".time_conv."))
        .count();
    assert_eq!(time_convs, 8);
    assert_eq!(pb.finish().tensors.len() + time_convs, cat.len());
    let refs = io_in(&dir(), "wan_vae");
    let (inp, want) = if encode {
        (&refs["x"], &refs["moments"])
    } else {
        (&refs["z"], &refs["decoded"])
    };
    let mut g = GraphCtx::new(8192, 8192, opts).unwrap();
    let x = g.ctx.new_tensor(DType::F32, &image_ne(inp)).unwrap();
    let out = if encode {
        vae.encode(&mut g, &x).unwrap()
    } else {
        vae.decode(&mut g, &x).unwrap()
    };
    assert_eq!(out.ne().to_vec(), image_ne(want));
    let got = run_cpu(
        &g,
        &[&out],
        &[(&x, HostData::F32(inp.data.clone()))],
        8192,
        2,
    )
    .unwrap();
    (got.into_iter().next().unwrap(), want.data.clone())
}

#[test]
fn wan_vae_encode_matches_diffusers() {
    let (got, want) = run(DIFFUSERS, true, ComputeOptions::default(), true);
    check("wan vae encode moments", &got, &want, 1e-4);
    // `encode(x).latent_dist.mean`: the first z_dim channels.
    let refs = io_in(&dir(), "wan_vae");
    let mean = &refs["mean"];
    check(
        "wan vae latent mean",
        &got[..mean.data.len()],
        &mean.data,
        1e-4,
    );
}

#[test]
fn wan_vae_decode_matches_diffusers() {
    let (got, want) = run(DIFFUSERS, false, ComputeOptions::default(), true);
    check("wan vae decode", &got, &want, 1e-4);
    assert!(got.iter().all(|v| (-1.0..=1.0).contains(v)), "clamped");
}

#[test]
fn wan_layout_file_gives_the_same_result() {
    for encode in [true, false] {
        let (a, _) = run(DIFFUSERS, encode, ComputeOptions::default(), true);
        let (b, _) = run(WAN, encode, ComputeOptions::default(), true);
        assert_eq!(a, b, "encode {encode}");
    }
}

#[test]
fn both_layouts_have_the_same_canonical_names() {
    let names = |c: &TensorCatalog| {
        let mut v: Vec<String> = c.names_with_prefix("").map(str::to_owned).collect();
        v.sort();
        v
    };
    let a = names(&catalog_in(&dir(), DIFFUSERS));
    let b = names(&catalog_in(&dir(), WAN));
    assert_eq!(a, b);
    assert!(a.iter().all(|n| n.starts_with(VAE_PREFIX)), "{a:?}");
    assert!(a.contains(&format!(
        "{VAE_PREFIX}decoder.upsamples.11.resample.1.weight"
    )));
    assert!(a.contains(&format!("{VAE_PREFIX}conv2.bias")));
}

#[test]
fn wan_vae_fast_numerics_stay_close() {
    // The file's f16 weights, f16 im2col: what a pipeline runs.
    let opts = ComputeOptions {
        exact: false,
        flash_attn: true,
        host_kernels: false,
    };
    let (got, want) = run(WAN, false, opts, false);
    check("wan vae decode fast", &got, &want, 1e-2);
    let (got, want) = run(WAN, true, opts, false);
    check("wan vae encode fast", &got, &want, 1e-2);
}

#[test]
fn decoder_only_files_are_detected() {
    let mut cat = catalog_in(&dir(), WAN);
    cat.remove_with_prefix(&format!("{VAE_PREFIX}encoder."));
    let pb = ParamBuilder::new(Some(&cat), 1024).unwrap();
    let cfg = WanVaeConfig::from_tensors(&pb, VAE_PREFIX).unwrap();
    assert!(!cfg.with_encoder && cfg.with_decoder);
    assert_eq!(
        cfg,
        WanVaeConfig {
            with_encoder: false,
            ..expected_config()
        }
    );
    let vae = WanVae::new(&pb, cfg).unwrap();
    let mut g = GraphCtx::new(1024, 1024, ComputeOptions::default()).unwrap();
    let x = g.ctx.new_tensor(DType::F32, &[64, 48, 3, 1]).unwrap();
    assert!(vae.encode(&mut g, &x).is_err());
    // Nothing there at all.
    let empty = TensorCatalog::new();
    let pb = ParamBuilder::new(Some(&empty), 16).unwrap();
    assert!(WanVaeConfig::from_tensors(&pb, VAE_PREFIX).is_err());
}

#[test]
fn wan_vae_rejects_bad_input_shape() {
    let pb = ParamBuilder::new(None, 1024).unwrap();
    let vae = WanVae::new(&pb, expected_config()).unwrap();
    let mut g = GraphCtx::new(1024, 1024, ComputeOptions::default()).unwrap();
    let x = g.ctx.new_tensor(DType::F32, &[60, 48, 3, 1]).unwrap();
    assert!(vae.encode(&mut g, &x).is_err());
    let z = g.ctx.new_tensor(DType::F32, &[8, 6, 4, 1]).unwrap();
    assert!(vae.decode(&mut g, &z).is_err());
    let bad = WanVaeConfig {
        dim_mult: vec![],
        ..expected_config()
    };
    assert!(WanVae::new(&ParamBuilder::new(None, 16).unwrap(), bad).is_err());
}

#[test]
fn latent_normalisation_round_trips() {
    let cfg = WanVaeConfig::default();
    assert_eq!(cfg.latents_mean, WAN21_LATENTS_MEAN);
    assert_eq!(cfg.latents_std, WAN21_LATENTS_STD);
    assert_eq!(cfg.downsample_factor(), 8);
    // Two images of 16 channels x 2 x 3.
    let plane = 6;
    let z: Vec<f32> = (0..2 * 16 * plane)
        .map(|i| (i as f32 * 0.37).sin() * 3.0)
        .collect();
    let mut n = z.clone();
    cfg.normalize_latents(&mut n, plane).unwrap();
    for (i, (&a, &b)) in z.iter().zip(&n).enumerate() {
        let c = (i / plane) % 16;
        let want = (a - WAN21_LATENTS_MEAN[c]) / WAN21_LATENTS_STD[c];
        assert!((b - want).abs() < 1e-6, "{i}: {b} vs {want}");
    }
    cfg.denormalize_latents(&mut n, plane).unwrap();
    for (a, b) in z.iter().zip(&n) {
        assert!((a - b).abs() < 1e-5);
    }
    // Not whole images, no planes, short tables: errors, no panic.
    assert!(cfg.normalize_latents(&mut n[..10], plane).is_err());
    assert!(cfg.normalize_latents(&mut n, 0).is_err());
    let short = WanVaeConfig {
        latents_std: vec![1.0; 4],
        ..WanVaeConfig::default()
    };
    assert!(short.denormalize_latents(&mut n, plane).is_err());
}

#[test]
fn config_reads_diffusers_json() {
    let json = r#"{"_class_name": "AutoencoderKLQwenImage", "attn_scales": [],
        "base_dim": 96, "dim_mult": [1, 2, 4, 4], "dropout": 0.0, "num_res_blocks": 2,
        "temperal_downsample": [false, true, true], "z_dim": 16}"#;
    let cfg: WanVaeConfig = serde_json::from_str(json).unwrap();
    assert_eq!(cfg, WanVaeConfig::default());
}

#[test]
fn full_size_graphs_fit_the_first_stage_graph_size() {
    use sd_models::first_stage::{FirstStage, FirstStageArch};
    use sd_tensor::ggml::Graph;
    // Qwen-Image's VAE (base 96) at 1024 x 768, descriptors only.
    let arch = FirstStageArch::Wan(WanVaeConfig::default());
    assert_eq!(arch.latent_channels(), 16);
    assert_eq!(arch.downsample_factor(), 8);
    assert_eq!(
        arch.encoder_probe(),
        format!("{VAE_PREFIX}encoder.conv1.weight")
    );
    let pb = ParamBuilder::new(None, 1024).unwrap();
    let fs = FirstStage::new(&pb, &arch).unwrap();
    assert!(fs.has_encoder());
    let size = fs.graph_size();
    for encode in [true, false] {
        let mut g = GraphCtx::new(size, size, ComputeOptions::default()).unwrap();
        let out = if encode {
            let x = g.ctx.new_tensor(DType::F32, &[1024, 768, 3, 1]).unwrap();
            fs.encode(&mut g, &x).unwrap()
        } else {
            let z = g.ctx.new_tensor(DType::F32, &[128, 96, 16, 1]).unwrap();
            fs.decode(&mut g, &z).unwrap()
        };
        let mut graph = Graph::new(&g.ctx, size).unwrap();
        graph.build_forward_expand(&out).unwrap();
        println!("encode {encode}: {} nodes of {size}", graph.n_nodes());
        assert!(graph.n_nodes() < size);
    }
}
