//! `sd-residency`: where every model weight lives.
//!
//! It owns model files (the [`files`] catalog: safetensors, GGUF, PyTorch pickles), the
//! canonical tensor names and model version detection ([`names`]), and (in later issues) the
//! `DeviceResidencyManager` trait, `ModelManager` and the capacity arithmetic that answers
//! whether a piece of work fits a device.

pub mod capacity;
pub mod files;
pub mod names;
pub mod storage;

pub use storage::{FileId, TensorStorage};
pub mod manager;
pub mod residency;

pub use manager::{
    Component, LoraSpec, ModelManager, ParamInfo, ParamSpec, ResidencyMode,
    MAX_RESIDENCY_BLOCK_BYTES,
};
pub use residency::{
    BackendId, BackendMemoryRequest, BlockId, DeviceResidencyManager, OwnerId, ParamId,
    ResidencyError, SourceId, WeightPrefetchResult, WeightResidencyBlock,
};
