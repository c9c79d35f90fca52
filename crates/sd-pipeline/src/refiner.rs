//! A second diffusion model that takes over sampling part-way (SDXL's refiner): the base
//! model denoises the high-noise steps, the refiner the rest, in one runtime and one budget.
//!
//! The switch follows diffusers' `denoising_end` / `denoising_start` ("ensemble of expert
//! denoisers"): with `start = f` the base keeps the steps whose timestep is at least
//! `round(T - f * T)` (`T` the training timesteps, 1000), the refiner takes the others, from
//! the base's latents without adding noise. Each model keeps its own conditioning (the
//! refiner: bigG only, with aesthetic scores) and multistep samplers start afresh at the
//! switch, as two diffusers pipelines do. diffusers adds one step to the refiner's part for
//! second-order schedulers (its Heun lists each timestep twice); sd-rs samples sigma steps,
//! so the split is the same for every sampler.
//!
//! The base's diffusion network is released before the refiner runs, so the two never need
//! the device at once; the refiner shares the base's first stage.

use std::path::{Path, PathBuf};

use sd_models::diffusion::DiffusionNet;
use sd_models::text_encoder::TextEncoder;
use sd_residency::SourceId;

use crate::error::GenerateError;
use crate::family::{ModelConfigError, ModelSpec, SlotKind};
use crate::pipeline::{open_catalog, runtime_err, ModelFiles, Pipeline};
use crate::runtime::{ModelHandle, Runtime};
use crate::schedule::{NoiseSchedule, Schedule};

/// The refiner of a [`Pipeline`] (see the module documentation).
pub(crate) struct Refiner {
    /// Its detected family and configuration.
    pub(crate) spec: ModelSpec,
    /// The file named in its errors.
    pub(crate) path: PathBuf,
    /// Its text encoders.
    pub(crate) text: Vec<(ModelHandle, TextEncoder)>,
    /// Its diffusion network.
    pub(crate) diffusion: (ModelHandle, DiffusionNet),
    /// The fraction of the steps after which it takes over, in (0, 1).
    pub(crate) start: f32,
}

fn setting(flag: &'static str, message: String) -> GenerateError {
    GenerateError::InvalidSetting { flag, message }
}

/// Checks a switch fraction (`--refiner-start`).
pub(crate) fn check_start(start: f32) -> Result<(), GenerateError> {
    if start.is_finite() && start > 0.0 && start < 1.0 {
        Ok(())
    } else {
        Err(setting(
            "refiner-start",
            format!("{start} is not strictly between 0 and 1"),
        ))
    }
}

/// The number of steps of `sigmas` (descending, last one the end point) the base model
/// runs before the refiner takes over at `start`: the steps whose timestep is at least
/// `round(T - start * T)`.
pub fn switch_index(sigmas: &[f32], schedule: &NoiseSchedule, start: f32) -> usize {
    let steps = sigmas.len().saturating_sub(1);
    let t = schedule.len() as f64;
    let cutoff = (t - f64::from(start) * t).round();
    sigmas[..steps]
        .iter()
        // The discrete schedules' timesteps come back through the log-sigma interpolation
        // within a few 1e-4 of the integers diffusers compares.
        .take_while(|&&s| f64::from(schedule.sigma_to_t(s)) >= cutoff - 1e-2)
        .count()
}

/// A model's text encoders and diffusion network in a runtime.
pub(crate) type Networks = (Vec<(ModelHandle, TextEncoder)>, (ModelHandle, DiffusionNet));

/// Adds the networks of `spec` read from `source` to `runtime` under names with `prefix`.
pub(crate) fn add_networks(
    runtime: &mut Runtime,
    spec: &ModelSpec,
    source: SourceId,
    prefix: &str,
    file_of: &dyn Fn(SlotKind, usize) -> PathBuf,
) -> Result<Networks, GenerateError> {
    let mut text = Vec::with_capacity(spec.text_encoders.len());
    for (i, (slot, arch)) in spec.text_encoders.iter().enumerate() {
        let name = if i == 0 {
            format!("{prefix}text_encoder")
        } else {
            format!("{prefix}text_encoder_{}", i + 1)
        };
        let m = runtime
            .add_model(
                &name,
                crate::pipeline::component_of(slot.kind),
                source,
                |pb| TextEncoder::new(pb, arch),
            )
            .map_err(|e| runtime_err(&file_of(slot.kind, i), e))?;
        text.push(m);
    }
    let (dslot, darch) = &spec.diffusion;
    let diffusion = runtime
        .add_model(
            &format!("{prefix}unet"),
            crate::pipeline::component_of(dslot.kind),
            source,
            |pb| DiffusionNet::new(pb, darch),
        )
        .map_err(|e| runtime_err(&file_of(dslot.kind, 0), e))?;
    Ok((text, diffusion))
}

fn unsupported(path: &Path, message: String) -> GenerateError {
    GenerateError::Config {
        path: path.to_path_buf(),
        source: ModelConfigError::Unsupported(message),
    }
}

impl Pipeline {
    /// Adds a refiner (`--refiner`): the model in `files` takes over sampling after the
    /// fraction `start` of the steps (`--refiner-start`) in every later generation. It must
    /// sample the same latents as this model (same channels and downsampling, a DDPM
    /// schedule); its first stage is not loaded (this model's decodes). Its text encoders
    /// and diffusion network join this pipeline's runtime and budget.
    pub fn add_refiner(&mut self, files: &ModelFiles, start: f32) -> Result<(), GenerateError> {
        check_start(start)?;
        if self.refiner.is_some() {
            return Err(setting("refiner", "a refiner is already loaded".into()));
        }
        let loader = open_catalog(files)?;
        let path = files.primary().unwrap_or(Path::new("")).to_path_buf();
        let _span = tracing::info_span!("load_refiner", path = %path.display()).entered();
        let spec = ModelSpec::detect(&loader).map_err(|source| GenerateError::Config {
            path: path.clone(),
            source,
        })?;
        for slot in spec.slots() {
            if slot.kind != SlotKind::FirstStage
                && loader.names_with_prefix(slot.prefix).next().is_none()
            {
                return Err(unsupported(
                    &path,
                    format!(
                        "the refiner's files have no {} (`{}*`)",
                        slot.what, slot.prefix
                    ),
                ));
            }
        }
        let (probe_w, probe_h) = (1024, 1024);
        if spec.latent_shape(probe_w, probe_h) != self.spec.latent_shape(probe_w, probe_h) {
            return Err(unsupported(
                &path,
                format!(
                    "the {} given with --refiner samples other latents than the {} model \
                     ({:?} vs {:?} at 1024x1024)",
                    spec.family.name(),
                    self.spec.family.name(),
                    spec.latent_shape(probe_w, probe_h),
                    self.spec.latent_shape(probe_w, probe_h)
                ),
            ));
        }
        if !matches!(
            (&spec.schedule, &self.spec.schedule),
            (Schedule::Ddpm(_), Schedule::Ddpm(_))
        ) {
            return Err(unsupported(
                &path,
                format!(
                    "a refiner switch needs two DDPM-schedule models ({} and {})",
                    self.spec.family.name(),
                    spec.family.name()
                ),
            ));
        }
        let source = self
            .runtime
            .add_source(loader)
            .map_err(|e| runtime_err(&path, e))?;
        let file_of = |_: SlotKind, _: usize| path.clone();
        let (text, diffusion) =
            add_networks(&mut self.runtime, &spec, source, "refiner_", &file_of)?;
        tracing::info!(
            family = spec.family.id(),
            start,
            "refiner loaded: it takes over after {:.0}% of the steps",
            start * 100.0
        );
        self.refiner = Some(Refiner {
            spec,
            path,
            text,
            diffusion,
            start,
        });
        Ok(())
    }

    /// Whether a refiner is loaded.
    pub fn has_refiner(&self) -> bool {
        self.refiner.is_some()
    }

    /// The runtime handle of the refiner's diffusion network, when one is loaded.
    pub fn refiner_handle(&self) -> Option<ModelHandle> {
        self.refiner.as_ref().map(|r| r.diffusion.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn discrete(n: usize, schedule: &NoiseSchedule) -> Vec<f32> {
        crate::schedule::Scheduler::Discrete
            .sigmas(n, schedule)
            .unwrap()
    }

    #[test]
    fn the_switch_keeps_the_timesteps_at_or_above_the_cutoff() {
        let s = NoiseSchedule::scaled_linear();
        // 4 discrete steps: timesteps 999, 666, 333, 0; cutoff 500 at 0.5.
        assert_eq!(switch_index(&discrete(4, &s), &s, 0.5), 2);
        // 10 steps: 999, 888, ..., 111, 0; cutoff 200 at 0.8: 999..222 -> 8 steps.
        assert_eq!(switch_index(&discrete(10, &s), &s, 0.8), 8);
        // 20 steps at 0.8: timesteps 999 - 52.58 i >= 200 -> i <= 15.
        assert_eq!(switch_index(&discrete(20, &s), &s, 0.8), 16);
        // A tiny fraction still leaves the first step to the base.
        assert_eq!(switch_index(&discrete(4, &s), &s, 0.001), 1);
        assert_eq!(switch_index(&discrete(4, &s), &s, 0.999), 3);
    }

    #[test]
    fn fractions_outside_the_open_interval_are_refused() {
        for bad in [0.0, 1.0, -0.5, 1.5, f32::NAN] {
            let e = check_start(bad).unwrap_err().to_string();
            assert!(e.contains("refiner-start"), "{e}");
        }
        check_start(0.8).unwrap();
    }
}
