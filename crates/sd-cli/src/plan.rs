//! `sd plan` (also `-M plan`): the plan of a generation, with the same flags, without
//! running it. The models are opened (their tensor lists read), every graph of the run is
//! built and planned against the budget (`Pipeline::plan_run`, the upscaler's tile), and
//! nothing is sampled, computed or uploaded.
//!
//! Printed per model: its input size, how often it runs per image, its segments (bytes of
//! weights, own compute buffer, the session's workspace, cuts and outputs of each), whether
//! it fits, the minimum budget that would fit, and the bytes moved between host and device
//! at each run (weights that stream, inputs, output), and the device it computes on (`on`:
//! `CPU` for a model placed there with `--vae-on-cpu` and the like). A table by default, `--json` for
//! tools. Exit code 0 when every model fits, 1 when one does not (the plan is printed
//! either way).

use sd_exec::PlanSummary;
use sd_pipeline::run_plan::ModelPlan;
use sd_pipeline::runtime::Runtime;
use serde_json::{json, Value};

/// What `sd plan` reports: the run's settings and every model's plan.
pub struct Report {
    /// Image width in pixels.
    pub width: usize,
    /// Image height in pixels.
    pub height: usize,
    /// Sampling steps.
    pub steps: usize,
    /// Guidance scale.
    pub cfg_scale: f32,
    /// Images (`-b`).
    pub batch: usize,
    /// The compute device's name.
    pub device: String,
    /// The `--max-vram` budget on it, if any.
    pub budget: Option<u64>,
    /// The models' plans in run order.
    pub models: Vec<ModelPlan>,
}

impl Report {
    /// The settings of `rt` with the models' plans.
    pub fn new(rt: &Runtime, models: Vec<ModelPlan>) -> Report {
        Report {
            width: 0,
            height: 0,
            steps: 0,
            cfg_scale: 0.0,
            batch: 1,
            device: rt.compute_backend().name().to_string(),
            budget: rt.budget(),
            models,
        }
    }

    /// Whether every model fits.
    pub fn fits(&self) -> bool {
        self.models.iter().all(|m| m.fits())
    }

    /// Bytes moved between host and device for one image after the first runs of each
    /// model (every run of a model counted as a later one).
    pub fn moved_per_image(&self) -> u64 {
        self.models
            .iter()
            .map(|m| m.moved_per_run() * m.runs as u64)
            .sum()
    }

    /// The report as JSON.
    pub fn json(&self) -> Value {
        let models: Vec<Value> = self.models.iter().map(model_json).collect();
        json!({
            "width": self.width,
            "height": self.height,
            "steps": self.steps,
            "cfg_scale": self.cfg_scale,
            "batch": self.batch,
            "device": self.device,
            "budget": self.budget,
            "fits": self.fits(),
            "minimum": self.models.iter().map(|m| m.minimum()).max().unwrap_or(0),
            "moved_per_image": self.moved_per_image(),
            "models": models,
        })
    }

    /// The report as a table.
    pub fn table(&self) -> String {
        let mut s = String::new();
        let budget = match self.budget {
            Some(b) => format!("budget {}", size(b)),
            None => "no budget".to_string(),
        };
        s.push_str(&format!(
            "plan: {}x{}, {} steps, cfg {}, {} image(s) on {} ({budget})\n",
            self.width, self.height, self.steps, self.cfg_scale, self.batch, self.device
        ));
        s.push_str(&format!(
            "{:<24} {:<30} {:>5} {:>4} {:>5} {:>11} {:>11} {:>11}  {}\n",
            "model", "input", "runs", "segs", "fits", "peak", "minimum", "moved/run", "on"
        ));
        for m in &self.models {
            let (segs, peak) = match &m.outcome {
                Ok(p) => (p.segments.len().to_string(), size(p.peak())),
                Err(_) => ("-".into(), "-".into()),
            };
            s.push_str(&format!(
                "{:<24} {:<30} {:>5} {:>4} {:>5} {:>11} {:>11} {:>11}  {}\n",
                m.model,
                m.input,
                m.runs,
                segs,
                if m.fits() { "yes" } else { "NO" },
                peak,
                size(m.minimum()),
                size(m.moved_per_run()),
                m.place,
            ));
        }
        for m in &self.models {
            s.push('\n');
            match &m.outcome {
                Ok(p) => s.push_str(&segments_table(&m.model, p)),
                Err(e) => s.push_str(&format!(
                    "{}: does not fit: segment '{}' needs {} of weights + {} of workspace + \
                     {} of cuts (largest weight '{}', {}); the limit is {}, the minimum \
                     budget {}\n",
                    m.model,
                    e.segment,
                    size(e.weight_bytes),
                    size(e.compute_bytes),
                    size(e.live_cut_bytes),
                    e.largest,
                    size(e.largest_bytes),
                    size(e.limit),
                    size(e.minimum)
                )),
            }
        }
        let diffusion = self.models.iter().find(|m| m.model == "diffusion");
        if let Some(d) = diffusion {
            s.push_str(&format!(
                "\nper step: {} of weights streamed, {} moved in all\n",
                size(d.streamed_per_run()),
                size(d.moved_per_run())
            ));
        }
        s.push_str(&format!(
            "per image: {} moved between host and device\n",
            size(self.moved_per_image())
        ));
        if !self.fits() {
            let min = self.models.iter().map(|m| m.minimum()).max().unwrap_or(0);
            s.push_str(&format!(
                "does not fit: --max-vram {} (at least) would\n",
                size(min)
            ));
        }
        s
    }
}

fn segments_table(model: &str, p: &PlanSummary) -> String {
    let limit = p
        .limit
        .map_or_else(|| "no limit".to_string(), |l| format!("limit {}", size(l)));
    let mut s = format!(
        "{model}: {} ({limit}, {} cut(s) inside blocks)\n",
        if p.segmented {
            format!("{} segments", p.segments.len())
        } else {
            "whole".to_string()
        },
        p.fine_cuts
    );
    s.push_str(&format!(
        "  {:<36} {:>3} {:>6} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11}\n",
        "segment", "dev", "params", "weights", "compute", "workspace", "cuts", "outputs", "need"
    ));
    for d in &p.details {
        s.push_str(&format!(
            "  {:<36} {:>3} {:>6} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11}\n",
            d.name,
            d.device,
            d.params,
            size(d.weight_bytes),
            size(d.compute_bytes),
            size(d.workspace_bytes),
            size(d.cut_bytes),
            size(d.output_bytes),
            size(d.need)
        ));
    }
    s
}

fn model_json(m: &ModelPlan) -> Value {
    let mut v = json!({
        "model": m.model,
        "input": m.input,
        "runs": m.runs,
        "on": m.place,
        "fits": m.fits(),
        "minimum": m.minimum(),
        "streamed_per_run": m.streamed_per_run(),
        "moved_per_run": m.moved_per_run(),
    });
    match &m.outcome {
        Ok(p) => {
            let segments: Vec<Value> = p
                .details
                .iter()
                .map(|d| {
                    json!({
                        "name": d.name,
                        "device": d.device,
                        "params": d.params,
                        "weight_bytes": d.weight_bytes,
                        "compute_bytes": d.compute_bytes,
                        "workspace_bytes": d.workspace_bytes,
                        "cut_bytes": d.cut_bytes,
                        "output_bytes": d.output_bytes,
                        "need": d.need,
                    })
                })
                .collect();
            v["segmented"] = json!(p.segmented);
            v["limit"] = json!(p.limit);
            v["peak"] = json!(p.peak());
            v["fine_cuts"] = json!(p.fine_cuts);
            v["input_bytes"] = json!(p.input_bytes);
            v["output_bytes"] = json!(p.output_bytes);
            v["segments"] = json!(segments);
        }
        Err(e) => {
            v["limit"] = json!(e.limit);
            v["shortfall"] = json!({
                "segment": e.segment,
                "weight_bytes": e.weight_bytes,
                "compute_bytes": e.compute_bytes,
                "live_cut_bytes": e.live_cut_bytes,
                "largest": e.largest,
                "largest_bytes": e.largest_bytes,
            });
        }
    }
    v
}

/// `bytes` in B, KiB, MiB or GiB.
fn size(bytes: u64) -> String {
    let b = bytes as f64;
    if bytes < 1024 {
        format!("{bytes} B")
    } else if b < (1u64 << 20) as f64 {
        format!("{:.1} KiB", b / 1024.0)
    } else if b < (1u64 << 30) as f64 {
        format!("{:.2} MiB", b / (1u64 << 20) as f64)
    } else {
        format!("{:.2} GiB", b / (1u64 << 30) as f64)
    }
}
