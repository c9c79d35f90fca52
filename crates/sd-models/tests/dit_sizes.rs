//! The DiT configurations declare the published model sizes (synthetic parameters: no
//! file, nothing allocated), the sizes the benchmarks stream.

use sd_models::flux::{FluxConfig, FluxModel};
use sd_models::mmdit::{MmditConfig, MmditModel};
use sd_models::qwen_image::{QwenImageConfig, QwenImageModel};
use sd_models::ParamBuilder;

/// Billions of parameters declared by `build`.
fn billions(build: impl FnOnce(&ParamBuilder<'_>)) -> f64 {
    let pb = ParamBuilder::new(None, 1 << 14).unwrap();
    build(&pb);
    // Synthetic parameters are f32.
    pb.finish().nbytes() as f64 / 4.0 / 1e9
}

#[test]
fn dit_configs_have_the_published_sizes() {
    let large = billions(|pb| {
        MmditModel::new(pb, MmditConfig::sd35_large()).unwrap();
    });
    let medium = billions(|pb| {
        MmditModel::new(pb, MmditConfig::sd35_medium()).unwrap();
    });
    let sd3 = billions(|pb| {
        MmditModel::new(pb, MmditConfig::sd3_medium()).unwrap();
    });
    let flux = billions(|pb| {
        FluxModel::new(pb, FluxConfig::dev()).unwrap();
    });
    let qwen = billions(|pb| {
        QwenImageModel::new(pb, QwenImageConfig::default()).unwrap();
    });
    println!(
        "SD3.5 Large {large:.2} B, SD3.5 Medium {medium:.2} B, SD3 Medium {sd3:.2} B, \
         FLUX.1-dev {flux:.2} B, Qwen-Image {qwen:.2} B"
    );
    // Stability: 8.1 B and 2.5 B (2.2 B without the 384x384 position table); SD3 Medium
    // 2 B; BFL: 12 B.
    assert!((8.0..8.3).contains(&large), "{large}");
    assert!((2.4..2.6).contains(&medium), "{medium}");
    assert!((1.9..2.1).contains(&sd3), "{sd3}");
    assert!((11.8..12.0).contains(&flux), "{flux}");
    // Qwen: 20 B (60 blocks of 36 x 3072^2 weights plus the embedders).
    assert!((20.3..20.5).contains(&qwen), "{qwen}");
}

/// FLOPs of one 1024x1024 step counted from the graphs (matrix products, attention
/// included): FLUX.1-dev with 512 T5 tokens (batch 1), SD3.5 Large with CFG (batch 2, 333
/// tokens). Built only, nothing computed.
#[test]
fn dit_step_flops_at_1024() {
    use sd_models::diffusion::{DiffusionArch, DiffusionInputs, DiffusionNet};
    use sd_models::{ComputeOptions, GraphCtx};
    use sd_tensor::DType;
    let flops = |arch: DiffusionArch, b: usize, n_txt: usize| -> f64 {
        let pb = ParamBuilder::new(None, 1 << 14).unwrap();
        let net = DiffusionNet::new(&pb, &arch).unwrap();
        let _params = pb.finish();
        let mut g = GraphCtx::new(
            net.graph_size(),
            net.graph_size(),
            ComputeOptions::default(),
        )
        .unwrap();
        let ctx = g.ctx.clone();
        let (ctx_dim, y_dim, guided) = match &arch {
            DiffusionArch::Flux(f) => (f.context_in_dim, f.vec_in_dim, true),
            DiffusionArch::QwenImage(q) => (q.joint_attention_dim, 0, false),
            DiffusionArch::Mmdit(m) => (m.context_dim, m.pooled_dim, false),
            DiffusionArch::Unet(_) => unreachable!(),
        };
        let x = ctx.new_tensor(DType::F32, &[128, 128, 16, b]).unwrap();
        let t = ctx.new_tensor(DType::F32, &[b]).unwrap();
        let c = ctx.new_tensor(DType::F32, &[ctx_dim, n_txt, b]).unwrap();
        let y = ctx.new_tensor(DType::F32, &[y_dim.max(1), b]).unwrap();
        let gd = ctx.new_tensor(DType::F32, &[b]).unwrap();
        let mut inputs = DiffusionInputs::new(&x, &t);
        inputs.context = Some(&c);
        inputs.y = (y_dim > 0).then_some(&y);
        inputs.guidance = guided.then_some(&gd);
        let out = net.forward(&mut g, &inputs).unwrap();
        let mut graph = sd_tensor::ggml::Graph::new(&ctx, net.graph_size()).unwrap();
        graph.build_forward_expand(&out).unwrap();
        sd_models::bench::graph_flops(&graph)
    };
    let flux = flops(DiffusionArch::Flux(FluxConfig::dev()), 1, 512);
    let sd35 = flops(DiffusionArch::Mmdit(MmditConfig::sd35_large()), 2, 333);
    let qwen = flops(DiffusionArch::QwenImage(QwenImageConfig::default()), 1, 128);
    println!(
        "one 1024x1024 step: FLUX.1-dev {:.1} TFLOP, SD3.5 Large (CFG) {:.1} TFLOP, \
         Qwen-Image (one pass, 128 text tokens) {:.1} TFLOP",
        flux / 1e12,
        sd35 / 1e12,
        qwen / 1e12
    );
    // 2 x weights x the tokens each weight sees (a double block's image weights only the
    // 4096 image tokens, its text weights the text; modulations one vector), plus attention
    // (4 n^2 d per head and block): FLUX 39.6 (single) + 19.8 (double) + 14.9 (attention)
    // TFLOP; SD3.5 Large 47.8 + 14.5 with its batch of 2.
    assert!((70e12..80e12).contains(&flux), "{flux:e}");
    assert!((58e12..66e12).contains(&sd35), "{sd35:e}");
    // Qwen-Image: a block's image weights other than the modulation (12 x 3072^2) see the
    // 4096 image tokens, its text weights the 128 text tokens, the modulations (a third of
    // the 20.4 B) one vector; attention 4 x 4224^2 x 3072 per block: 55.7 + 1.7 + 13.2 =
    // 70.6 TFLOP.
    assert!((66e12..76e12).contains(&qwen), "{qwen:e}");
}

/// In FLUX's and Qwen-Image's graphs every RMS norm (the QK norms) is followed by the
/// product with its scale and nothing else that computes (only weights, which a segment
/// graph lists before its ops, may sit between in a graph built from the output): ggml's
/// CUDA backend fuses the pair only when they are adjacent. Built only, nothing computed.
#[test]
fn qk_norms_are_followed_by_their_scale_product() {
    use sd_models::diffusion::{DiffusionArch, DiffusionInputs, DiffusionNet};
    use sd_models::{ComputeOptions, GraphCtx};
    use sd_tensor::DType;
    let mut flux = FluxConfig::dev();
    flux.depth = 1;
    flux.depth_single_blocks = 1;
    let qwen = QwenImageConfig {
        num_layers: 1,
        ..QwenImageConfig::default()
    };
    for arch in [DiffusionArch::Flux(flux), DiffusionArch::QwenImage(qwen)] {
        let pb = ParamBuilder::new(None, 1 << 14).unwrap();
        let net = DiffusionNet::new(&pb, &arch).unwrap();
        let _params = pb.finish();
        let opts = ComputeOptions {
            flash_attn: true,
            ..ComputeOptions::default()
        };
        let mut g = GraphCtx::new(net.graph_size(), net.graph_size(), opts).unwrap();
        let ctx = g.ctx.clone();
        let (ctx_dim, y_dim) = match &arch {
            DiffusionArch::Flux(f) => (f.context_in_dim, f.vec_in_dim),
            DiffusionArch::QwenImage(q) => (q.joint_attention_dim, 0),
            _ => unreachable!(),
        };
        let x = ctx.new_tensor(DType::F32, &[16, 16, 16, 1]).unwrap();
        let t = ctx.new_tensor(DType::F32, &[1]).unwrap();
        let c = ctx.new_tensor(DType::F32, &[ctx_dim, 8, 1]).unwrap();
        let y = ctx.new_tensor(DType::F32, &[y_dim.max(1), 1]).unwrap();
        let gd = ctx.new_tensor(DType::F32, &[1]).unwrap();
        let mut inputs = DiffusionInputs::new(&x, &t);
        inputs.context = Some(&c);
        inputs.y = (y_dim > 0).then_some(&y);
        inputs.guidance = matches!(arch, DiffusionArch::Flux(_)).then_some(&gd);
        let out = net.forward(&mut g, &inputs).unwrap();
        let mut graph = sd_tensor::ggml::Graph::new(&ctx, net.graph_size()).unwrap();
        graph.build_forward_expand(&out).unwrap();
        let ops: Vec<_> = graph
            .nodes()
            .into_iter()
            .filter(|n| !n.is_param())
            .collect();
        let norms: Vec<usize> = (0..ops.len())
            .filter(|&i| ops[i].op_name() == "RMS_NORM")
            .collect();
        // Two per attention stream: FLUX's double block (image, text) and single block,
        // Qwen-Image's block (image, text).
        assert!(norms.len() >= 4, "{} RMS norms", norms.len());
        for i in norms {
            let next = &ops[i + 1];
            assert!(
                next.op_name() == "MUL" && next.src(0).is_some_and(|s| s.id() == ops[i].id()),
                "RMS norm {i} is followed by {} ({})",
                next.op_name(),
                next.name()
            );
        }
    }
}
