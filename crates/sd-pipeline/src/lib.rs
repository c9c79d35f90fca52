//! `sd-pipeline`: samplers, schedulers, text conditioning, generation and upscaling of sd-rs.

pub mod conditioning;
pub mod generate;
pub mod hires;
pub mod model_config;
pub mod pipeline;
pub mod preflight;
pub mod prompt;
pub mod rng;
pub mod runtime;
pub mod sampling;
pub mod schedule;
pub mod tokenizer;
pub mod upscale;
pub mod vae_tiling;
