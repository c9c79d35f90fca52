//! The benchmark helpers of `sd_models::bench`: synthetic weights in the requested dtype, a
//! UNet step that runs, and the FLOP count of a graph.

use sd_models::bench::{graph_flops, StepShape, SyntheticUnet, UnetStep};
use sd_models::unet::{HeadSpec, UnetConfig};
use sd_models::{ComputeOptions, ParamBuilder};
use sd_tensor::ggml::{Backend, BufferType, Context, Graph};
use sd_tensor::DType;

fn tiny() -> UnetConfig {
    UnetConfig {
        model_channels: 32,
        channel_mult: vec![1, 2],
        num_res_blocks: 1,
        attention_resolutions: vec![1],
        heads: HeadSpec::Heads(4),
        context_dim: 16,
        norm_groups: 8,
        ..UnetConfig::sd1()
    }
}

#[test]
fn synthetic_dtype_applies_to_matrices_only() {
    let pb = ParamBuilder::with_synthetic_dtype(None, 16, DType::F16).unwrap();
    let w = pb.tensor("w", &[64, 32]).unwrap();
    let conv = pb.tensor("conv", &[8, 4, 3, 3]).unwrap();
    let bias = pb.tensor("b", &[64]).unwrap();
    let emb = pb.tensor_f32("pos", &[77, 16]).unwrap();
    assert_eq!(w.dtype(), Some(DType::F16));
    assert_eq!(conv.dtype(), Some(DType::F16));
    assert_eq!(bias.dtype(), Some(DType::F32));
    assert_eq!(emb.dtype(), Some(DType::F32));
    // Rows that do not fit a quantized block stay f32.
    let pb = ParamBuilder::with_synthetic_dtype(None, 16, DType::Q8_0).unwrap();
    assert_eq!(
        pb.tensor("odd", &[4, 20]).unwrap().dtype(),
        Some(DType::F32)
    );
    assert_eq!(
        pb.tensor("ok", &[4, 64]).unwrap().dtype(),
        Some(DType::Q8_0)
    );
}

#[test]
fn graph_flops_counts_matrix_products() {
    let ctx = Context::new_descriptors(8, 8, 0).unwrap();
    let a = ctx.new_tensor(DType::F32, &[24, 10]).unwrap(); // K = 24, M = 10
    let b = ctx.new_tensor(DType::F32, &[24, 7, 3]).unwrap(); // N = 7, batch 3
    let out = ctx.mul_mat(&a, &b).unwrap();
    let sum = ctx.add(&out, &out).unwrap();
    let mut g = Graph::new(&ctx, 8).unwrap();
    g.build_forward_expand(&sum).unwrap();
    assert_eq!(graph_flops(&g), 2.0 * 24.0 * 10.0 * 7.0 * 3.0);
    // The CPU attention kernel: 2 n_q n_kv (d + dv) per head and batch item.
    let q = ctx.new_tensor(DType::F32, &[4 * 8, 5, 2]).unwrap();
    let k = ctx.new_tensor(DType::F32, &[4 * 8, 9, 2]).unwrap();
    let v = ctx.new_tensor(DType::F32, &[4 * 6, 9, 2]).unwrap();
    let o = ctx.attention_host(&q, &k, &v, 4, 0.5).unwrap().unwrap();
    let mut g = Graph::new(&ctx, 8).unwrap();
    g.build_forward_expand(&o).unwrap();
    assert_eq!(graph_flops(&g), 2.0 * 5.0 * 9.0 * 2.0 * (32.0 + 24.0));
}

#[test]
fn synthetic_f16_unet_step_runs_and_counts_its_work() {
    let unet = SyntheticUnet::new(tiny(), DType::F16, &BufferType::cpu(), 3).unwrap();
    let f16 = unet
        .params
        .tensors
        .values()
        .filter(|t| t.dtype() == Some(DType::F16))
        .count();
    assert!(f16 > unet.params.tensors.len() / 3, "{f16} f16 tensors");
    let backend = Backend::cpu(2).unwrap();
    let shape = StepShape {
        batch: 2,
        width: 16,
        height: 16,
        tokens: 7,
    };
    let opts = ComputeOptions {
        exact: false,
        flash_attn: false,
        host_kernels: false,
    };
    let step = UnetStep::new(&unet.model, shape, opts, &backend).unwrap();
    let secs = step.run(&backend).unwrap();
    assert!(secs > 0.0);
    let out = step.output().read_f32().unwrap();
    assert_eq!(out.len(), 2 * 4 * 16 * 16);
    assert!(out.iter().all(|v| v.is_finite()));
    assert!(out.iter().any(|&v| v != 0.0));
    // conv_in alone is 2 * (3 * 3 * 4) * 32 * 16 * 16 * 2 FLOPs; the whole step is far more.
    let conv_in = 2.0 * 36.0 * 32.0 * 256.0 * 2.0;
    assert!(step.flops() > 20.0 * conv_in, "{}", step.flops());
}
