//! Preflight on a simulated device with the built-in model: a run that cannot fit is refused
//! before the first sampling step, naming the minimum budget; a VAE decode that fits at no
//! granularity whole is tiled automatically, and the run then stays within the budget.

use sd_exec::ExecError;
use sd_models::ComputeOptions;
use sd_pipeline::generate::{GenerateError, Pipeline, Txt2Img};
use sd_pipeline::runtime::{ComputeDevice, RuntimeError, RuntimeOptions};
use sd_residency::capacity::MaxVram;

fn builtin() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/builtin/sd-rs-shapes.safetensors")
}

fn params(side: usize) -> Txt2Img {
    Txt2Img {
        prompt: "a red circle on a white background".into(),
        width: side,
        height: side,
        steps: 2,
        cfg_scale: 5.0,
        seed: 5,
        threads: 2,
        ..Txt2Img::default()
    }
}

fn load(budget: u64) -> Pipeline {
    Pipeline::load(
        builtin(),
        RuntimeOptions {
            compute: ComputeDevice::Sim {
                bytes: 256 << 20,
                page: 0,
            },
            max_vram: Some(
                MaxVram::parse(&format!("{}", budget as f64 / (1u64 << 30) as f64)).unwrap(),
            ),
            threads: 2,
            planning_headroom: Some(0),
            // Flash attention: the UNet's attention scores do not dominate its workspace.
            compute_options: ComputeOptions {
                exact: false,
                flash_attn: true,
                host_kernels: false,
            },
            // Whole ops: the probes below take the minimum a decode reports under one
            // budget as what it needs under another; with bands (the default) the graph
            // itself depends on the budget (its band limit).
            band_divisor: None,
            ..RuntimeOptions::default()
        },
    )
    .unwrap()
}

fn minimum(e: &RuntimeError) -> u64 {
    match e {
        RuntimeError::Exec(ExecError::BudgetTooSmall(short)) => short.minimum,
        other => panic!("not a budget error: {other}"),
    }
}

#[test]
fn an_impossible_run_is_refused_before_the_first_step() {
    let mut p = load(256 << 10);
    let mut steps = 0;
    let err = p.txt2img(&params(64), &mut |_, _| steps += 1).unwrap_err();
    assert_eq!(steps, 0, "sampling started");
    let text = err.to_string();
    let GenerateError::Runtime(e) = &err else {
        panic!("not a runtime error: {text}");
    };
    assert!(minimum(e) > 256 << 10, "{text}");
    assert!(
        text.contains("minimum budget") && text.contains("SIM0"),
        "{text}"
    );
    // Nothing was computed on the device.
    let sim = p.runtime().sim_device().unwrap();
    assert_eq!(sim.stats().graph_computes, 0, "{text}");
}

#[test]
fn a_vae_decode_over_the_budget_is_tiled_automatically() {
    // 96 px: 24x24 latents (the built-in VAE downsamples by 4).
    let side = 96;
    let latent = side / 4;
    // The finest-granularity minimum of the whole decode and of 8-latent tiles.
    let mut probe = load(16 << 10);
    let whole = minimum(&probe.plan_vae(false, latent, latent).unwrap_err());
    let tile = minimum(&probe.plan_vae(false, 8, 8).unwrap_err());
    assert!(tile < whole, "tile {tile} whole {whole}");
    // Just below what the whole decode needs at its finest granularity.
    let budget = whole - 4096;
    let mut p = load(budget);
    let pf = p.preflight(&params(side), None).unwrap();
    println!(
        "decode minimum whole {whole} B, 8-latent tiles {tile} B, budget {budget} B: {:?}",
        pf.vae_tiling
    );
    assert!(pf.auto_tiled);
    let tiling = pf.vae_tiling.unwrap();
    assert!(tiling.tile < latent);
    let images = p.txt2img(&params(side), &mut |_, _| {}).unwrap();
    assert_eq!(images[0].width(), side);
    let peak = p.runtime().sim_device().unwrap().peak_bytes();
    assert!(peak <= budget, "peak {peak} > budget {budget}");
}

#[test]
fn tiles_the_caller_chose_are_made_smaller_when_they_do_not_fit() {
    let side = 96;
    let mut probe = load(16 << 10);
    let t16 = minimum(&probe.plan_vae(false, 16, 16).unwrap_err());
    let t8 = minimum(&probe.plan_vae(false, 8, 8).unwrap_err());
    assert!(t8 < t16, "8-latent tiles {t8} B, 16-latent tiles {t16} B");
    // Room for 8-latent tiles, not for the 16-latent ones asked for.
    let budget = t16 - 4096;
    assert!(budget >= t8);
    let asked = Txt2Img {
        vae_tiling: Some(sd_pipeline::vae_tiling::VaeTiling {
            tile: 16,
            overlap: 4,
        }),
        ..params(side)
    };
    let mut p = load(budget);
    let pf = p.preflight(&asked, None).unwrap();
    let tiling = pf.vae_tiling.unwrap();
    assert!(pf.auto_tiled);
    // The asked overlap's share of the tile (a quarter) is kept.
    assert_eq!((tiling.tile, tiling.overlap), (8, 2), "{pf:?}");
    assert!(
        pf.plans.iter().any(|(m, _)| m == "vae decode (tiles of 8)"),
        "{pf:?}"
    );
    let images = p.txt2img(&asked, &mut |_, _| {}).unwrap();
    assert_eq!(images[0].width(), side);
    let peak = p.runtime().sim_device().unwrap().peak_bytes();
    assert!(peak <= budget, "peak {peak} > budget {budget}");
}
