//! The Qwen-Image transformer against diffusers' `QwenImageTransformer2DModel` on tiny random
//! weights with its real names (`scripts/fixtures/make_qwen_image_fixtures.py`): one forward
//! pass on packed tokens, f32, on a 3x4 and a 4x4 patch grid; the q8_0 GGUF of the same
//! weights; the latent-space forward (packing) against the token forward.

mod common;

use common::{io_in, ne};
use sd_formats::files::TensorCatalog;
use sd_models::dit::TextTokens;
use sd_models::qwen_image::{position_ids, QwenImageConfig, QwenImageModel};
use sd_models::run::run_cpu;
use sd_models::{load_all_to_cpu, ComputeOptions, GraphCtx, HostData, ParamBuilder};
use sd_tensor::DType;
use sd_testutil::rel_l2;

const PREFIX: &str = "model.diffusion_model.";

fn dir() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen_image")
}

fn catalog(file: &str) -> TensorCatalog {
    let mut cat = TensorCatalog::new();
    let prefix = file.ends_with(".gguf").then_some(PREFIX);
    cat.add_file(dir().join(file), prefix).unwrap();
    cat
}

fn options() -> ComputeOptions {
    ComputeOptions {
        exact: true,
        flash_attn: false,
        // The CPU kernels, as `sd` runs DiTs on the CPU (ggml's attention, the other
        // backends' path, is held to diffusers by the UNet and CLIP tests).
        host_kernels: true,
    }
}

/// Runs the model in `cat` on the fixture's `img_key` tokens (a `grid` of patches) and
/// returns (config, relative L2 error against `want`).
fn run(
    cat: &TensorCatalog,
    img_key: &str,
    grid: (usize, usize),
    want: &str,
) -> (QwenImageConfig, f64) {
    let pb = ParamBuilder::new(Some(cat), 1024).unwrap();
    let model = QwenImageModel::new(&pb, QwenImageConfig::default()).unwrap();
    let params = pb.finish();
    assert_eq!(params.tensors.len(), cat.len(), "every tensor is used");
    let _buf = load_all_to_cpu(&params, cat).unwrap();
    let mut io = io_in(&dir(), "qwen_image_tiny");
    // The q4_K fixture's reference output is a file of its own.
    io.extend(io_in(&dir(), "qwen_image_tiny_q4_k"));
    let mut g = GraphCtx::new(model.graph_size(), model.graph_size(), options()).unwrap();
    let new = |g: &GraphCtx, key: &str| g.ctx.new_tensor(DType::F32, &ne(&io[key].shape)).unwrap();
    let (img, txt, t) = (new(&g, img_key), new(&g, "txt"), new(&g, "timestep"));
    let out = model
        .forward_tokens(&mut g, &img, TextTokens::States(&txt), &t, grid)
        .unwrap();
    assert_eq!(out.ne()[..3].to_vec(), ne(&io[want].shape));
    let inputs = [
        (&img, HostData::F32(io[img_key].data.clone())),
        (&txt, HostData::F32(io["txt"].data.clone())),
        (&t, HostData::F32(io["timestep"].data.clone())),
    ];
    let got = run_cpu(&g, &[&out], &inputs, model.graph_size(), 2).unwrap();
    (model.config.clone(), rel_l2(&got[0], &io[want].data))
}

#[test]
fn qwen_image_matches_diffusers() {
    let cat = catalog("qwen_image_tiny.safetensors");
    let (c, e) = run(&cat, "img", (3, 4), "out");
    let (_, e_sq) = run(&cat, "img_sq", (4, 4), "out_sq");
    println!("qwen-image tiny: relative L2 {e:.2e} (3x4 grid), {e_sq:.2e} (4x4)");
    assert_eq!(
        (c.hidden_size, c.num_heads, c.num_layers, c.mlp_hidden),
        (64, 2, 2, 256)
    );
    assert_eq!(
        (
            c.axes_dim,
            c.joint_attention_dim,
            c.in_channels,
            c.out_channels
        ),
        ([4, 14, 14], 32, 64, 16)
    );
    assert!(e < 1e-4, "relative L2 {e:.3e}");
    assert!(e_sq < 1e-4, "relative L2 {e_sq:.3e}");
}

/// The q8_0 GGUF (names without prefix) against the reference on the same weights quantized
/// and dequantized (ggml also quantizes the activations it multiplies q8_0 matrices with: a
/// looser bound).
#[test]
fn q8_0_gguf_matches_diffusers_on_its_weights() {
    let cat = catalog("qwen_image_tiny_q8_0.gguf");
    assert_eq!(
        cat.get("model.diffusion_model.transformer_blocks.0.attn.to_q.weight")
            .map(|t| t.dtype),
        Some(DType::Q8_0)
    );
    let (_, e) = run(&cat, "img", (3, 4), "out_q8_0");
    println!("qwen-image tiny, q8_0 GGUF: relative L2 {e:.2e}");
    assert!(e < 2e-2, "relative L2 {e:.3e}");
}

/// A q4_K GGUF as llama.cpp's quantizers lay one out (matrices of whole 256-value rows in
/// q4_K, here the MLP down projections; the other matrices q8_0; `kquants.py` makes the
/// blocks) against the reference on the same weights dequantized by the `gguf` package.
#[test]
fn q4_k_gguf_matches_diffusers_on_its_weights() {
    let cat = catalog("qwen_image_tiny_q4_k.gguf");
    let q4 = cat
        .names_with_prefix("")
        .filter(|n| cat.get(n).map(|t| t.dtype) == Some(DType::Q4K))
        .count();
    assert!(q4 >= 4, "{q4} q4_K tensors");
    assert_eq!(
        cat.get("model.diffusion_model.transformer_blocks.0.img_mlp.net.2.weight")
            .map(|t| t.dtype),
        Some(DType::Q4K)
    );
    let (_, e) = run(&cat, "img", (3, 4), "out_q4_k");
    println!("qwen-image tiny, q4_K GGUF ({q4} q4_K tensors): relative L2 {e:.2e}");
    assert!(e < 2e-2, "relative L2 {e:.3e}");
}

#[test]
fn position_ids_are_centred_and_text_follows() {
    // diffusers' QwenEmbedRope(scale_rope=True): rows of a height-3 grid at -2, -1, 0;
    // columns of width 4 at -2..=1; text from max(3/2, 4/2) = 2 on every axis.
    let (img, txt) = position_ids(3, 4, 2);
    assert_eq!(img[0], [0.0, -2.0, -2.0]);
    assert_eq!(img[11], [0.0, 0.0, 1.0]);
    assert_eq!(txt, vec![[2.0; 3], [3.0; 3]]);
}

/// The forward on latents `[W, H, 16, B]` packs 2x2 patches as diffusers' `_pack_latents`:
/// packing the fixture's tokens into latents and running `forward` gives the token forward's
/// output, unpacked the same way.
#[test]
fn latent_forward_packs_like_diffusers() {
    let cat = catalog("qwen_image_tiny.safetensors");
    let pb = ParamBuilder::new(Some(&cat), 1024).unwrap();
    let model = QwenImageModel::new(&pb, QwenImageConfig::default()).unwrap();
    let params = pb.finish();
    let _buf = load_all_to_cpu(&params, &cat).unwrap();
    let io = io_in(&dir(), "qwen_image_tiny");
    // 3x4 grid of patches: latents 8 wide, 6 high.
    let (b, c, h, w) = (2, 16, 6, 8);
    let latents = unpack(&io["img"].data, b, c, h, w);
    let mut g = GraphCtx::new(model.graph_size(), model.graph_size(), options()).unwrap();
    let x = g.ctx.new_tensor(DType::F32, &[w, h, c, b]).unwrap();
    let txt = g.ctx.new_tensor(DType::F32, &ne(&io["txt"].shape)).unwrap();
    let t = g.ctx.new_tensor(DType::F32, &[b]).unwrap();
    let out = model
        .forward(&mut g, &x, &t, TextTokens::States(&txt))
        .unwrap();
    let inputs = [
        (&x, HostData::F32(latents)),
        (&txt, HostData::F32(io["txt"].data.clone())),
        (&t, HostData::F32(io["timestep"].data.clone())),
    ];
    let got = run_cpu(&g, &[&out], &inputs, model.graph_size(), 2).unwrap();
    let want = unpack(&io["out"].data, b, c, h, w);
    let e = rel_l2(&got[0], &want);
    println!("qwen-image tiny on latents: relative L2 {e:.2e}");
    assert!(e < 1e-4, "relative L2 {e:.3e}");
}

/// The text embedding computed apart (`embed_text`, as a runner cache holds it across steps)
/// and fed back as [`TextTokens::Embedded`] gives the bits of the pass that embeds the states
/// itself; an embedding of the wrong width is refused naming the text.
#[test]
fn embedded_text_gives_the_bits_of_the_whole_pass() {
    let cat = catalog("qwen_image_tiny.safetensors");
    let pb = ParamBuilder::new(Some(&cat), 1024).unwrap();
    let model = QwenImageModel::new(&pb, QwenImageConfig::default()).unwrap();
    let params = pb.finish();
    let _buf = load_all_to_cpu(&params, &cat).unwrap();
    let io = io_in(&dir(), "qwen_image_tiny");
    let size = model.graph_size();
    let states = HostData::F32(io["txt"].data.clone());

    let mut g = GraphCtx::new(size, size, options()).unwrap();
    let txt = g.ctx.new_tensor(DType::F32, &ne(&io["txt"].shape)).unwrap();
    let emb = model.embed_text(&mut g, &txt).unwrap();
    let embedded = run_cpu(&g, &[&emb], &[(&txt, states.clone())], size, 2).unwrap();

    let pass = |text_embedded: bool| {
        let mut g = GraphCtx::new(size, size, options()).unwrap();
        let new = |g: &GraphCtx, ne: &[usize]| g.ctx.new_tensor(DType::F32, ne).unwrap();
        let img = new(&g, &ne(&io["img"].shape));
        let t = new(&g, &ne(&io["timestep"].shape));
        let (txt, data) = if text_embedded {
            (new(&g, &emb.ne()), HostData::F32(embedded[0].clone()))
        } else {
            (new(&g, &ne(&io["txt"].shape)), states.clone())
        };
        let tokens = if text_embedded {
            TextTokens::Embedded(&txt)
        } else {
            TextTokens::States(&txt)
        };
        let out = model
            .forward_tokens(&mut g, &img, tokens, &t, (3, 4))
            .unwrap();
        let inputs = [
            (&img, HostData::F32(io["img"].data.clone())),
            (&txt, data),
            (&t, HostData::F32(io["timestep"].data.clone())),
        ];
        run_cpu(&g, &[&out], &inputs, size, 2).unwrap().remove(0)
    };
    assert_eq!(pass(true), pass(false));

    let mut g = GraphCtx::new(size, size, options()).unwrap();
    let img = g.ctx.new_tensor(DType::F32, &ne(&io["img"].shape)).unwrap();
    let t = g
        .ctx
        .new_tensor(DType::F32, &ne(&io["timestep"].shape))
        .unwrap();
    let wrong = g.ctx.new_tensor(DType::F32, &ne(&io["txt"].shape)).unwrap();
    let err = model
        .forward_tokens(&mut g, &img, TextTokens::Embedded(&wrong), &t, (3, 4))
        .unwrap_err()
        .to_string();
    assert!(err.contains("text width"), "{err}");
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
                            let o = ((bi * c + ch) * h + 2 * r + ph) * w + 2 * col + pw;
                            out[o] = tokens[t];
                        }
                    }
                }
            }
        }
    }
    out
}
