//! The FLUX.1 transformer against diffusers' `FluxTransformer2DModel` on tiny random
//! weights with Black Forest Labs' checkpoint names (`scripts/fixtures/make_flux_fixtures.py`):
//! dev (guidance embedding) and schnell, one forward pass on packed tokens, f32.

mod common;

use common::{io_in, ne};
use sd_formats::files::TensorCatalog;
use sd_models::dit::TextTokens;
use sd_models::flux::{rope_tables, FluxConfig, FluxInputs, FluxModel};
use sd_models::run::run_cpu;
use sd_models::{load_all_to_cpu, ComputeOptions, GraphCtx, HostData, ParamBuilder};
use sd_tensor::DType;
use sd_testutil::rel_l2;

fn dir() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/flux")
}

fn ids(v: &[f32]) -> Vec<[f32; 3]> {
    v.chunks_exact(3).map(|c| [c[0], c[1], c[2]]).collect()
}

/// The options of the parity runs: f32 formulas on the project's CPU kernels, as `sd` runs
/// DiTs on the CPU (ggml's ops are checked by the tests that say so).
const EXACT_HOST: ComputeOptions = ComputeOptions {
    exact: true,
    flash_attn: false,
    host_kernels: true,
};

/// Runs fixture `name` and returns (config, relative L2 error against diffusers).
fn run(name: &str) -> (FluxConfig, f64) {
    run_with(name, EXACT_HOST)
}

/// [`run`] with `opts`.
fn run_with(name: &str, opts: ComputeOptions) -> (FluxConfig, f64) {
    let mut cat = TensorCatalog::new();
    cat.add_file(dir().join(format!("{name}.safetensors")), None)
        .unwrap();
    let pb = ParamBuilder::new(Some(&cat), 1024).unwrap();
    let model = FluxModel::new(&pb, FluxConfig::dev()).unwrap();
    let params = pb.finish();
    assert_eq!(params.tensors.len(), cat.len(), "every tensor is used");
    let e = run_model(&model, &params, &cat, name, "out", opts);
    (model.config.clone(), e)
}

/// Runs `model` (its parameters `params` from `cat`) on the inputs of fixture `name`;
/// returns the relative L2 error against diffusers.
fn run_model(
    model: &FluxModel,
    params: &sd_models::Params,
    cat: &TensorCatalog,
    name: &str,
    want: &str,
    opts: ComputeOptions,
) -> f64 {
    let _buf = load_all_to_cpu(params, cat).unwrap();
    let io = io_in(&dir(), name);
    let mut g = GraphCtx::new(model.graph_size(), model.graph_size(), opts).unwrap();
    let new = |g: &GraphCtx, key: &str| g.ctx.new_tensor(DType::F32, &ne(&io[key].shape)).unwrap();
    let img = new(&g, "img");
    let txt = new(&g, "txt");
    let t = new(&g, "timestep");
    let y = new(&g, "pooled");
    let guidance = io.contains_key("guidance").then(|| new(&g, "guidance"));
    let (img_ids, txt_ids) = (ids(&io["img_ids"].data), ids(&io["txt_ids"].data));
    let out = model
        .forward_tokens(
            &mut g,
            &FluxInputs {
                img: &img,
                txt: TextTokens::States(&txt),
                timesteps: &t,
                y: &y,
                guidance: guidance.as_ref(),
                img_ids: &img_ids,
                txt_ids: &txt_ids,
            },
        )
        .unwrap();
    assert_eq!(out.ne()[..3].to_vec(), ne(&io["out"].shape));
    if opts.exact && opts.host_kernels {
        // Every MLP's GELU (two per double block, one per single block) is one op of the
        // project's tanh-GELU kernel.
        let gelus = common::nodes_named(
            &g.ctx,
            &out,
            model.graph_size(),
            sd_tensor::ggml::GELU_TANH_HOST_NAME,
        );
        let c = &model.config;
        assert_eq!(gelus, 2 * c.depth + c.depth_single_blocks);
    }
    let mut inputs = vec![
        (&img, HostData::F32(io["img"].data.clone())),
        (&txt, HostData::F32(io["txt"].data.clone())),
        (&t, HostData::F32(io["timestep"].data.clone())),
        (&y, HostData::F32(io["pooled"].data.clone())),
    ];
    if let Some(gt) = &guidance {
        inputs.push((gt, HostData::F32(io["guidance"].data.clone())));
    }
    let got = run_cpu(&g, &[&out], &inputs, model.graph_size(), 2).unwrap();
    rel_l2(&got[0], &io[want].data)
}

#[test]
fn flux_dev_matches_diffusers() {
    let (c, e) = run("flux_tiny");
    println!("flux dev tiny: relative L2 {e:.2e}");
    assert_eq!(
        (c.hidden_size, c.num_heads, c.depth, c.depth_single_blocks),
        (64, 2, 2, 2)
    );
    assert_eq!((c.axes_dim, c.guidance_embed), ([4, 14, 14], true));
    assert_eq!(
        (c.context_in_dim, c.vec_in_dim, c.in_channels),
        (32, 32, 64)
    );
    assert!(e < 1e-4, "relative L2 {e:.3e}");
}

/// ggml's ops as the GPUs run them: flash attention (f16 K and V read through permuted
/// views of their contiguous casts), GELU's kernel, the rotation as ggml's multi-section
/// rope on q and k laid out for it; within f16's precision of diffusers' f32 output.
#[test]
fn flux_ggml_ops_with_flash_attention_stay_close() {
    let opts = ComputeOptions {
        exact: false,
        flash_attn: true,
        host_kernels: false,
    };
    let (_, e) = run_with("flux_tiny", opts);
    println!("flux dev tiny, ggml ops and flash attention: relative L2 {e:.2e}");
    assert!(e < 1e-2, "relative L2 {e:.3e}");
}

#[test]
fn flux_schnell_matches_diffusers() {
    let (c, e) = run("flux_tiny_schnell");
    println!("flux schnell tiny: relative L2 {e:.2e}");
    assert!(!c.guidance_embed);
    assert!(e < 1e-4, "relative L2 {e:.3e}");
}

#[test]
fn rope_tables_follow_the_axes() {
    // Head width 32: axes (4, 14, 14) -> 2 + 7 + 7 frequencies.
    let (cos, sin) = rope_tables(&[[0.0, 2.0, 3.0]], [4, 14, 14], 10_000.0);
    assert_eq!(cos.len(), 16);
    // Axis 0 (id 0): angle 0.
    assert_eq!((cos[0], sin[0]), (1.0, 0.0));
    // Axis 1, frequency 0: angle = id = 2.
    assert!((sin[2] - 2f32.sin()).abs() < 1e-6);
    // Axis 2, frequency 1: 3 * 10000^(-2/14).
    let a = 3.0f64 * 10_000f64.powf(-2.0 / 14.0);
    assert!((cos[10] as f64 - a.cos()).abs() < 1e-6);
}

/// ggml's multi-section rope on q laid out for it gives the host tables' rotation (values
/// moved as `Rope::lay_out` moves them): FLUX.1's head width and axes, a 32x32 grid of
/// image ids after 8 text tokens, two images.
#[test]
fn rope_sections_equal_the_tables() {
    use sd_models::dit::Rope;
    let (heads, d, axes) = (2usize, 128usize, [16, 56, 56]);
    let mut ids = vec![[0.0f32; 3]; 8];
    ids.extend((0..32).flat_map(|r| (0..32).map(move |c| [0.0, r as f32, c as f32])));
    let n = ids.len();
    let b = 2;
    let mut g = GraphCtx::new(64, 64, ComputeOptions::default()).unwrap();
    let ctx = g.ctx.clone();
    let x = ctx.new_tensor(DType::F32, &[heads * d, n, b]).unwrap();
    let sections = Rope::new(&mut g, "s", &ids, axes, 10_000.0, d).unwrap();
    let tables = Rope::new_tables(&mut g, "t", &ids, axes, 10_000.0, d).unwrap();
    assert!(sections.is_sections() && !tables.is_sections());
    let got = sections
        .apply(&ctx, &sections.lay_out(&ctx, &x, heads).unwrap(), heads)
        .unwrap();
    let want = tables.apply(&ctx, &x, heads).unwrap();
    let data: Vec<f32> = (0..heads * d * n * b)
        .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
        .collect();
    let out = run_cpu(&g, &[&got, &want], &[(&x, HostData::F32(data))], 64, 2).unwrap();
    // Head value 2j + e of the tables' layout is value j + e d / 2 of the laid-out one.
    let mut worst = 0f32;
    for (row, want_row) in out[1].chunks_exact(d).enumerate() {
        let got_row = &out[0][row * d..(row + 1) * d];
        for (i, w) in want_row.iter().enumerate() {
            let g = got_row[i / 2 + (i % 2) * d / 2];
            worst = worst.max((g - w).abs());
        }
    }
    println!("rope sections against tables: max abs difference {worst:.2e}");
    assert!(worst < 1e-4, "{worst}");
}

/// Unpacks tokens `[B, (h/2)(w/2), 4c]` (diffusers' `_pack_latents` layout) into latents
/// `[B, c, h, w]`, row-major.
fn unpack(tokens: &[f32], b: usize, c: usize, h: usize, w: usize) -> Vec<f32> {
    let (h2, w2) = (h / 2, w / 2);
    let mut out = vec![0.0; b * c * h * w];
    for bi in 0..b {
        for r in 0..h2 {
            for col in 0..w2 {
                for ch in 0..c {
                    for ph in 0..2 {
                        for pw in 0..2 {
                            let t = ((bi * h2 + r) * w2 + col) * 4 * c + ch * 4 + ph * 2 + pw;
                            let l = ((bi * c + ch) * h + 2 * r + ph) * w + 2 * col + pw;
                            out[l] = tokens[t];
                        }
                    }
                }
            }
        }
    }
    out
}

/// The latent-level forward (`DiffusionNet::Flux`: packing, position ids, unpacking) gives
/// the reference's output on the latents the reference's tokens pack.
#[test]
fn the_latent_forward_packs_like_diffusers() {
    use sd_models::diffusion::{DiffusionArch, DiffusionInputs, DiffusionNet};
    let name = "flux_tiny";
    let mut cat = TensorCatalog::new();
    cat.add_file(dir().join(format!("{name}.safetensors")), None)
        .unwrap();
    let pb = ParamBuilder::new(Some(&cat), 1024).unwrap();
    let net = DiffusionNet::new(&pb, &DiffusionArch::Flux(FluxConfig::dev())).unwrap();
    let params = pb.finish();
    let _buf = load_all_to_cpu(&params, &cat).unwrap();
    let io = io_in(&dir(), name);
    let (b, c, h, w) = (2, 16, 8, 8);
    let latents = unpack(&io["img"].data, b, c, h, w);
    let want = unpack(&io["out"].data, b, c, h, w);
    let mut g = GraphCtx::new(
        net.graph_size(),
        net.graph_size(),
        ComputeOptions {
            exact: true,
            flash_attn: false,
            host_kernels: false,
        },
    )
    .unwrap();
    let f32t = |ne: &[usize]| g.ctx.new_tensor(DType::F32, ne).unwrap();
    let (x, t, ctx, y, gd) = (
        f32t(&[w, h, c, b]),
        f32t(&[b]),
        f32t(&ne(&io["txt"].shape)),
        f32t(&ne(&io["pooled"].shape)),
        f32t(&[b]),
    );
    let mut inputs = DiffusionInputs::new(&x, &t);
    inputs.context = Some(&ctx);
    inputs.y = Some(&y);
    inputs.guidance = Some(&gd);
    let out = net.forward(&mut g, &inputs).unwrap();
    assert_eq!(out.ne(), [w, h, c, b]);
    let got = run_cpu(
        &g,
        &[&out],
        &[
            (&x, HostData::F32(latents)),
            (&t, HostData::F32(io["timestep"].data.clone())),
            (&ctx, HostData::F32(io["txt"].data.clone())),
            (&y, HostData::F32(io["pooled"].data.clone())),
            (&gd, HostData::F32(io["guidance"].data.clone())),
        ],
        net.graph_size(),
        2,
    )
    .unwrap();
    let e = rel_l2(&got[0], &want);
    println!("flux dev tiny through DiffusionNet on latents: relative L2 {e:.2e}");
    assert!(e < 1e-4, "relative L2 {e:.3e}");
}

/// FLUX.1's autoencoder layout (16 latent channels, no quant convs) against diffusers'
/// `AutoencoderKL` at a tiny width: encoder moments and decoder output.
#[test]
fn the_16_channel_autoencoder_matches_diffusers() {
    use sd_models::vae::{AutoencoderKl, VaeConfig};
    let cat = common::catalog_in(&dir(), "vae16");
    let cfg = VaeConfig {
        ch: 8,
        ch_mult: vec![1, 2],
        num_res_blocks: 1,
        z_channels: 16,
        norm_groups: 4,
        use_quant_conv: false,
        ..VaeConfig::default()
    };
    let pb = ParamBuilder::new(Some(&cat), 1024).unwrap();
    let vae = AutoencoderKl::new(&pb, cfg).unwrap();
    let params = pb.finish();
    assert_eq!(params.tensors.len(), cat.len(), "every tensor is used");
    let _buf = load_all_to_cpu(&params, &cat).unwrap();
    let io = io_in(&dir(), "vae16");
    for (encode, input, want) in [(true, "x", "moments"), (false, "z", "decoded")] {
        let mut g = GraphCtx::new(4096, 4096, ComputeOptions::default()).unwrap();
        let x = g.ctx.new_tensor(DType::F32, &ne(&io[input].shape)).unwrap();
        let out = if encode {
            vae.encode(&mut g, &x).unwrap()
        } else {
            vae.decode(&mut g, &x).unwrap()
        };
        assert_eq!(out.ne().to_vec(), ne(&io[want].shape), "{want}");
        let got = run_cpu(
            &g,
            &[&out],
            &[(&x, HostData::F32(io[input].data.clone()))],
            4096,
            2,
        )
        .unwrap();
        let e = rel_l2(&got[0], &io[want].data);
        println!("16-channel VAE {want}: relative L2 {e:.2e}");
        assert!(e < 1e-4, "{want}: relative L2 {e:.3e}");
    }
}

/// diffusers' names (`FluxTransformer2DModel`'s state dict: q/k/v and a single block's MLP
/// input apart, the final modulation as (scale, shift)), made from the BFL fixture and read
/// as they are, give the same output.
#[test]
fn diffusers_names_match_diffusers() {
    use common::{rewrite_f32, row_slice};
    use sd_models::flux::FluxLayout;
    let tmp = std::env::temp_dir().join(format!("sd-rs-flux-diffusers-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    let dst = tmp.join("flux_tiny_diffusers.safetensors");
    let prefix = "model.diffusion_model.";
    let d = |bfl: &str| format!("transformer.{}", FluxLayout::Diffusers.name(bfl));
    rewrite_f32(&dir().join("flux_tiny.safetensors"), &dst, |t| {
        let rel = t.0.strip_prefix(prefix).unwrap().to_string();
        let (stem, leaf) = rel.rsplit_once('.').unwrap();
        let h = 64;
        let parts = |names: &[(&str, usize)]| -> Vec<common::F32Tensor> {
            let mut from = 0;
            names
                .iter()
                .map(|(n, rows)| {
                    let (s, v) = row_slice(&t, from, *rows);
                    from += rows;
                    (d(&format!("{n}.{leaf}")), s, v)
                })
                .collect()
        };
        if let Some(base) = stem.strip_suffix(".qkv") {
            return parts(&[
                (&format!("{base}.q"), h),
                (&format!("{base}.k"), h),
                (&format!("{base}.v"), h),
            ]);
        }
        if let Some(base) = stem.strip_suffix(".linear1") {
            let m = t.1[0] - 3 * h;
            return parts(&[
                (&format!("{base}.q"), h),
                (&format!("{base}.k"), h),
                (&format!("{base}.v"), h),
                (&format!("{base}.mlp_in"), m),
            ]);
        }
        if stem == "final_layer.adaLN_modulation.1" {
            let (s1, shift) = row_slice(&t, 0, h);
            let (_, scale) = row_slice(&t, h, h);
            let mut shape = s1;
            shape[0] = 2 * h;
            return vec![(d(&rel), shape, [scale, shift].concat())];
        }
        vec![(d(&rel), t.1.clone(), t.2.clone())]
    });
    let mut cat = TensorCatalog::new();
    cat.add_file(&dst, None).unwrap();
    std::fs::remove_dir_all(&tmp).ok();
    let pb = ParamBuilder::new(Some(&cat), 1024).unwrap();
    let model = FluxModel::new(
        &pb,
        FluxConfig {
            prefix: "transformer".into(),
            ..FluxConfig::dev()
        },
    )
    .unwrap();
    assert_eq!(model.config.layout, FluxLayout::Diffusers);
    let params = pb.finish();
    assert_eq!(params.tensors.len(), cat.len(), "every tensor is used");
    let e = run_model(&model, &params, &cat, "flux_tiny", "out", EXACT_HOST);
    println!("flux dev tiny, diffusers names: relative L2 {e:.2e}");
    assert!(e < 1e-4, "relative L2 {e:.3e}");
}

/// A city96-style GGUF (BFL's names without prefix, matrices q8_0, kept quantized) against
/// the reference on the same weights quantized and back (ggml also quantizes the
/// activations it multiplies q8_0 matrices with: a looser bound).
#[test]
fn q8_0_gguf_matches_diffusers_on_its_weights() {
    let mut cat = TensorCatalog::new();
    cat.add_file(
        dir().join("flux_tiny_q8_0.gguf"),
        Some("model.diffusion_model."),
    )
    .unwrap();
    assert_eq!(
        cat.get("model.diffusion_model.double_blocks.0.img_attn.qkv.weight")
            .map(|t| t.dtype),
        Some(DType::Q8_0)
    );
    let pb = ParamBuilder::new(Some(&cat), 1024).unwrap();
    let model = FluxModel::new(&pb, FluxConfig::dev()).unwrap();
    let params = pb.finish();
    assert_eq!(params.tensors.len(), cat.len(), "every tensor is used");
    let e = run_model(&model, &params, &cat, "flux_tiny", "out_q8_0", EXACT_HOST);
    let e_f32 = run_model(&model, &params, &cat, "flux_tiny", "out", EXACT_HOST);
    println!("flux dev tiny, q8_0 GGUF: relative L2 {e:.2e} ({e_f32:.2e} to the f32 weights')");
    assert!(e < 3e-2, "relative L2 {e:.3e}");
}
