//! The upscaler shares a pipeline's runtime and budget: after a generation and a VAE round
//! trip on a budgeted simulated device, the upscaler (a second model source of the same
//! residency manager) loads and runs under the same `--max-vram`; the VAE's idle weight
//! copies on the device are reclaimed for it, the device's peak never exceeds the budget, and
//! the pixels equal the standalone CPU upscaler's.

use std::path::PathBuf;

use sd_exec::ReclaimEvent;
use sd_pipeline::generate::{Pipeline, Txt2Img};
use sd_pipeline::runtime::{ComputeDevice, ModelHandle, Runtime, RuntimeOptions};
use sd_pipeline::upscale::{
    upscale_image, CpuUpscaler, RuntimeTiles, UpscaleOptions, UpscalerModel,
};
use sd_residency::capacity::MaxVram;

fn builtin() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/builtin/sd-rs-shapes.safetensors")
}

fn upscaler() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../sd-models/tests/fixtures/upscalers/esrgan_old.pth")
}

/// Bytes of `h`'s parameters that have a copy on the compute device.
fn resident(rt: &Runtime, h: ModelHandle) -> u64 {
    let m = rt.engine().manager();
    rt.param_ids(h)
        .unwrap()
        .iter()
        .filter(|&&p| m.param_info(p).unwrap().resident_on_compute)
        .map(|&p| m.tensor(p).unwrap().nbytes() as u64)
        .sum()
}

#[test]
fn upscaler_shares_the_generation_budget_and_reclaims_idle_copies() {
    // 8 MiB: the VAE decodes in segments and keeps some weight blocks and an idle workspace
    // on the device; the upscaler's tiles of 34 pixels need more than what is left, so the
    // engine must release the VAE's workspace and evict some of its weights.
    let budget_mib = 8.0;
    let opts = RuntimeOptions {
        compute: ComputeDevice::Sim {
            bytes: 256 << 20,
            page: 0,
        },
        max_vram: Some(MaxVram::parse(&format!("{}", budget_mib / 1024.0)).unwrap()),
        threads: 2,
        planning_headroom: Some(1 << 20),
        ..RuntimeOptions::default()
    };
    let mut p = Pipeline::load(builtin(), opts).unwrap();
    let params = Txt2Img {
        prompt: "a red circle on a white background".into(),
        width: 64,
        height: 64,
        steps: 2,
        seed: 1,
        threads: 2,
        ..Txt2Img::default()
    };
    let image = p.txt2img(&params, &mut |_, _| {}).unwrap().remove(0);
    // A VAE round trip after the generation (as a hires fix or a preview does) leaves the
    // VAE's weight copies on the device, idle.
    let latents = p.encode(&image, None).unwrap();
    let image = p.decode(&latents, None).unwrap();
    let h = p.handles();
    let budget = p.runtime().budget().unwrap();
    let rt = p.runtime_mut();
    let before = resident(rt, h.unet) + resident(rt, h.vae) + resident(rt, h.text_encoder);
    println!("after generation: diffusion weights on the device {before} bytes, budget {budget}");

    let model = UpscalerModel::add(rt, upscaler()).unwrap();
    rt.engine_mut().take_reclaim_log();
    rt.sim_device().unwrap().reset_peak();
    let opts = UpscaleOptions {
        tile_size: 32,
        repeats: 1,
    };
    let out = {
        let mut tiles = RuntimeTiles {
            rt: &mut *rt,
            model: &model,
        };
        upscale_image(&mut tiles, &image, &opts).unwrap()
    };
    assert_eq!((out.width(), out.height()), (256, 256));
    let peak = rt.sim_device().unwrap().peak_bytes();
    let log = rt.engine_mut().take_reclaim_log();
    let released = log
        .iter()
        .filter(|e| matches!(e, ReclaimEvent::ReleasedWorkspace { .. }))
        .count();
    let evicted: u64 = log
        .iter()
        .filter_map(|e| match e {
            // Weight blocks, or a staging pool with the weights streamed into it.
            ReclaimEvent::EvictedBlock { bytes, .. }
            | ReclaimEvent::ReleasedStagingPool { bytes, .. } => Some(*bytes),
            _ => None,
        })
        .sum();
    println!("reclaimed: {released} idle workspace(s), {evicted} bytes of weights evicted");
    let after = resident(rt, h.unet) + resident(rt, h.vae) + resident(rt, h.text_encoder);
    let up = resident(rt, model.handle);
    println!(
        "after upscaling: diffusion weights on the device {after} bytes, upscaler {up} bytes, \
         peak {peak}"
    );
    assert!(peak <= budget, "peak {peak} > budget {budget}");
    assert!(released >= 1, "no idle workspace was released: {log:?}");
    assert!(
        before > 0 && after < before && evicted > 0,
        "idle diffusion copies were not reclaimed ({before} -> {after}): {log:?}"
    );

    // The same pixels as the standalone CPU upscaler.
    let mut cpu = CpuUpscaler::open(upscaler(), 2).unwrap();
    let want = upscale_image(&mut cpu, &image, &opts).unwrap();
    assert_eq!(out.pixels(), want.pixels());
}
