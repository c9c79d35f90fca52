//! UNet parity against diffusers' `UNet2DConditionModel` (tiny random weights, fixtures by
//! `scripts/fixtures/make_model_fixtures.py`), plus the graph-cut marks.

mod common;

use common::{catalog, check, config, io, ne};
use sd_models::run::run_cpu;
use sd_models::unet::{HeadSpec, UnetConfig, UnetModel};
use sd_models::weights::{bf16_attention_for, unquantized_type_for};
use sd_models::{load_all_to_cpu, ComputeOptions, GraphCtx, HostData, ParamBuilder};
use sd_tensor::ggml::GTensor;
use sd_tensor::DType;

fn tiny_config(name: &str) -> UnetConfig {
    let c = config(name);
    let chans: Vec<usize> = c["block_out_channels"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as usize)
        .collect();
    let attention_resolutions = c["down_block_types"]
        .as_array()
        .unwrap()
        .iter()
        .enumerate()
        .filter(|(_, t)| t.as_str().unwrap().starts_with("CrossAttn"))
        .map(|(level, _)| 1usize << level)
        .collect();
    // diffusers' `attention_head_dim` is a head count: one for all levels (SD1), or one per
    // level (SD2, where it is width / 64: a fixed head width).
    let heads = match &c["attention_head_dim"] {
        serde_json::Value::Number(n) => HeadSpec::Heads(n.as_u64().unwrap() as usize),
        serde_json::Value::Array(a) => {
            HeadSpec::HeadDim(chans[0] / a[0].as_u64().unwrap() as usize)
        }
        other => panic!("attention_head_dim {other}"),
    };
    UnetConfig {
        in_channels: c["in_channels"].as_u64().unwrap() as usize,
        out_channels: c["out_channels"].as_u64().unwrap() as usize,
        model_channels: chans[0],
        channel_mult: chans.iter().map(|&x| x / chans[0]).collect(),
        num_res_blocks: c["layers_per_block"].as_u64().unwrap() as usize,
        attention_resolutions,
        heads,
        transformer_depth: vec![1],
        context_dim: c["cross_attention_dim"].as_u64().unwrap() as usize,
        use_linear_in_transformer: c["use_linear_projection"].as_bool().unwrap(),
        norm_groups: c["norm_num_groups"].as_u64().unwrap() as usize,
        ..UnetConfig::sd1()
    }
}

fn run(name: &str, opts: ComputeOptions) -> (Vec<f32>, Vec<f32>, GraphCtx) {
    run_typed(name, opts, None)
}

/// [`run`] with the weights converted to `weight_type` as they load (`sd --type`).
fn run_typed(
    name: &str,
    opts: ComputeOptions,
    weight_type: Option<DType>,
) -> (Vec<f32>, Vec<f32>, GraphCtx) {
    run_with(name, opts, weight_type, false)
}

/// [`run_typed`], the convolutions with f16 kernels as ggml's direct convolution with
/// `direct_conv` (`Context::set_direct_conv`, as the runtime builds for a GPU with
/// `RuntimeOptions::direct_conv`).
fn run_with(
    name: &str,
    opts: ComputeOptions,
    weight_type: Option<DType>,
    direct_conv: bool,
) -> (Vec<f32>, Vec<f32>, GraphCtx) {
    let cat = catalog(name);
    let pb = ParamBuilder::new(Some(&cat), 1024).unwrap();
    pb.set_weight_type(weight_type);
    // As the Runtime loads a quantized type where the CPU kernels run.
    let unquantized = unquantized_type_for(weight_type, opts.host_kernels);
    pb.set_unquantized_type(unquantized);
    let unet = UnetModel::new(&pb, tiny_config(name)).unwrap();
    let params = pb.finish();
    // Every tensor of the file is used.
    assert_eq!(params.tensors.len(), cat.len());
    if let Some(t) = weight_type {
        let kernels = |d: Option<DType>| {
            params
                .tensors
                .iter()
                .filter(|(name, p)| {
                    p.dtype() == d && GTensor::ne(p)[0] == 3 && name.ends_with("weight")
                })
                .count()
        };
        if t.is_quantized() {
            // The linear weights take it; the convolution kernels the unquantized type.
            let linear = params.tensors.iter().filter(|(_, p)| {
                p.dtype() == Some(t) && GTensor::ne(p)[2] == 1 && GTensor::ne(p)[1] > 1
            });
            assert!(linear.count() > 0, "no {t:?} linear weight");
            if let Some(u) = unquantized {
                assert!(kernels(Some(u)) > 0, "no {u:?} convolution kernel");
            }
        } else {
            // The convolution kernels among them.
            assert!(kernels(Some(t)) > 0, "no {t:?} convolution kernel");
        }
    }
    let _buf = load_all_to_cpu(&params, &cat).unwrap();
    let refs = io(name);
    let (xr, tr, cr) = (&refs["x"], &refs["timesteps"], &refs["context"]);
    let mut g = GraphCtx::new(8192, 8192, opts).unwrap();
    g.ctx.set_direct_conv(direct_conv);
    // As the Runtime runs `--type bf16` (and a quantized type on AMX tiles): the
    // attention's products in bf16 too.
    g.ctx
        .set_bf16_attention(bf16_attention_for(weight_type, opts.host_kernels));
    let x = g.ctx.new_tensor(DType::F32, &ne(&xr.shape)).unwrap();
    let t = g.ctx.new_tensor(DType::F32, &ne(&tr.shape)).unwrap();
    let c = g.ctx.new_tensor(DType::F32, &ne(&cr.shape)).unwrap();
    let out = unet.forward(&mut g, &x, &t, &c, None).unwrap();
    let want = &refs["out"];
    assert_eq!(out.ne().to_vec(), ne(&want.shape));
    let inputs = [
        (&x, HostData::F32(xr.data.clone())),
        (&t, HostData::F32(tr.data.clone())),
        (&c, HostData::F32(cr.data.clone())),
    ];
    let got = run_cpu(&g, &[&out], &inputs, 8192, 2).unwrap();
    (got.into_iter().next().unwrap(), want.data.clone(), g)
}

#[test]
fn unet_sd1_matches_diffusers() {
    let (got, want, g) = run("unet_sd1", ComputeOptions::default());
    check("unet_sd1", &got, &want, 1e-4);
    // The time embedding, one cut per input block (conv_in, 2 x 2 res, 1 down = 6), the
    // middle block and one per output block (2 levels x 3).
    let names: Vec<String> = g
        .marks
        .iter()
        .filter(|m| m.level == 0)
        .map(|m| m.name.to_string())
        .collect();
    assert_eq!(names.len(), 1 + 6 + 1 + 6, "{names:?}");
    assert!(names.iter().any(|n| n.starts_with("time_embed")));
    assert!(names.iter().any(|n| n.starts_with("middle_block")));
}

#[test]
fn unet_sd2_linear_projection_matches_diffusers() {
    let (got, want, _) = run("unet_sd2", ComputeOptions::default());
    check("unet_sd2", &got, &want, 1e-4);
}

/// Exact numerics on the project's CPU kernels (f32 im2col, the attention kernel) keep the
/// exact tolerance.
#[test]
fn unet_exact_numerics_on_host_kernels() {
    let opts = ComputeOptions {
        host_kernels: true,
        ..ComputeOptions::default()
    };
    for name in ["unet_sd1", "unet_sd2"] {
        let (got, want, _) = run(name, opts);
        check(&format!("{name} host kernels"), &got, &want, 1e-4);
    }
}

#[test]
fn unet_fast_numerics_stay_close() {
    let opts = ComputeOptions {
        exact: false,
        flash_attn: true,
        host_kernels: true,
    };
    let (got, want, _) = run("unet_sd1", opts);
    check("unet_sd1 fast", &got, &want, 1e-2);
}

/// ggml's ops as a GPU runs them (no CPU kernels, fast numerics, flash attention: Q read
/// through a permuted view, K and V permuted by their f16 casts; GEGLU as one op;
/// convolutions one product per image; 1x1 projections on tokens), SD1 and SD2 layouts,
/// within f16 precision of diffusers.
#[test]
fn unet_ggml_ops_with_flash_attention_stay_close() {
    let opts = ComputeOptions {
        exact: false,
        flash_attn: true,
        host_kernels: false,
    };
    for name in ["unet_sd1", "unet_sd2"] {
        let (got, want, _) = run(name, opts);
        check(&format!("{name} ggml ops, flash"), &got, &want, 1e-2);
    }
}

/// bf16 weights (`sd --type bf16`, or a bf16 checkpoint): the convolutions' products run on
/// bf16 columns with the project's CPU kernels (ggml's CPU product takes a bf16 kernel
/// against bf16 or f32 columns only; an f16 im2col aborted), and so do the attention's
/// where the CPU has AVX512-BF16; on f32 columns with ggml's im2col and attention; both
/// stay within bf16's precision of diffusers' f32 output.
/// The tiny SD1 UNet with `weights` (`sd --type`), on the project's CPU kernels and on
/// ggml's, within 2e-2 of diffusers' f32 output.
fn typed_weights_stay_close(weights: DType) {
    for host_kernels in [true, false] {
        let opts = ComputeOptions {
            exact: false,
            flash_attn: false,
            host_kernels,
        };
        let (got, want, _) = run_typed("unet_sd1", opts, Some(weights));
        check(
            &format!("unet_sd1 {weights:?} host {host_kernels}"),
            &got,
            &want,
            2e-2,
        );
    }
}

/// f16 weights with ggml's direct convolution (`RuntimeOptions::direct_conv`, the implicit
/// GEMM of ggml's CUDA backend; here ggml's CPU kernel of the same op) stay within f16's
/// precision of diffusers' f32 output, 3x3 and 1x1 convolutions alike.
#[test]
fn unet_direct_convolutions_stay_close() {
    let opts = ComputeOptions {
        exact: false,
        flash_attn: false,
        host_kernels: false,
    };
    for name in ["unet_sd1", "unet_sd2"] {
        let (got, want, _) = run_with(name, opts, Some(DType::F16), true);
        check(&format!("{name} direct conv"), &got, &want, 2e-2);
    }
}

#[test]
fn unet_bf16_weights_stay_close() {
    typed_weights_stay_close(DType::BF16);
}

/// q8_0 weights (`sd --type q8_0`): the linear weights quantized (on AMX tiles, each block
/// of rows converted to bf16, where the CPU has them), the convolution kernels in bf16 there
/// (`unquantized_type_for`), else as the file has them; within 8-bit precision of
/// diffusers' f32 output on the project's CPU kernels and on ggml's.
#[test]
fn unet_q8_0_weights_stay_close() {
    typed_weights_stay_close(DType::Q8_0);
}

#[test]
fn unet_synthetic_sd1_and_sd2_configs_declare() {
    // The real configs declare without a file (f32 descriptors only, nothing allocated).
    for (cfg, n) in [(UnetConfig::sd1(), 686), (UnetConfig::sd2(), 686)] {
        let pb = ParamBuilder::new(None, 4096).unwrap();
        UnetModel::new(&pb, cfg).unwrap();
        assert_eq!(pb.finish().tensors.len(), n);
    }
}

#[test]
fn unet_cut_marks_plan_into_block_segments() {
    use sd_graphcut::{plan_view, CapturedGraph, NoMeasure, PlanOptions};
    use sd_tensor::ggml::Graph;

    let pb = ParamBuilder::new(None, 1024).unwrap();
    let unet = UnetModel::new(&pb, tiny_config("unet_sd1")).unwrap();
    let params = pb.finish();
    let param_ids: std::collections::HashSet<_> = params.tensors.values().map(|t| t.id()).collect();
    let mut g = GraphCtx::new(8192, 8192, ComputeOptions::default()).unwrap();
    let x = g.ctx.new_tensor(DType::F32, &[8, 8, 4, 1]).unwrap();
    let t = g.ctx.new_tensor(DType::F32, &[1]).unwrap();
    let c = g.ctx.new_tensor(DType::F32, &[24, 7, 1]).unwrap();
    let out = unet.forward(&mut g, &x, &t, &c, None).unwrap();
    out.set_output();
    let mut graph = Graph::new(&g.ctx, 8192).unwrap();
    graph.build_forward_expand(&out).unwrap();
    let captured = CapturedGraph::capture(&graph, &g.marks, &param_ids).unwrap();
    assert!(
        captured.diagnostics().is_empty(),
        "{:?}",
        captured.diagnostics()
    );
    let plan = plan_view(captured.view(), &PlanOptions::default(), &mut NoMeasure).unwrap();
    // One segment per marked block plus the final one.
    assert_eq!(plan.segments.len(), g.marks.len() + 1, "{}", plan.summary());
}
