//! [`GenerateError`]: the errors of loading and generating.

use std::path::PathBuf;

use sd_formats::files::FileError;
use sd_models::ModelError;
use sd_tensor::host::ImageError;
use thiserror::Error;

use crate::conditioning::ConditioningError;
use crate::family::ModelConfigError;
use crate::runtime::RuntimeError;
use crate::sampling::SamplingError;

/// An error of loading a model or generating with it.
#[derive(Debug, Error)]
pub enum GenerateError {
    /// The model file cannot be opened or parsed (the message names it).
    #[error(transparent)]
    File(#[from] FileError),
    /// The model file's configuration is invalid or unsupported.
    #[error("{}: {source}", path.display())]
    Config {
        /// The model file.
        path: PathBuf,
        /// The problem.
        #[source]
        source: ModelConfigError,
    },
    /// The model file's tensors do not fit the detected configuration.
    #[error("{}: {source}", path.display())]
    Weights {
        /// The model file.
        path: PathBuf,
        /// The problem.
        #[source]
        source: Box<ModelError>,
    },
    /// A setting is out of range; `flag` names it.
    #[error("{flag}: {message}")]
    InvalidSetting {
        /// The setting (`width`, `height`, `steps`, ...).
        flag: &'static str,
        /// What is wrong.
        message: String,
    },
    /// Running a model failed.
    #[error("model evaluation failed: {0}")]
    Model(#[source] Box<ModelError>),
    /// Text conditioning failed.
    #[error(transparent)]
    Conditioning(#[from] ConditioningError),
    /// Sampling failed.
    #[error(transparent)]
    Sampling(#[from] SamplingError),
    /// The decoded image is invalid.
    #[error(transparent)]
    Image(#[from] ImageError),
    /// The runtime failed (backend, residency, execution).
    #[error(transparent)]
    Runtime(Box<RuntimeError>),
    /// A host tensor had an unexpected shape.
    #[error(transparent)]
    Shape(#[from] sd_tensor::host::ShapeError),
    /// The VAE decoder returned NaN or infinite values (no image is made of them).
    #[error("the VAE decoder returned {count} NaN or infinite values (corrupt VAE weights?)")]
    NonFiniteDecode {
        /// How many values are not finite.
        count: usize,
    },
}

/// How many values of `data` are NaN or infinite.
pub(crate) fn non_finite(data: &[f32]) -> usize {
    data.iter().filter(|v| !v.is_finite()).count()
}

impl From<ModelError> for GenerateError {
    fn from(e: ModelError) -> Self {
        GenerateError::Model(Box::new(e))
    }
}
