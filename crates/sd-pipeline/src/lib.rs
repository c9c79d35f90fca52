//! `sd-pipeline`: model families, samplers, schedulers, text conditioning, generation and
//! upscaling of sd-rs.
//!
//! A generation's data path: [`family`] detects the model and describes its networks,
//! [`pipeline`] loads them into a [`runtime`], [`generate`] runs the one family-agnostic
//! loop (conditioning by the family, sampling with [`guidance`], decoding).

pub mod conditioning;
pub mod error;
pub mod family;
pub mod generate;
pub mod guidance;
pub mod hires;
pub mod params;
pub mod pipeline;
pub mod preflight;
pub mod prompt;
pub mod refiner;
pub mod rng;
pub mod run_plan;
pub mod runner_cache;
pub mod runtime;
pub mod sampling;
pub mod schedule;
pub mod tokenizer;
pub mod tokenizer_qwen;
pub mod tokenizer_t5;
pub mod upscale;
pub mod vae_tiling;
