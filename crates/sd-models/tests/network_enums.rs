//! The network enums: a diffusion network takes what it needs from `DiffusionInputs` and
//! rejects the rest with a clear input error; graph sizes come from the networks.

use sd_models::diffusion::{DiffusionArch, DiffusionInputs, DiffusionNet};
use sd_models::unet::{HeadSpec, UnetConfig};
use sd_models::{ComputeOptions, GraphCtx, ModelError, ParamBuilder};
use sd_tensor::DType;

fn tiny() -> DiffusionArch {
    DiffusionArch::Unet(UnetConfig {
        model_channels: 8,
        channel_mult: vec![1, 2],
        num_res_blocks: 1,
        attention_resolutions: vec![1],
        heads: HeadSpec::Heads(2),
        context_dim: 8,
        norm_groups: 4,
        ..UnetConfig::sd1()
    })
}

#[test]
fn a_unet_takes_context_and_rejects_what_it_cannot_use() {
    let arch = tiny();
    assert_eq!((arch.in_channels(), arch.latent_multiple()), (4, 2));
    let pb = ParamBuilder::new(None, 1024).unwrap();
    let net = DiffusionNet::new(&pb, &arch).unwrap();
    let mut g = GraphCtx::new(8192, 8192, ComputeOptions::default()).unwrap();
    let x = g.ctx.new_tensor(DType::F32, &[8, 8, 4, 1]).unwrap();
    let t = g.ctx.new_tensor(DType::F32, &[1]).unwrap();
    let c = g.ctx.new_tensor(DType::F32, &[8, 77, 1]).unwrap();
    let extra = g.ctx.new_tensor(DType::F32, &[16, 1]).unwrap();

    let mut ok = DiffusionInputs::new(&x, &t);
    ok.context = Some(&c);
    assert_eq!(net.forward(&mut g, &ok).unwrap().ne(), [8, 8, 4, 1]);

    let input_error = |inputs: &DiffusionInputs<'_>, g: &mut GraphCtx| match net.forward(g, inputs)
    {
        Err(ModelError::Input { name, .. }) => name,
        other => panic!("expected an input error, got {other:?}"),
    };
    assert_eq!(
        input_error(&DiffusionInputs::new(&x, &t), &mut g),
        "context"
    );
    for (field, name) in [("y", "y"), ("guidance", "guidance"), ("pos_ids", "pos_ids")] {
        let mut bad = ok;
        match field {
            "y" => bad.y = Some(&extra),
            "guidance" => bad.guidance = Some(&extra),
            _ => bad.pos_ids = Some(&extra),
        }
        assert_eq!(input_error(&bad, &mut g), name);
    }
}

#[test]
fn graph_sizes_grow_with_the_network() {
    let size = |arch: &DiffusionArch| {
        let pb = ParamBuilder::new(None, 4096).unwrap();
        DiffusionNet::new(&pb, arch).unwrap().graph_size()
    };
    // SD1: 16 transformer blocks, the 16384 nodes the pipeline always used.
    assert_eq!(size(&DiffusionArch::Unet(UnetConfig::sd1())), 16384);
    // 28 blocks (4 per level): twice that.
    let deeper = UnetConfig {
        num_res_blocks: 4,
        ..UnetConfig::sd1()
    };
    assert_eq!(size(&DiffusionArch::Unet(deeper)), 32768);
    assert!(size(&tiny()) <= 16384);
}
