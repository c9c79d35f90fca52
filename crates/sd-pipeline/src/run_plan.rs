//! The plan of a whole generation without running it (`sd plan`): every model of the run
//! planned against the budget as [`Pipeline::preflight`] plans it (graphs built and planned,
//! nothing computed, no weight read or uploaded), with what does not fit reported instead of
//! failing.
//!
//! Per model: the segments at the requested size and budget ([`PlanSummary::details`]:
//! weights, workspace and cuts of each), whether it fits, the minimum budget that would fit
//! ([`PlanSummary::minimum`], or the engine's [`BudgetShortfall`] when it does not fit), and
//! the bytes it moves between host and device at each run ([`ModelPlan::moved_per_run`]).

use sd_exec::{BudgetShortfall, ExecError, PlanSummary};
use sd_tensor::Image;

use crate::error::GenerateError;
use crate::params::Txt2Img;
use crate::pipeline::{runtime_err, Pipeline};
use crate::runtime::{ModelHandle, Runtime, RuntimeError};
use crate::schedule::Schedule;
use crate::vae_tiling::VaeTiling;

/// The plan of one model of a run.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelPlan {
    /// The model and its task (`text encoder 0`, `diffusion`, `vae decode`, `upscaler`).
    pub model: String,
    /// The graph's input size in words (`77 tokens`, `64x64 latents, batch 2`...).
    pub input: String,
    /// How many times the graph runs for one image (steps, tiles).
    pub runs: usize,
    /// The plan, or why it fits at no granularity.
    pub outcome: Result<PlanSummary, Box<BudgetShortfall>>,
    /// Whether the engine keeps the model's weights on the compute device between runs
    /// (a separate device; the CPU computes on the weights in RAM).
    pub device: bool,
    /// The name of the backend the model computes on (`CPU`, `SIM0`, `CUDA0`...): the
    /// runtime's placement of the model ([`Runtime::model_backend`]).
    pub place: String,
}

impl ModelPlan {
    /// The plan of model `h` of `rt` (`plan`: its graph planned); a graph that fits at no
    /// granularity is kept as its shortfall. Where the model computes is `h`'s device.
    pub fn new(
        model: impl Into<String>,
        input: impl Into<String>,
        runs: usize,
        (rt, h): (&Runtime, ModelHandle),
        plan: Result<PlanSummary, RuntimeError>,
    ) -> Result<ModelPlan, RuntimeError> {
        let backend = rt
            .model_backend(h)
            .ok_or_else(|| RuntimeError::Unknown(format!("model handle {h:?}")))?;
        let (device, place) = (!backend.is_cpu(), backend.name().to_string());
        let outcome = match plan {
            Ok(p) => Ok(p),
            Err(RuntimeError::Exec(ExecError::BudgetTooSmall(s))) => Err(s),
            Err(e) => return Err(e),
        };
        Ok(ModelPlan {
            model: model.into(),
            input: input.into(),
            runs,
            outcome,
            device,
            place,
        })
    }

    /// Whether it fits the budget.
    pub fn fits(&self) -> bool {
        self.outcome.is_ok()
    }

    /// The smallest budget it would fit at its finest granularity.
    pub fn minimum(&self) -> u64 {
        match &self.outcome {
            Ok(p) => p.minimum,
            Err(s) => s.minimum,
        }
    }

    /// Weight bytes uploaded to the device at each run after the first. The residency
    /// manager keeps weights on the device between runs while the budget has room: what
    /// must go is what does not fit beside the largest non-weight need of a segment
    /// (workspace, cuts, outputs), `weights + max(need - weights) - limit`, at most every
    /// weight (a lower bound: the manager evicts in staging blocks, so it may upload a
    /// little more). Zero without a limit and on the CPU.
    pub fn streamed_per_run(&self) -> u64 {
        match (&self.outcome, self.device) {
            (Ok(p), true) => {
                let total: u64 = p.details.iter().map(|d| d.weight_bytes).sum();
                let other = p
                    .details
                    .iter()
                    .map(|d| d.need - d.weight_bytes)
                    .max()
                    .unwrap_or(0);
                p.limit
                    .map_or(0, |l| (total + other).saturating_sub(l).min(total))
            }
            _ => 0,
        }
    }

    /// Bytes moved between host and device at each run after the first: the streamed
    /// weights, the inputs and the output read back. Zero on the CPU.
    pub fn moved_per_run(&self) -> u64 {
        match &self.outcome {
            Ok(p) if self.device => self.streamed_per_run() + p.input_bytes + p.output_bytes,
            _ => 0,
        }
    }
}

impl Pipeline {
    /// Plans every model of generating `params` (with `init` for img2img; see the module
    /// documentation). Unlike [`Pipeline::preflight`], a model that fits at no granularity
    /// is part of the answer, not an error; a VAE pass that does not fit whole is planned in
    /// the tiles the run would switch to.
    pub fn plan_run(
        &mut self,
        params: &Txt2Img,
        init: Option<&Image>,
    ) -> Result<Vec<ModelPlan>, GenerateError> {
        let _span =
            tracing::info_span!("plan_run", width = params.width, height = params.height).entered();
        let path = self.path.clone();
        let err = |e: RuntimeError| runtime_err(&path, e);
        let mut out = Vec::new();
        for i in 0..self.text.len() {
            let tokens = self.spec.text_encoders[i].1.max_tokens();
            let plan = self.plan_text_encoder(i);
            out.push(
                ModelPlan::new(
                    format!("text encoder {i}"),
                    format!("{tokens} tokens"),
                    1,
                    (&self.runtime, self.text[i].0),
                    plan,
                )
                .map_err(err)?,
            );
        }
        let f = self.first_stage.1.downsample_factor().max(1);
        let (lw, lh) = (params.width / f, params.height / f);
        let batch = if params.cfg_scale != 1.0 { 2 } else { 1 };
        let plan = self.plan_diffusion(params);
        let (base_steps, refiner_steps) = self.step_split(params);
        out.push(
            ModelPlan::new(
                "diffusion",
                format!("{lw}x{lh} latents, batch {batch}"),
                base_steps,
                (&self.runtime, self.diffusion.0),
                plan,
            )
            .map_err(err)?,
        );
        for (what, handle, plan) in self.plan_refiner(params) {
            let (input, runs) = if what.ends_with("diffusion") {
                (format!("{lw}x{lh} latents, batch {batch}"), refiner_steps)
            } else {
                ("one prompt chunk".to_string(), 1)
            };
            out.push(
                ModelPlan::new(what, input, runs, (&self.runtime, handle), plan).map_err(err)?,
            );
        }
        let mut passes = Vec::new();
        if let Some(i) = init.filter(|_| self.first_stage.1.has_encoder()) {
            passes.push((true, i.width() / f, i.height() / f));
        }
        passes.push((false, lw, lh));
        for (encode, w, h) in passes {
            let what = if encode { "vae encode" } else { "vae decode" };
            // The tiling the run would use (see `Pipeline::fit_vae`).
            let (tiling, plan) = match self.fit_vae(encode, w, h, params.vae_tiling) {
                Ok((t, p)) => (t, Ok(p)),
                Err(e) => (params.vae_tiling, Err(e)),
            };
            let (model, input, runs) = match tiling {
                Some(t) => {
                    let n = tile_count(w, t) * tile_count(h, t);
                    (
                        format!("{what} (tiles of {})", t.tile),
                        format!("{w}x{h} latents in {n} tiles"),
                        n,
                    )
                }
                None => (what.to_string(), format!("{w}x{h} latents"), 1),
            };
            let vae = (&self.runtime, self.first_stage.0);
            out.push(ModelPlan::new(model, input, runs, vae, plan).map_err(err)?);
        }
        Ok(out)
    }

    /// The steps of a txt2img run at `params` that the base and the refiner take (all the
    /// base's without a refiner).
    fn step_split(&self, params: &Txt2Img) -> (usize, usize) {
        let (Some(r), Schedule::Ddpm(schedule)) = (&self.refiner, &self.spec.schedule) else {
            return (params.steps, 0);
        };
        match params.scheduler.sigmas(params.steps, schedule) {
            Ok(sigmas) => {
                let k = crate::refiner::switch_index(&sigmas, schedule, r.start);
                (k, params.steps.saturating_sub(k))
            }
            Err(_) => (params.steps, params.steps),
        }
    }
}

/// Tiles of `t` along an axis of `n` latents.
fn tile_count(n: usize, t: VaeTiling) -> usize {
    t.starts(n).len()
}
