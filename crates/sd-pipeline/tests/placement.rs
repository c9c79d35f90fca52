//! Models on different compute devices ([`RuntimeOptions::placement`], the CLI's
//! `--clip-on-cpu`/`--vae-on-cpu`): with the built-in model on a simulated GPU, the text
//! encoder and the VAE on the CPU give the all-device image bit for bit (the simulated
//! device computes with the CPU's ggml kernels, and every device resolves the same
//! numerics), the models on the CPU hold nothing on the device and are not planned against
//! its budget (a VAE decode that would be tiled on the device runs whole on the CPU), and
//! the device's peak stays within `--max-vram`.

use sd_exec::ExecError;
use sd_models::ComputeOptions;
use sd_pipeline::generate::{Pipeline, Txt2Img};
use sd_pipeline::runtime::{ComputeDevice, RuntimeError, RuntimeOptions};
use sd_residency::capacity::MaxVram;
use sd_residency::Component;

fn builtin() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/builtin/sd-rs-shapes.safetensors")
}

/// 96 px: 24x24 latents (the built-in VAE downsamples by 4).
const SIDE: usize = 96;

fn params() -> Txt2Img {
    Txt2Img {
        prompt: "a red circle on a white background".into(),
        width: SIDE,
        height: SIDE,
        steps: 2,
        cfg_scale: 5.0,
        seed: 11,
        threads: 2,
        ..Txt2Img::default()
    }
}

/// The built-in model on a 256 MiB simulated device, within `budget` bytes when given,
/// with `placement`.
fn load(budget: Option<u64>, placement: Vec<(Component, ComputeDevice)>) -> Pipeline {
    Pipeline::load(
        builtin(),
        RuntimeOptions {
            compute: ComputeDevice::Sim {
                bytes: 256 << 20,
                page: 0,
            },
            placement,
            max_vram: budget
                .map(|b| MaxVram::parse(&format!("{}", b as f64 / (1u64 << 30) as f64)).unwrap()),
            threads: 2,
            planning_headroom: Some(0),
            // Flash attention: the UNet's attention scores do not dominate its workspace.
            compute_options: ComputeOptions {
                exact: false,
                flash_attn: true,
                host_kernels: false,
            },
            // ggml's ops on the CPU too: models placed there compute the simulated
            // device's bits (the project's CPU attention kernel rounds otherwise).
            host_kernels: false,
            // Whole ops: the test takes the minimum a decode reports under one budget as
            // what it needs under another; with bands the graph depends on the budget.
            band_divisor: None,
            ..RuntimeOptions::default()
        },
    )
    .unwrap()
}

fn on_cpu() -> Vec<(Component, ComputeDevice)> {
    vec![
        (Component::TextEncoder, ComputeDevice::Cpu),
        (Component::Vae, ComputeDevice::Cpu),
    ]
}

fn minimum(e: &RuntimeError) -> u64 {
    match e {
        RuntimeError::Exec(ExecError::BudgetTooSmall(short)) => short.minimum,
        other => panic!("not a budget error: {other}"),
    }
}

#[test]
fn text_encoder_and_vae_on_the_cpu_give_the_all_device_image_within_the_budget() {
    // A budget just below what the whole VAE decode needs on the device at its finest
    // granularity: on the device it would be tiled.
    let mut probe = load(Some(16 << 10), Vec::new());
    let whole = minimum(&probe.plan_vae(false, SIDE / 4, SIDE / 4).unwrap_err());
    let budget = whole - 4096;
    let mut device_only = load(Some(budget), Vec::new());
    assert!(
        device_only.preflight(&params(), None).unwrap().auto_tiled,
        "the all-device decode is tiled at {budget} B"
    );
    drop(device_only);

    let mut placed = load(Some(budget), on_cpu());
    let h = placed.handles();
    let rt = placed.runtime();
    assert!(rt.model_on_cpu(h.vae) && rt.model_on_cpu(h.text_encoder));
    assert!(!rt.model_on_cpu(h.unet));
    assert_eq!(rt.model_budget(h.vae), None);
    assert_eq!(rt.model_budget(h.text_encoder), None);
    assert_eq!(rt.model_budget(h.unet), Some(budget));
    assert_eq!(rt.budget(), Some(budget));
    // The models on the CPU are planned against host memory, not the device budget: the
    // VAE decode is not tiled.
    let pf = placed.preflight(&params(), None).unwrap();
    assert!(!pf.auto_tiled && pf.vae_tiling.is_none(), "{pf:?}");
    for (what, plan) in &pf.plans {
        if what == "diffusion" {
            assert_eq!(plan.limit, Some(budget), "{what}");
        } else {
            assert!(plan.limit.is_none_or(|l| l > budget), "{what}: {plan:?}");
        }
    }
    let image = placed.txt2img(&params(), &mut |_, _| {}).unwrap().remove(0);
    let sim = placed.runtime().sim_device().unwrap();
    let peak = sim.peak_bytes();
    assert!(peak <= budget, "peak {peak} > budget {budget}");
    // The same image with every model on the device, unbudgeted (whole graphs).
    let mut all = load(None, Vec::new());
    let reference = all.txt2img(&params(), &mut |_, _| {}).unwrap().remove(0);
    assert_eq!(image.width(), SIDE);
    assert!(
        image.into_pixels() == reference.into_pixels(),
        "the placed run's pixels differ from the all-device run's"
    );
}

#[test]
fn the_plan_of_a_run_names_each_model_s_device() {
    let mut p = load(Some(8 << 20), vec![(Component::Vae, ComputeDevice::Cpu)]);
    let plans = p.plan_run(&params(), None).unwrap();
    let find = |name: &str| plans.iter().find(|m| m.model == name).unwrap();
    let vae = find("vae decode");
    assert_eq!(vae.place, "CPU");
    assert!(!vae.device);
    assert_eq!(vae.moved_per_run(), 0);
    // Planned against host memory, not the device budget.
    let limit = vae.outcome.as_ref().unwrap().limit;
    assert!(limit.is_none_or(|l| l > 8 << 20), "{limit:?}");
    for name in ["text encoder 0", "diffusion"] {
        let m = find(name);
        assert_eq!(m.place, "SIM0", "{name}");
        assert!(m.device, "{name}");
        assert_eq!(m.outcome.as_ref().unwrap().limit, Some(8 << 20), "{name}");
    }
}

#[test]
fn a_component_without_an_entry_computes_on_the_compute_device() {
    let options = RuntimeOptions {
        compute: ComputeDevice::Sim {
            bytes: 64 << 20,
            page: 0,
        },
        placement: vec![
            (Component::Vae, ComputeDevice::Named("CUDA1".into())),
            (Component::Vae, ComputeDevice::Cpu),
        ],
        ..RuntimeOptions::default()
    };
    assert_eq!(options.device_of(Component::Vae), &ComputeDevice::Cpu);
    assert_eq!(
        options.device_of(Component::TextEncoder),
        &ComputeDevice::Sim {
            bytes: 64 << 20,
            page: 0
        }
    );
    assert_eq!(
        options.device_of(Component::Diffusion),
        &ComputeDevice::Sim {
            bytes: 64 << 20,
            page: 0
        }
    );
}
