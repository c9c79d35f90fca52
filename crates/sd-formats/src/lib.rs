//! `sd-formats`: what a model file holds and what its tensors are called.
//!
//! - [`files`]: the catalog of tensors in model files (safetensors, GGUF, PyTorch pickles read
//!   without executing them, sharded checkpoints and diffusers folders), each tensor's
//!   [`TensorStorage`] (file, offset, dtype, shape) and the readers that copy its bytes.
//! - [`names`]: canonical tensor names per network (one name table a file), the conversions
//!   from the layouts users have (diffusers, original single files, GGUF) and model version
//!   detection from the names and shapes.
//! - [`storage`]: the location of one tensor's bytes ([`FileId`], [`TensorStorage`]).
//!
//! Nothing here knows about devices or budgets: `sd-residency` decides where weights live,
//! `sd-models` reads its networks' tensors from a catalog of this crate.

pub mod files;
pub mod names;
pub mod storage;

pub use storage::{FileId, TensorStorage};
