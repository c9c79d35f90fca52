//! `Pipeline::plan_run` (what `sd plan` prints) against the run that follows, on a simulated
//! device with the built-in model: per segment, the weight and compute-buffer bytes planned
//! are what the engine's reports of the run say; every segment's footprint (less the cut
//! entries kept for the segments still in flight ahead of it) stays within its planned need; the weight bytes uploaded per sampling step are at least the plan's and
//! close to it (none when the weights fit beside the workspace).

use sd_pipeline::generate::{Pipeline, Txt2Img};
use sd_pipeline::run_plan::ModelPlan;
use sd_pipeline::runtime::{ComputeDevice, RuntimeOptions};
use sd_residency::capacity::MaxVram;

fn builtin() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/builtin/sd-rs-shapes.safetensors")
}

fn params(steps: usize) -> Txt2Img {
    Txt2Img {
        prompt: "a red circle on a white background".into(),
        width: 64,
        height: 64,
        steps,
        cfg_scale: 5.0,
        seed: 5,
        threads: 2,
        ..Txt2Img::default()
    }
}

fn load(budget_mib: u64) -> Pipeline {
    Pipeline::load(
        builtin(),
        RuntimeOptions {
            compute: ComputeDevice::Sim {
                bytes: 256 << 20,
                page: 0,
            },
            max_vram: Some(MaxVram::parse(&format!("{}", budget_mib as f64 / 1024.0)).unwrap()),
            threads: 2,
            ..RuntimeOptions::default()
        },
    )
    .unwrap()
}

fn check(plan: &ModelPlan, reports: &[sd_exec::SegmentReport]) {
    let p = plan.outcome.as_ref().unwrap();
    let names: Vec<&str> = p.details.iter().map(|d| d.name.as_str()).collect();
    let ran: Vec<&str> = reports.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(names, ran, "{}", plan.model);
    for (d, r) in p.details.iter().zip(reports) {
        assert_eq!(d.weight_bytes, r.weight_bytes, "{} {}", plan.model, d.name);
        assert_eq!(
            d.compute_bytes, r.compute_bytes,
            "{} {}",
            plan.model, d.name
        );
        assert_eq!(d.params, r.params, "{} {}", plan.model, d.name);
        // (Less the cut entries kept only for segments still in flight ahead of it.)
        assert!(
            r.footprint() - r.held_for_in_flight <= d.need,
            "{} {}: footprint {} (of which {} for segments in flight) > planned need {}",
            plan.model,
            d.name,
            r.footprint(),
            r.held_for_in_flight,
            d.need
        );
    }
}

#[test]
fn the_plan_is_what_the_run_uses() {
    let mut p = load(8);
    let plans = p.plan_run(&params(3), None).unwrap();
    let names: Vec<&str> = plans.iter().map(|m| m.model.as_str()).collect();
    assert_eq!(names, ["text encoder 0", "diffusion", "vae decode"]);
    assert!(plans.iter().all(|m| m.fits()));
    let unet = &plans[1];
    assert!(
        unet.outcome.as_ref().unwrap().segmented,
        "8 MiB should segment the UNet"
    );
    assert_eq!(unet.runs, 3);
    // Nothing ran, nothing was uploaded.
    assert_eq!(p.runtime().sim_device().unwrap().stats().graph_computes, 0);
    assert_eq!(p.runtime().engine().manager().upload_bytes(), 0);

    p.txt2img(&params(3), &mut |_, _| {}).unwrap();
    let h = p.handles();
    check(&plans[0], p.runtime().last_segments(h.text_encoder));
    check(unet, p.runtime().last_segments(h.unet));
    check(&plans[2], p.runtime().last_segments(h.vae));
    let peak = p.runtime().sim_device().unwrap().peak_bytes();
    let planned = plans
        .iter()
        .map(|m| m.outcome.as_ref().unwrap().peak())
        .max()
        .unwrap();
    println!("device peak {peak} B, largest planned need {planned} B");
    assert!(peak <= 8 << 20);
}

#[test]
fn weights_streamed_per_step_are_the_plans() {
    // Two runs that differ by two steps: the difference in uploaded bytes is two steps'.
    for budget in [8, 4] {
        let mut uploads = Vec::new();
        let (mut streamed, mut total) = (0, 0);
        for steps in [2, 4] {
            let mut p = load(budget);
            let plans = p.plan_run(&params(steps), None).unwrap();
            streamed = plans[1].streamed_per_run();
            let plan = plans[1].outcome.as_ref().unwrap();
            total = plan.details.iter().map(|d| d.weight_bytes).sum::<u64>();
            p.txt2img(&params(steps), &mut |_, _| {}).unwrap();
            uploads.push(p.runtime().engine().manager().upload_bytes());
        }
        let per_step = (uploads[1] - uploads[0]) / 2;
        println!(
            "budget {budget} MiB: uploaded per step {per_step} B, planned {streamed} B, \
             UNet weights {total} B"
        );
        // The plan's figure is a lower bound; nothing beyond the weights streams.
        assert!(per_step >= streamed, "{per_step} < {streamed}");
        assert!(per_step <= total, "{per_step} > {total}");
        if streamed == 0 {
            assert_eq!(per_step, 0);
        } else {
            assert!(
                per_step as f64 <= 1.5 * streamed as f64,
                "{per_step} is far over the plan's {streamed}"
            );
        }
    }
}

#[test]
fn minimum_budget_fits_and_below_it_does_not() {
    let mut p = load(8);
    let plans = p.plan_run(&params(2), None).unwrap();
    let min = plans[1].minimum();
    println!("UNet minimum {min} B");
    // At the minimum the diffusion network fits; just below, it does not, naming it.
    let gib = |b: u64| format!("{}", b as f64 / (1u64 << 30) as f64);
    let mk = |b: u64| {
        Pipeline::load(
            builtin(),
            RuntimeOptions {
                compute: ComputeDevice::Sim {
                    bytes: 256 << 20,
                    page: 0,
                },
                max_vram: Some(MaxVram::parse(&gib(b)).unwrap()),
                threads: 2,
                ..RuntimeOptions::default()
            },
        )
        .unwrap()
    };
    let mut at = mk(min);
    let fits = at.plan_run(&params(2), None).unwrap();
    assert!(fits[1].fits(), "{:?}", fits[1].outcome);
    let mut below = mk(min - 1024);
    let short = below.plan_run(&params(2), None).unwrap();
    let e = short[1].outcome.as_ref().unwrap_err();
    assert!(
        e.minimum <= min && e.minimum > min - 1024,
        "{} vs {min}",
        e.minimum
    );
}

/// With a refiner (`Pipeline::add_refiner`), the plan of a run lists the refiner's text
/// encoder and diffusion network after the base's, on the same device and budget, and the
/// base and refiner steps add up to the run's (the switch at 0.5 of 4 euler steps: 2 and 2,
/// as `refiner::switch_index` splits the sigmas); preflight plans them too.
#[test]
fn a_refiner_is_planned_with_its_share_of_the_steps() {
    let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/pipeline");
    let mut p = Pipeline::load(
        fixtures.join("tiny_sdxl.safetensors"),
        RuntimeOptions {
            compute: ComputeDevice::Sim {
                bytes: 256 << 20,
                page: 0,
            },
            max_vram: Some(MaxVram::parse("0.0625").unwrap()),
            threads: 2,
            ..RuntimeOptions::default()
        },
    )
    .unwrap();
    p.add_refiner(
        &sd_pipeline::generate::ModelFiles::single(fixtures.join("tiny_sdxl_refiner.safetensors")),
        0.5,
    )
    .unwrap();
    let params = Txt2Img {
        width: 64,
        height: 64,
        ..params(4)
    };
    let plans = p.plan_run(&params, None).unwrap();
    let names: Vec<&str> = plans.iter().map(|m| m.model.as_str()).collect();
    println!("{names:?}");
    let at = |name: &str| -> &ModelPlan {
        plans
            .iter()
            .find(|m| m.model == name)
            .unwrap_or_else(|| panic!("no {name} in {names:?}"))
    };
    let (base, refiner) = (at("diffusion"), at("refiner diffusion"));
    assert_eq!(base.runs + refiner.runs, 4);
    assert_eq!((base.runs, refiner.runs), (2, 2));
    assert!(refiner.outcome.is_ok(), "{:?}", refiner.outcome);
    assert_eq!(refiner.place, base.place);
    assert_eq!(at("refiner text encoder 0").runs, 1);
    let base_pos = names.iter().position(|n| *n == "diffusion").unwrap();
    let ref_pos = names
        .iter()
        .position(|n| *n == "refiner diffusion")
        .unwrap();
    assert!(ref_pos > base_pos);
    let pre = p.preflight(&params, None).unwrap();
    assert!(pre
        .plans
        .iter()
        .any(|(what, _)| what == "refiner diffusion"));
}
