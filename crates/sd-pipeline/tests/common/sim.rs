//! The simulated-device rig of the budget tests: a runtime on a 64 MiB simulated GPU with a
//! `--max-vram` budget in bytes, no planning headroom and no prefetch (so the peak is the
//! plan's), and what one run reports.

use sd_formats::files::TensorCatalog;
use sd_pipeline::runtime::{ComputeDevice, ModelHandle, Runtime, RuntimeError, RuntimeOptions};
use sd_residency::capacity::MaxVram;

/// A runtime over `loader` on a 64 MiB simulated device with `budget` bytes (`None`: none).
pub fn sim_runtime(loader: TensorCatalog, budget: Option<u64>) -> Result<Runtime, RuntimeError> {
    sim_runtime_with(loader, budget, |_| {})
}

/// [`sim_runtime`] with its options changed by `edit` first.
#[allow(dead_code)]
pub fn sim_runtime_with(
    loader: TensorCatalog,
    budget: Option<u64>,
    edit: impl FnOnce(&mut RuntimeOptions),
) -> Result<Runtime, RuntimeError> {
    let mut options = RuntimeOptions {
        compute: ComputeDevice::Sim {
            bytes: 64 << 20,
            page: 0,
        },
        max_vram: budget
            .map(|b| MaxVram::parse(&format!("{}", b as f64 / (1u64 << 30) as f64)).unwrap()),
        threads: 2,
        planning_headroom: Some(0),
        prefetch: false,
        ..RuntimeOptions::default()
    };
    edit(&mut options);
    Runtime::new(options, loader)
}

/// What the last run of a model reported.
pub struct SimRun {
    /// The output.
    pub out: Vec<f32>,
    /// Its segments' names.
    pub segments: Vec<String>,
    /// The simulated device's peak bytes.
    pub peak: u64,
    /// The weight bytes over all segments.
    pub weights: u64,
    /// The largest segment footprint.
    pub footprint: u64,
}

impl SimRun {
    /// The report of model `h`'s last run, with its output `out`.
    pub fn of(rt: &Runtime, h: ModelHandle, out: Vec<f32>) -> SimRun {
        let reports = rt.last_segments(h);
        SimRun {
            out,
            segments: reports.iter().map(|r| r.name.clone()).collect(),
            peak: rt.sim_device().unwrap().peak_bytes(),
            weights: reports.iter().map(|r| r.weight_bytes).sum(),
            footprint: reports.iter().map(|r| r.footprint()).max().unwrap_or(0),
        }
    }
}

/// `n` deterministic values in [-1, 1) (inputs of the budget tests).
pub fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| (((i as u32).wrapping_mul(2_654_435_761) ^ seed) % 2000) as f32 / 1000.0 - 1.0)
        .collect()
}

/// Checks that `tight` (a run under `budget`) cut inside a block, stayed within the budget
/// and gave `whole`'s bits; prints what it did.
pub fn assert_fine_cuts_fit(whole: &SimRun, tight: &SimRun, budget: u64) {
    let fine = tight.segments.iter().filter(|n| n.contains('/')).count();
    println!(
        "weights {} B, budget {budget} B, peak {} B, {} segments ({fine} inside blocks): {:?}",
        whole.weights,
        tight.peak,
        tight.segments.len(),
        tight.segments
    );
    assert!(fine > 0, "no cut inside a block: {:?}", tight.segments);
    assert!(
        tight.peak <= budget,
        "peak {} > budget {budget}",
        tight.peak
    );
    assert_eq!(tight.out, whole.out, "segmented output differs");
}
