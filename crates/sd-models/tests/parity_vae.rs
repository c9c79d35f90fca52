//! AutoencoderKL parity against diffusers (tiny random weights, fixtures by
//! `scripts/fixtures/make_model_fixtures.py`): encoder moments and decoder output.

mod common;

use common::{catalog, check, config, io, ne};
use sd_models::run::run_cpu;
use sd_models::vae::{AutoencoderKl, VaeConfig};
use sd_models::{load_all_to_cpu, ComputeOptions, GraphCtx, HostData, ParamBuilder};
use sd_tensor::DType;

fn tiny_config() -> VaeConfig {
    let c = config("vae");
    let chans: Vec<usize> = c["block_out_channels"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as usize)
        .collect();
    VaeConfig {
        in_channels: c["in_channels"].as_u64().unwrap() as usize,
        out_channels: c["out_channels"].as_u64().unwrap() as usize,
        ch: chans[0],
        ch_mult: chans.iter().map(|&x| x / chans[0]).collect(),
        num_res_blocks: c["layers_per_block"].as_u64().unwrap() as usize,
        z_channels: c["latent_channels"].as_u64().unwrap() as usize,
        norm_groups: c["norm_num_groups"].as_u64().unwrap() as usize,
        ..VaeConfig::default()
    }
}

fn run(encode: bool, opts: ComputeOptions) -> (Vec<f32>, Vec<f32>) {
    let cat = catalog("vae");
    let pb = ParamBuilder::new(Some(&cat), 1024).unwrap();
    let vae = AutoencoderKl::new(&pb, tiny_config()).unwrap();
    let _buf = load_all_to_cpu(&pb.finish(), &cat).unwrap();
    // Every tensor of the file is used.
    assert_eq!(pb.finish().tensors.len(), cat.len());
    let refs = io("vae");
    let (inp, want) = if encode {
        (&refs["x"], &refs["moments"])
    } else {
        (&refs["z"], &refs["decoded"])
    };
    let mut g = GraphCtx::new(4096, 4096, opts).unwrap();
    let x = g.ctx.new_tensor(DType::F32, &ne(&inp.shape)).unwrap();
    let out = if encode {
        vae.encode(&mut g, &x).unwrap()
    } else {
        vae.decode(&mut g, &x).unwrap()
    };
    assert_eq!(out.ne().to_vec(), ne(&want.shape));
    let got = run_cpu(
        &g,
        &[&out],
        &[(&x, HostData::F32(inp.data.clone()))],
        4096,
        2,
    )
    .unwrap();
    (got.into_iter().next().unwrap(), want.data.clone())
}

#[test]
fn vae_encode_matches_diffusers() {
    let (got, want) = run(true, ComputeOptions::default());
    check("vae encode moments", &got, &want, 1e-4);
}

#[test]
fn vae_decode_matches_diffusers() {
    let (got, want) = run(false, ComputeOptions::default());
    check("vae decode", &got, &want, 1e-4);
}

#[test]
fn vae_fast_numerics_stay_close() {
    let opts = ComputeOptions {
        exact: false,
        flash_attn: true,
        host_kernels: true,
    };
    let (got, want) = run(false, opts);
    check("vae decode fast", &got, &want, 1e-2);
}

#[test]
fn vae_rejects_bad_input_shape() {
    let pb = ParamBuilder::new(None, 1024).unwrap();
    let vae = AutoencoderKl::new(&pb, tiny_config()).unwrap();
    let mut g = GraphCtx::new(1024, 1024, ComputeOptions::default()).unwrap();
    let x = g.ctx.new_tensor(DType::F32, &[15, 16, 3, 1]).unwrap();
    assert!(vae.encode(&mut g, &x).is_err());
    let z = g.ctx.new_tensor(DType::F32, &[8, 8, 3, 1]).unwrap();
    assert!(vae.decode(&mut g, &z).is_err());
}
