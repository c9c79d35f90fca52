//! `sd-pipeline`: samplers, schedulers, text conditioning, generation and upscaling of sd-rs.

pub mod conditioning;
pub mod prompt;
pub mod rng;
pub mod sampling;
pub mod schedule;
pub mod tokenizer;
